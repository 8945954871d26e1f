"""Positional (parallel ranged) cache downloads: a fetch that fills a writable map of the temp file.

Local files stand in for the object store (cachefakes, as in test_cache.py); the last test runs a
cold epoch through ShardSource's ranged-GET reader against the real SeaweedFS fixture.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from cachefakes import MB, NS, FnReader, UsageSampler, pos_store, wait_for
from shardkit.cache.shard_cache import ShardRef
from shardkit.errors import IntegrityError
from shardkit.storage.ranged import RangedReader, RangeReader, StreamReader
from shardkit.storage.store import Store

pytestmark = pytest.mark.timeout(120)


def test_readers_declare_how_they_fill(tmp_path: Path) -> None:
    s, pos = pos_store(tmp_path, [MB])
    ref = s.refs[0]
    store = Store(s.remote.src)
    for reader, parallel in ((pos(ref), True), (s.remote(ref), False), (RangedReader(store, "x"), True),
                             (StreamReader(store, "x", 10), False)):
        assert isinstance(reader, RangeReader) and reader.parallel is parallel


def test_positional_fetch_fills_map_verifies_and_publishes(tmp_path: Path) -> None:
    s, pos = pos_store(tmp_path, [3 * MB + 5, 1 * MB, 0])
    seen: list[tuple[list[int], int, bool]] = []

    def spy(ref: ShardRef) -> FnReader:
        def read_into(start: int, view: memoryview, on_part: Any = None) -> int:
            # In flight: full size at once, under the name that carries the reservation.
            seen.append(([p.stat().st_size for p in s.temps()], cache.usage(), s.final(ref).exists()))
            assert [p.name for p in s.temps()] == [f"{s.final(ref).name}.{ref.size}.{os.getpid()}"]
            return pos.fill(ref, start, view, on_part)
        return FnReader(read_into, parallel=True)

    with s.cache(100 * MB) as cache:
        for ref in s.refs * 2:
            with cache.open(ref, spy) as shard:
                assert bytes(shard.buffer()) == pos.data(ref.name)
                assert os.path.getsize(shard.path) == ref.size
        st = cache.stats()
        assert (st["misses"], st["hits"]) == (3, 3)
        assert st["bytes_fetched"] == sum(r.size for r in s.refs)
        assert cache.usage() == sum(r.size for r in s.refs) and s.temps() == []
    # The empty shard is published without a read: there is nothing to read.
    assert pos.calls() == [(r.name, 0) for r in s.refs if r.size]
    assert seen == [([r.size], sum(q.size for q in s.refs[:i + 1]), False) for i, r in enumerate(s.refs) if r.size]


def test_failed_positional_fetch_keeps_reservation_and_restarts_from_zero(tmp_path: Path) -> None:
    s, pos = pos_store(tmp_path, [4 * MB + 3])
    ref = s.refs[0]
    with s.cache(10 * MB) as cache:
        with pytest.raises(ConnectionError):
            cache.open(ref, replace(pos, fail_after=6))  # 6 of 17 parts landed, out of order
        [tmp] = s.temps()
        assert tmp.stat().st_size == 0  # nothing in it can be trusted; the name keeps the space
        assert cache.usage() == ref.size and cache.stats()["bytes_fetched"] == 0
        with cache.open(ref, pos) as shard:
            assert bytes(shard.buffer()) == pos.data(ref.name)
        assert pos.calls() == [(ref.name, 0), (ref.name, 0)]
        assert s.temps() == [] and cache.stats()["misses"] == 1


def test_sequential_fetch_after_failed_positional_starts_from_zero(tmp_path: Path) -> None:
    s, pos = pos_store(tmp_path, [2 * MB])
    ref = s.refs[0]
    with s.cache(10 * MB) as cache:
        with pytest.raises(ConnectionError):
            cache.open(ref, replace(pos, fail_after=3))
        with cache.open(ref, s.remote) as shard:
            assert bytes(shard.buffer()) == s.remote.data(ref.name)
        assert [c[1] for c in s.remote.calls()] == [0]
        assert cache.stats()["bytes_fetched"] == ref.size


@pytest.mark.parametrize("kind", ["positional", "sequential"])
def test_dead_positional_download_is_not_trusted(tmp_path: Path, kind: str) -> None:
    """A killed positional download leaves a full-size file of holes: its length means nothing."""
    s, pos = pos_store(tmp_path, [2 * MB])
    ref = s.refs[0]
    with s.cache(10 * MB) as cache:  # opened before the "death", so it never swept
        dead = Path(s.cache_dir) / NS / ".tmp" / f"{s.final(ref).name}.{ref.size}.999999999"
        data = bytearray(pos.data(ref.name))
        data[: MB] = b"\0" * MB  # half the parts never landed
        dead.write_bytes(bytes(data))
        fetch: Any = pos if kind == "positional" else s.remote
        with cache.open(ref, fetch) as shard:
            assert bytes(shard.buffer()) == pos.data(ref.name)
        starts = [c[1] for c in (pos.calls() if kind == "positional" else s.remote.calls())]
        # positional: straight from 0; sequential: "resumes" at the end (nothing to read), fails
        # the hash, redoes from 0
        assert starts == [0]
        assert s.temps() == []


def test_corrupt_positional_download_raises_integrity_error_after_one_retry(tmp_path: Path) -> None:
    s, pos = pos_store(tmp_path, [3 * MB])
    ref = s.refs[0]
    with s.cache(10 * MB) as cache:
        with pytest.raises(IntegrityError, match="shard shards/shard-000000.tar: download does not match"):
            cache.open(ref, replace(pos, corrupt=True))
        assert pos.calls() == [(ref.name, 0)] * 2
        assert cache.usage() == 0 and s.temps() == [] and not s.final(ref).exists()


def test_corrupt_once_then_good_is_published(tmp_path: Path) -> None:
    s, pos = pos_store(tmp_path, [3 * MB])
    ref = s.refs[0]
    tries: list[int] = []

    def flaky(r: ShardRef) -> FnReader:
        def read_into(start: int, view: memoryview, on_part: Any = None) -> int:
            tries.append(start)
            return replace(pos, corrupt=len(tries) == 1).fill(r, start, view, on_part)
        return FnReader(read_into, parallel=True)

    with s.cache(10 * MB) as cache:
        with cache.open(ref, flaky) as shard:
            assert bytes(shard.buffer()) == pos.data(ref.name)
    assert tries == [0, 0]


def test_wrong_size_manifest_entry_fails_verification(tmp_path: Path) -> None:
    s, pos = pos_store(tmp_path, [1 * MB])
    good = s.refs[0]
    for ref in (replace(good, size=good.size - 10), replace(good, size=good.size + 10)):
        def fetch(r: ShardRef) -> FnReader:
            def read_into(start: int, view: memoryview, on_part: Any = None) -> int:
                data = pos.data(r.name)[start:start + len(view)]
                view[: len(data)] = data
                return len(data)
            return FnReader(read_into, parallel=True)

        with s.cache(10 * MB) as cache:
            with pytest.raises(IntegrityError, match="shard shards/shard-000000.tar"):
                cache.open(ref, fetch)
            assert cache.usage() == 0 and s.temps() == []


def test_positional_limit_accounting_eviction_and_prefetch(tmp_path: Path) -> None:
    s, pos = pos_store(tmp_path, [1 * MB] * 6)
    limit = int(2.5 * MB)
    with s.cache(limit) as cache:
        sampler = UsageSampler(cache)
        sampler.start()
        for ref in s.refs:
            with cache.open(ref, pos) as shard:
                assert bytes(shard.buffer()) == pos.data(ref.name)
        cache.set_schedule([r.name for r in s.refs[:2]])
        cache.prefetch(s.refs[:2], pos, max_ahead=2)
        wait_for(lambda: cache.stats()["prefetched"] + cache.stats()["prefetch_skipped"] == 2)
        assert sampler.finish() <= limit and sampler.samples > 2
        st = cache.stats()
        assert st["misses"] == 6 and st["evictions"] >= 4 and st["prefetched"] == 2
        assert s.cached() == {s.refs[0].name, s.refs[1].name}
        assert cache.usage() == 2 * MB


def collect(batches: Any) -> dict[str, bytes]:
    """Every sample's bytes by key; a key seen twice fails."""
    got: dict[str, bytes] = {}
    for batch in batches:
        bins, offs = batch["bin"].numpy(), batch["bin.offsets"].numpy()
        for j, k in enumerate(batch["__key__"]):
            assert k not in got
            got[k] = bins[offs[j]:offs[j + 1]].tobytes()
    return got


