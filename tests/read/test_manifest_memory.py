"""A reader with local manifest copies (every reader with a node cache) holds a bounded part of
the sample manifest: fragments beyond ``shardkit.read.dataset.FRAGMENT_BYTES`` are closed least
recently used first, and reopened from the node's local copy (a memory map) when needed again.
Without copies nothing is closed: reopening would fetch from storage. StreamingDataset and
ShardDataset keep copies with or without a shard cache."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

import shardkit
from shardkit.read import dataset as reader
from shardkit.storage.store import Store


@pytest.fixture(scope="module")
def many_fragments(tmp_path_factory: pytest.TempPathFactory) -> str:
    src = tmp_path_factory.mktemp("src")
    for i in range(60):
        (src / f"s{i:03d}.bin").write_bytes(bytes([i]) * (1000 + 37 * i))
    dest = str(tmp_path_factory.mktemp("ds") / "ds")
    shardkit.pack(str(src), dest, shard_bytes="6KB", task_bytes="12KB", progress=False)
    return dest


def all_rows(ds: shardkit.Dataset) -> list[pa.Table]:
    return [ds.shard_samples(s) for s in range(ds.num_shards)]


def test_open_fragments_stay_within_their_byte_budget(many_fragments: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    want = all_rows(shardkit.open_dataset(many_fragments))  # everything open: the default budget
    files = {i.samples_file for i in shardkit.open_dataset(many_fragments).shard_list}
    assert len(files) >= 5
    sizes = sorted(len(Store(many_fragments).read_bytes(f)) for f in files)
    budget = sizes[0] + sizes[1]
    monkeypatch.setattr(reader, "FRAGMENT_BYTES", budget)
    ds = shardkit.open_dataset(many_fragments)
    assert [r.equals(e) for r, e in zip(all_rows(ds), want)] == [True] * len(want)
    assert len(ds._fragments) == len(files)  # no copies: every fragment read stays open
    ds = shardkit.open_dataset(many_fragments)
    ds.manifest_cache = str(tmp_path / "copies")
    for rows, expected in zip(all_rows(ds), want):
        assert rows.equals(expected)
        held = [n for _, n in ds._fragments.values()]
        assert sum(held) <= budget or len(held) == 1  # the one in use always stays
    assert 1 <= len(ds._fragments) <= 2 < len(files)
    monkeypatch.setattr(reader, "FRAGMENT_BYTES", 0)  # below any fragment: only the last one used
    assert [r.equals(e) for r, e in zip(all_rows(ds), want)] == [True] * len(want)
    assert len(ds._fragments) == 1


def test_closed_fragments_reopen_from_the_local_copy(many_fragments: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    want = all_rows(shardkit.open_dataset(many_fragments))
    monkeypatch.setattr(reader, "FRAGMENT_BYTES", 0)
    ds = shardkit.open_dataset(many_fragments)
    ds.manifest_cache = str(tmp_path / "copies")
    assert [r.equals(e) for r, e in zip(all_rows(ds), want)] == [True] * len(want)  # copies made
    read: list[str] = []
    real = Store.read_bytes
    monkeypatch.setattr(Store, "read_bytes", lambda self, rel: read.append(rel) or real(self, rel))
    assert [r.equals(e) for r, e in zip(all_rows(ds), want)] == [True] * len(want)
    assert read == []  # every fragment reopened from its copy, none fetched again
    (_, size), = ds._fragments.values()
    assert size == Path(ds._local_path(next(iter(ds._fragments)))).stat().st_size


def test_random_access_with_a_node_cache_keeps_manifest_copies(many_fragments: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.read.manifest_copies import manifest_copies_dir

    monkeypatch.setattr(reader, "FRAGMENT_BYTES", 0)
    sd = shardkit.ShardDataset(many_fragments, cache_dir=tmp_path / "cache")
    assert sd.ds.manifest_cache is not None and sd.ds.manifest_cache == manifest_copies_dir(
        Path(sd.ds.manifest_cache).name)
    want = {i: bytes([i]) * (1000 + 37 * i) for i in range(60)}
    got = {int(s["__key__"][1:]): bytes(s["bin"]) for s in (sd[k] for k in range(len(sd)))}
    assert got == want
    assert len(sd.ds._fragments) == 1  # the rest were closed, their copies kept
    assert len(list(Path(sd.ds.manifest_cache).glob("*.parquet"))) >= 5


@pytest.mark.parametrize("kind", ["stream", "random"])
def test_readers_without_a_shard_cache_keep_manifests_bounded_too(many_fragments: str, kind: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Streaming shards straight from storage must not mean holding the whole sample manifest
    # (about 1 GB at 20 M samples) in every worker: copies go to the temp dir, not a cache.
    import shutil

    monkeypatch.setattr(reader, "FRAGMENT_BYTES", 0)
    monkeypatch.setattr(reader, "_MEMOS", {})  # as in a fresh process: no rows parsed by the tests before
    want = {f"s{i:03d}": bytes([i]) * (1000 + 37 * i) for i in range(60)}
    if kind == "stream":
        ds: shardkit.StreamingDataset | shardkit.ShardDataset = shardkit.StreamingDataset(many_fragments, shuffle=True)
        samples = list(ds)
    else:
        ds = shardkit.ShardDataset(many_fragments)
        samples = [ds[k] for k in range(len(ds))]
    assert ds.cache_dir is None and ds.ds.manifest_cache is not None
    try:
        assert {s["__key__"]: bytes(s["bin"]) for s in samples} == want
        assert len(ds.ds._fragments) == 1  # the rest were closed, their copies kept
        assert len(list(Path(ds.ds.manifest_cache).glob("*.parquet"))) >= 5
    finally:
        shutil.rmtree(ds.ds.manifest_cache, ignore_errors=True)


@pytest.fixture(scope="module")
def many_small_samples(tmp_path_factory: pytest.TempPathFactory) -> str:
    dest = str(tmp_path_factory.mktemp("small") / "ds")
    samples = ({"__key__": f"k{i:07d}", "bin": i.to_bytes(4, "little"), "cls": b"3"} for i in range(60_000))
    shardkit.pack(samples, dest, shard_bytes="40MB", progress=False)
    return dest


def test_random_access_keeps_no_python_object_per_sample(many_small_samples: str) -> None:
    # ShardDataset[i] parses the shard's rows; a Python str, list and array views per sample
    # cost ~400 B a sample, ~100 MB per process for a 512 MB shard of small samples.
    import gc
    import tracemalloc

    ds = shardkit.ShardDataset(many_small_samples)
    assert len(ds) == 60_000
    rows = ds.ds.shard_rows(0)
    pos = len(rows) - 7
    assert len(rows) > 10_000
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        names, offs, sizes = rows.fields(pos)
        key = rows.key(pos)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert key == f"k{pos:07d}" and names == ["bin", "cls"] and sizes.tolist() == [4, 1]
    assert grown / len(rows) < 40  # flat numpy arrays: ~28 B a sample; was > 300
    got = ds[pos]
    assert got["__key__"] == key and bytes(got["bin"]) == pos.to_bytes(4, "little") and bytes(got["cls"]) == b"3"


def test_parsed_rows_stay_within_their_byte_budget(many_fragments: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = shardkit.open_dataset(many_fragments)
    one = ds.shard_rows(0).nbytes
    monkeypatch.setattr(reader, "ROWS_BYTES", 3 * one)
    monkeypatch.setattr(reader, "_MEMOS", {})  # as in a fresh process
    for shard in range(ds.num_shards):
        rows = ds.cached_rows(shard)
        memo = ds.memo("rows")
        assert shard in memo
        assert sum(r.nbytes for r in memo.values()) <= 3 * one or len(memo) == 1
        assert rows.keys and rows.layout is not None  # built by a reader: counted from the next shard on
    assert 1 <= len(ds.memo("rows")) < ds.num_shards
    assert ds.cached_rows(ds.num_shards - 1) is ds.cached_rows(ds.num_shards - 1)  # kept, not parsed again
