"""Reading a versioned dataset: the latest or ``version=N``, a stream that keeps its version
while the next one commits, resume states tied to their version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shardkit
from shardkit.errors import ConfigError, DatasetNotFoundError
from shardkit.read.manifest import count_faults, read_info, read_shards
from shardkit.storage.store import Store
from textfolders import A, B, text_folder


@pytest.fixture
def v1(tmp_path: Path) -> str:
    url = str(tmp_path / "ds")
    shardkit.pack(str(text_folder(tmp_path / "a", A)), url, shard_samples=3, progress=False)
    return url


def _append(tmp_path: Path, url: str) -> None:
    shardkit.pack(str(text_folder(tmp_path / "b", B)), url, shard_samples=3, progress=False, append=True)


def test_never_appended_is_version_1(v1):
    ds = shardkit.open_dataset(v1)
    assert ds.version == 1 and shardkit.open_dataset(v1, version=1).num_samples == 12
    with pytest.raises(DatasetNotFoundError, match="no version 2: .* has only version 1"):
        shardkit.open_dataset(v1, version=2)


def test_open_latest_or_version(tmp_path, v1):
    _append(tmp_path, v1)
    assert shardkit.open_dataset(v1).version == 2
    assert [s["__key__"] for s in shardkit.open_dataset(v1, version=1).iter_samples()] == A
    assert [s["__key__"] for s in shardkit.open_dataset(v1, version=2).iter_samples()] == A + B
    with pytest.raises(DatasetNotFoundError, match="no version 3: .* has versions 1..2"):
        shardkit.open_dataset(v1, version=3)
    with pytest.raises(ConfigError, match="version: expected a version number >= 1"):
        shardkit.open_dataset(v1, version=0)
    # The root files (what readers without versions open) agree with each other: version 2.
    store = Store(v1)
    info, shards = read_info(store), read_shards(store)
    assert info["dataset_version"] == 2 and count_faults(info, shards) == []


@pytest.mark.parametrize("workers,cached", [(0, False), (2, False), (0, True)])
def test_stream_keeps_its_version_while_next_commits(tmp_path, v1, workers, cached):
    cache = str(tmp_path / "cache") if cached else None
    stream = shardkit.StreamingDataset(v1, batch_size=2, cache_dir=cache)
    loader = shardkit.StreamingDataLoader(stream, num_workers=workers, persistent_workers=workers > 0)
    seen: list[str] = []
    for step, batch in enumerate(loader):
        seen += list(batch["__key__"])
        if step == 1:
            _append(tmp_path, v1)  # version 2 commits mid-epoch
    assert sorted(seen) == A  # the rest of version 1, nothing of version 2
    stream.set_epoch(1)
    assert sorted(k for batch in loader for k in batch["__key__"]) == A  # later epochs too
    latest = shardkit.StreamingDataset(v1, batch_size=2, cache_dir=cache)
    assert sorted(k for batch in latest for k in batch["__key__"]) == sorted(A + B)


def test_state_names_its_version(tmp_path, v1):
    stream = shardkit.StreamingDataset(v1, batch_size=2)
    it = iter(stream)
    first = list(next(it)["__key__"]) + list(next(it)["__key__"])
    state = json.loads(json.dumps(stream.state_dict()))
    it.close()  # type: ignore[attr-defined]
    assert state["dataset_version"] == 1
    _append(tmp_path, v1)
    with pytest.raises(ConfigError) as err:
        shardkit.StreamingDataset(v1, batch_size=2).load_state_dict(state)
    assert "\n" not in str(err.value) and "saved on version 1" in str(err.value) and "version=1" in str(err.value)
    again = shardkit.StreamingDataset(v1, batch_size=2, version=1)
    again.load_state_dict(state)
    rest = [k for batch in again for k in batch["__key__"]]
    assert sorted(first + rest) == A


def test_shard_dataset_opens_a_version(tmp_path, v1):
    _append(tmp_path, v1)
    assert len(shardkit.ShardDataset(v1)) == 18
    old = shardkit.ShardDataset(v1, version=1)
    assert len(old) == 12 and old[11]["__key__"] == A[-1]