# ---- S3: ShardSource's ranged-GET fetch on a real server --------------------------------------

def test_cold_epoch_through_parallel_ranged_fetch_s3(s3_env: Any, s3_bucket: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import shardkit
    from shardkit import StreamingDataset
    from shardkit.storage import ranged
    from shardkit.read import shard_source as shardio

    rng = np.random.default_rng(7)
    data = [{"__key__": f"k{i:05d}", "bin": rng.bytes(int(rng.integers(2_000, 30_000))), "cls": b"%d" % (i % 7)}
            for i in range(400)]
    url = f"{s3_bucket}/ds"
    shardkit.pack(iter(data), url, shard_bytes="1MB", progress=False)
    content = {d["__key__"]: d["bin"] for d in data}
    ds = shardkit.open_dataset(url)
    assert len(ds.shard_list) >= 4
    monkeypatch.setattr(shardio, "FETCH_PART_SIZE", 128 << 10)  # several parts per shard
    monkeypatch.setattr(shardio, "FETCH_CONCURRENCY", 4)  # more parts at once than the default

    reads: list[tuple[str, int, int]] = []
    real = ranged.RangedReader.read_into

    def spy(self: ranged.RangedReader, start: int, out: memoryview, on_part: Any = None) -> int:
        reads.append((self.path, start, start + len(out)))
        return real(self, start, out, on_part)

    monkeypatch.setattr(ranged.RangedReader, "read_into", spy)
    before = ranged.TOTAL.snapshot()
    sd = StreamingDataset(url, cache_dir=tmp_path / "c", batch_size=32)
    got = collect(sd)
    assert got == content
    total = sum(i.bytes for i in ds.shard_list)
    assert sorted(reads) == sorted((i.path, 0, i.bytes) for i in ds.shard_list)
    after = ranged.TOTAL.snapshot()
    assert after["bytes"] - before["bytes"] == total
    assert after["requests"] - before["requests"] >= sum(-(-i.bytes // (128 << 10)) for i in ds.shard_list)
    st = sd.stats()
    assert st["misses"] + st["prefetched"] == len(ds.shard_list) and st["bytes_fetched"] == total

    # The same, cold, through DataLoader workers (forked: they inherit the small parts).
    sd2 = StreamingDataset(url, cache_dir=tmp_path / "c2", batch_size=32)
    assert collect(DataLoader(sd2, batch_size=None, num_workers=2)) == content
    cached = sorted(p.name for p in (tmp_path / "c2").rglob("*.tar") if ".tmp" not in p.parts)
    assert len(cached) == len(ds.shard_list)
