"""StreamingDataset and ShardDataset over a selection (``where=``, ``indices=``): DataLoader
workers and ranks cover it exactly, resume with another world size, a state of another
selection is refused, shards without selected samples are never fetched, reads without a
cache move about the selected bytes only, and side columns come with the samples."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import shardkit
from shardkit import ShardDataset, StreamingDataLoader, StreamingDataset
from shardkit.errors import ConfigError, SampleNotFoundError

N = 600


def items(n: int = N, size: int | None = None) -> list[dict[str, Any]]:
    rng = np.random.default_rng(11)
    return [{"__key__": f"s{i:05d}", "bin": rng.bytes(size or int(rng.integers(20, 400))),
             "__meta__": {"label": i % 10, "run": (i // 20) % 2}} for i in range(n)]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    dest = str(tmp_path_factory.mktemp("wstream") / "ds")
    shardkit.pack(iter(items()), dest, shard_samples=40, progress=False)
    return dest


WHERE = "label < 3 AND shard % 4 != 0"  # shards 0, 4, 8, 12 hold none of it
SELECTED = {f"s{i:05d}" for i in range(N) if i % 10 < 3 and (i // 40) % 4 != 0}


def keys_of(it: Any) -> list[str]:
    out: list[str] = []
    for x in it:
        out.extend(x["__key__"] if isinstance(x["__key__"], list) else [x["__key__"]])
    return out


@pytest.mark.parametrize("cached", [True, False])
def test_ranks_and_dataloader_workers_cover_the_selection(url: str, tmp_path: Path, cached: bool) -> None:
    cache = tmp_path if cached else None
    assert len(SELECTED) % 2 == 0  # no padding: each selected sample exactly once
    got: list[str] = []
    for rank in range(2):
        ds = StreamingDataset(url, cache_dir=cache, shuffle=True, seed=4, where=WHERE, rank=rank, world_size=2,
                              batch_size=8)
        assert ds.samples_per_rank() == len(SELECTED) // 2
        mine = keys_of(StreamingDataLoader(ds, num_workers=2))
        assert len(mine) == len(SELECTED) // 2
        got += mine
    assert Counter(got) == Counter(SELECTED)


def test_resume_mid_epoch_with_another_world_size(url: str, tmp_path: Path) -> None:
    k = 21
    seen: list[str] = []
    state = None
    for rank in range(2):
        s = StreamingDataset(url, cache_dir=tmp_path, shuffle=True, seed=2, where=WHERE, rank=rank, world_size=2)
        s.set_epoch(3)
        it = iter(s)
        seen += [next(it)["__key__"] for _ in range(k)]
        it.close()  # type: ignore[attr-defined]
        state = s.state_dict()
    assert state is not None and state["selection"].startswith("where:") and state["num_samples"] == len(SELECTED)
    rest: list[str] = []
    left = len(SELECTED) - 2 * k
    for rank in range(3):
        s = StreamingDataset(url, cache_dir=tmp_path, shuffle=True, seed=2, where=WHERE, rank=rank, world_size=3,
                             drop_last=True)
        s.load_state_dict(state)
        got = keys_of(s)
        assert len(got) == len(s) == left // 3
        rest += got
    assert not set(seen) & set(rest) and len(set(seen + rest)) == len(seen + rest)
    assert len(SELECTED - set(seen) - set(rest)) == left % 3  # only drop_last's tail is left


def test_a_state_of_another_selection_is_refused_in_one_line(url: str) -> None:
    def saved(**kw: Any) -> dict[str, Any]:
        s = StreamingDataset(url, shuffle=True, **kw)
        it = iter(s)
        next(it)
        it.close()  # type: ignore[attr-defined]
        return s.state_dict()

    other = StreamingDataset(url, shuffle=True, where="label < 2")
    for state in (saved(where=WHERE), saved(), saved(indices=[1, 2, 3])):
        with pytest.raises(ConfigError, match="resume with the same where=/indices=") as info:
            other.load_state_dict(state)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="saved on a selection .* reads the whole dataset"):
        StreamingDataset(url, shuffle=True).load_state_dict(saved(where=WHERE))
    same = StreamingDataset(url, shuffle=True, where=WHERE)
    same.load_state_dict(saved(where=WHERE))
    assert len(same) == len(SELECTED) - 1


def test_indices_stream_exactly_those_samples(url: str) -> None:
    picked = [599, 3, 77, 41, 200]
    s = StreamingDataset(url, shuffle=True, indices=picked)
    got = list(s)
    assert sorted(x["__index__"] for x in got) == sorted(picked) and len(s) == 5
    assert {x["__key__"] for x in got} == {f"s{i:05d}" for i in picked}


@pytest.mark.slow  # a pack to SeaweedFS and a cold epoch: ~10 s on a loaded machine
def test_shards_without_selected_samples_are_never_fetched(s3_env: Any, s3_bucket: str, tmp_path: Path) -> None:
    dest = f"{s3_bucket}/wfetch"
    shardkit.pack(iter(items(240)), dest, shard_samples=30, progress=False)
    ds = StreamingDataset(dest, cache_dir=tmp_path, shuffle=True, where=WHERE)
    assert Counter(keys_of(ds)) == Counter(f"s{i:05d}" for i in range(240) if i % 10 < 3 and (i // 30) % 4 != 0)
    shards = ds.ds.shard_list
    wanted = [s for s in shards if s.shard % 4 != 0]
    assert ds.stats()["bytes_fetched"] == sum(s.bytes for s in wanted)  # each wanted shard once, no other
    cached = {p.name for p in tmp_path.rglob("*.tar")}
    assert cached and not any(Path(s.path).name in cached for s in shards if s.shard % 4 == 0), cached


def test_uncached_reads_move_about_the_selected_bytes(s3_env: Any, s3_bucket: str) -> None:
    # Runs of 20 selected 64 KB samples between runs of 20 unselected (1.3 MB, more than a
    # gap read through): without a cache only the selected runs' bytes are fetched.
    dest = f"{s3_bucket}/wbytes"
    shardkit.pack(iter(items(240, size=64_000)), dest, shard_samples=80, progress=False)
    ds = StreamingDataset(dest, cache_dir=None, where="run = 0")
    got = keys_of(ds)
    assert len(got) == 120
    table = ds.ds.samples
    sizes = table.column("size").to_numpy()
    selected = int(sizes[ds.selection.indices].sum())
    fetched = ds.stats()["bytes_fetched"]
    assert selected <= fetched <= selected + 3 * 1024 * len(ds.ds.shard_list), (fetched, selected)
    assert fetched < 0.6 * int(sizes.sum())  # not the whole dataset


def test_side_columns_come_with_samples_and_batches(tmp_path: Path) -> None:
    dest = str(tmp_path / "ds")
    shardkit.pack(iter(items(100)), dest, shard_samples=30, progress=False)
    shardkit.annotate(dest, pa.table({"key": [f"s{i:05d}" for i in range(0, 100, 2)],
                                      "score": [i / 10 for i in range(0, 100, 2)]}), name="scores")
    s = StreamingDataset(dest, where="score >= 5", annotations=True)
    got = list(s)
    assert sorted(x["__index__"] for x in got) == list(range(50, 100, 2))
    assert all(x["__annotations__"] == {"score": x["__index__"] / 10} for x in got)
    b = StreamingDataset(dest, batch_size=16, annotations=True)
    batches = list(b)
    for batch in batches:
        idx = batch["__index__"].tolist()
        assert batch["__annotations__"]["score"] == [i / 10 if i % 2 == 0 else None for i in idx]
    assert "__annotations__" not in next(iter(StreamingDataset(dest)))
    # Side columns added since a state was saved change what the query selects: refused.
    state = s.state_dict()
    shardkit.annotate(dest, pa.table({"key": ["s00001"], "extra": [1]}), name="more")
    with pytest.raises(ConfigError, match="resume with the same where="):
        StreamingDataset(dest, where="score >= 5").load_state_dict(state)


def test_shard_dataset_over_a_selection(url: str) -> None:
    ds = ShardDataset(url, where=WHERE)
    ordered = sorted(SELECTED)
    assert len(ds) == len(SELECTED)
    assert [ds[i]["__key__"] for i in (0, 5, -1)] == [ordered[0], ordered[5], ordered[-1]]
    assert ds[3]["__index__"] == int(ordered[3][1:])
    assert ds.index_of(ordered[7]) == 7 and ds.by_key(ordered[7])["__key__"] == ordered[7]
    with pytest.raises(SampleNotFoundError, match="is not in where="):
        ds.index_of("s00000")
    with pytest.raises(IndexError, match=f"out of range for {len(SELECTED)} samples"):
        ds[len(SELECTED)]
    assert len(ShardDataset(url, indices=[5, 1])) == 2 and ShardDataset(url, indices=[5, 1])[1]["__index__"] == 5
