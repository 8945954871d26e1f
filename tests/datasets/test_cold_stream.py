"""Cold readers on S3 serve their first samples while the rest of the shard is still downloading.

The tail of every shard is held back (``RangedReader`` parts from ``GATE_AT`` on wait for a gate
file the test makes only after the first samples came), so each test shows the first batch, or
the first WebDataset sample, or the first ``ShardDataset`` item, arriving before the shard's
last byte did, and the cache file appearing only after. Then every byte is compared.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import webdataset as wds
from torch.utils.data import DataLoader

import shardkit
from procmaps import mapped_file
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.batch.collate import collate
from shardkit.read import shard_source
from shardkit.storage import ranged

pytestmark = pytest.mark.timeout(180)

GATE_AT = 2_500_000  # bytes of each shard that land before the gate opens
SAMPLES = 2_000  # of ~2 KB (~4 KB with their tar headers): two shards of ~4 MB


@pytest.fixture(scope="module")
def dataset(s3_server: Any) -> Iterator[tuple[str, dict[str, Any], dict[str, bytes]]]:
    rng = np.random.default_rng(3)
    data = [{"__key__": f"k{i:05d}", "bin": rng.bytes(int(rng.integers(1_000, 3_000))), "cls": b"%d" % (i % 5)}
            for i in range(SAMPLES)]
    name = f"cold-{os.getpid()}"
    fs = s3_server.filesystem()
    fs.mkdir(name)
    url, opts = f"s3://{name}/ds", s3_server.storage_options()
    shardkit.pack(iter(data), url, shard_bytes="4MB", storage_options=opts, progress=False)
    assert shardkit.open_dataset(url, storage_options=opts).num_shards == 2
    yield url, opts, {d["__key__"]: d["bin"] for d in data}
    fs.rm(name, recursive=True)


@pytest.fixture
def gate(s3_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Hold back shard bytes from GATE_AT on until the returned path exists (forked DataLoader
    workers too); a part that waited out its bound leaves ``late`` behind."""
    opened, late = tmp_path / "gate", tmp_path / "late"
    real = ranged.RangedReader._read_part

    def held(self: ranged.RangedReader, open_body: Any, out: memoryview, base: int, lo: int, hi: int,
             on_part: Any) -> None:
        if "/shards/" in f"/{self.path}" and lo >= GATE_AT:
            deadline = time.monotonic() + 30
            while not opened.exists():
                if time.monotonic() > deadline:
                    late.touch()
                    break
                time.sleep(0.005)
        real(self, open_body, out, base, lo, hi, on_part)

    monkeypatch.setattr(ranged.RangedReader, "_read_part", held)
    monkeypatch.setattr(shard_source, "FETCH_PART_SIZE", 256 << 10)  # several parts before the gate
    return opened


def cached_shards(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*.tar") if ".tmp" not in p.parts)


def batch_items(batch: dict[str, Any]) -> dict[str, bytes]:
    if "bin.offsets" in batch:
        bins, offs = np.asarray(batch["bin"]), np.asarray(batch["bin.offsets"])
        return {k: bins[offs[j]:offs[j + 1]].tobytes() for j, k in enumerate(batch["__key__"])}
    return {k: bytes(v) for k, v in zip(batch["__key__"], batch["bin"])}


@pytest.mark.parametrize("kind", ["main", "workers", "per-sample", "per-sample-main", "zero-copy"])
def test_first_batch_arrives_before_the_shards_tail(dataset: Any, gate: Path, tmp_path: Path, kind: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    url, opts, content = dataset
    if kind == "per-sample-main":
        # Hold back all but the first ~500 KB: the reader's first run of samples (256 of ~4 KB)
        # reaches past it, its first batch (16) does not: it must not wait for the whole run.
        monkeypatch.setattr(sys.modules[__name__], "GATE_AT", 500_000)
    cache = tmp_path / "cache"
    if kind.startswith("per-sample"):  # -main: one reader in this process, its share the whole shard
        sd = StreamingDataset(url, cache_dir=cache, storage_options=opts, loader_batch_size=16)
        loader: Any = DataLoader(sd, batch_size=16, num_workers=0 if kind.endswith("main") else 2, collate_fn=collate)
    else:
        sd = StreamingDataset(url, cache_dir=cache, storage_options=opts, batch_size=16, zero_copy=kind == "zero-copy")
        loader = StreamingDataLoader(sd, num_workers=2 if kind == "workers" else 0)
    it = iter(loader)
    batch = next(it)
    first = batch_items(batch)
    assert len(first) == 16 and all(content[k] == v for k, v in first.items())
    assert cached_shards(cache) == []  # nothing is cached before the whole shard is in and checked
    if kind == "zero-copy":  # no copy: views of the file the download is filling
        where = {mapped_file(np.asarray(v).ctypes.data) for v in batch["bin"]}
        assert len(where) == 1 and where.pop().startswith(str(cache)), where
    gate.touch()
    got = dict(first)
    for later in it:
        got.update(batch_items(later))
    assert got == content
    # Zero-copy views of the landing file hold the same bytes once it is published and closed.
    assert batch_items(batch) == first
    assert not (tmp_path / "late").exists()
    assert len(cached_shards(cache)) == 2
    if kind == "main":
        assert sd.stats()["streamed"] >= 1


def test_webdataset_reads_a_shard_as_it_lands(dataset: Any, gate: Path, tmp_path: Path) -> None:
    url, opts, content = dataset
    cache = tmp_path / "cache"
    stage = shardkit.wds_shards(url, cache_dir=cache, storage_options=opts)
    pipe = iter(wds.DataPipeline(stage, wds.tarfile_to_samples()))
    first = next(pipe)
    assert first["__url__"].startswith("shardkit-landing://") and content[first["__key__"]] == first["bin"]
    assert cached_shards(cache) == []
    gate.touch()
    got = {first["__key__"]: first["bin"]}
    for s in pipe:
        got[s["__key__"]] = s["bin"]
    assert got == content
    assert not (tmp_path / "late").exists() and len(cached_shards(cache)) == 2


def test_random_access_serves_a_sample_of_a_shard_still_landing(dataset: Any, gate: Path, tmp_path: Path) -> None:
    url, opts, content = dataset
    cache = tmp_path / "cache"
    # Its own part size (not the streams' FETCH_PART_SIZE): parts small enough that the gate holds the tail.
    ds = shardkit.ShardDataset(url, cache_dir=cache, storage_options=opts, cache_shards=True, part_size=256 << 10)
    keys = sorted(content)
    assert ds[3]["bin"] == content[keys[3]]  # shard 0 downloads; its tail is held back
    assert cached_shards(cache) == []
    assert ds.stats()["bytes_fetched"] < GATE_AT + (256 << 10) * 8  # not the whole shard
    gate.touch()
    last_of_first = ds.ds.shard_list[0].num_samples - 1
    assert ds[last_of_first]["bin"] == content[keys[last_of_first]]
    ds.close()
    with shardkit.ShardDataset(url, cache_dir=cache, storage_options=opts) as warm:  # no downloads
        assert warm[last_of_first]["bin"] == content[keys[last_of_first]]
        assert warm.stats()["bytes_fetched"] == 0
    assert not (tmp_path / "late").exists()
