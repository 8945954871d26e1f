"""Landing fills: cold downloads land in a reused buffer, go to the cache file with O_DIRECT,
and this process copies its first reads of the shard from the buffer.

Local files stand in for the object store (cachefakes); one test streams cold epochs
from the real SeaweedFS fixture (test_ddp.py has two ranks doing it through one node cache).
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from cachefakes import MB, PosRemote, Store, make_store, pos_store
from shardkit.config import landing_budget
from shardkit.errors import CacheDiskFullError, ConfigError, IntegrityError
from shardkit.cache.landing import LANDING, DirectWriter, Landing, LandingPool

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def fresh_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("SHARDKIT_LANDING_BYTES", raising=False)
    LANDING.clear()
    yield
    LANDING.clear()


def direct_supported(directory: Path) -> bool:
    """Whether files in ``directory`` open with O_DIRECT (tmpfs before Linux 6.6 refuses)."""
    probe = directory / ".direct-probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def buffer_holding(data: bytes, path: Path) -> tuple[Landing, Path]:
    """A pinned landing buffer holding ``data``, and an empty file at ``path`` to write it to."""
    buf = LANDING.take(len(data))
    assert buf is not None
    buf.map[:len(data)] = data
    path.write_bytes(b"")
    return buf, path


def pins(pool: LandingPool = LANDING) -> list[int]:
    return [b.pins for b in pool._all]


# ---- the pool ------------------------------------------------------------------------------


def test_pool_reuses_idle_buffers_and_recycles_read_ones_first_then_least_recent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKIT_LANDING_BYTES", "3MiB")
    pool = LandingPool()
    files = []
    for i in range(3):
        f = tmp_path / f"f{i}"
        f.write_bytes(b"x")
        files.append(f)
    a = pool.take(MB - 10)
    b = pool.take(MB)
    c = pool.take(MB)
    assert a is not None and b is not None and c is not None
    assert pool.take(1) is None  # budget spent, all pinned
    for buf, f in zip((a, b, c), files):
        pool.publish(buf, str(f), os.stat(f))
    assert pins(pool) == [0, 0, 0] and pool.held_bytes() == 3 * MB
    hot_b = pool.hot(str(files[1]), os.stat(files[1]))
    assert hot_b is b and b.pins == 1
    pool.release(b)
    # b was read (and used last); a and c were landed ahead of their reader: b goes first.
    d = pool.take(MB)
    assert d is b and pool.hot(str(files[1]), os.stat(files[1])) is None
    # With none read, the least recently used hot buffer goes: a.
    e = pool.take(MB)
    assert e is a and pool.hot(str(files[0]), os.stat(files[0])) is None
    pool.release(d)
    # A buffer that holds nothing is reused before any hot one.
    f = pool.take(1000)
    assert f is b and pool.hot(str(files[2]), os.stat(files[2])) is c
    for buf in (c, e, f):
        pool.release(buf)
    assert pool.held_bytes() == 3 * MB  # no new memory


def test_pool_takes_new_memory_before_a_buffer_landed_ahead_of_its_reader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Recycling a shard not yet read would send its reader to the disk: the cache file was
    # written with O_DIRECT. A process's first epoch did that for about half its shards.
    monkeypatch.setenv("SHARDKIT_LANDING_BYTES", "3MiB")
    pool = LandingPool()
    f0, f1 = tmp_path / "f0", tmp_path / "f1"
    for f in (f0, f1):
        f.write_bytes(b"x")
    a = pool.take(MB)
    assert a is not None
    pool.publish(a, str(f0), os.stat(f0))
    b = pool.take(MB)
    assert b is not None and b is not a and pool.held_bytes() == 2 * MB
    pool.publish(b, str(f1), os.stat(f1))
    read = pool.hot(str(f1), os.stat(f1))  # f1 read (and used last), f0 not yet
    assert read is b
    pool.release(b)
    c = pool.take(MB)
    assert c is b  # the read one, though used more recently
    d = pool.take(MB)
    assert d is not None and d not in (a, b) and pool.held_bytes() == 3 * MB  # new memory, not a
    assert pool.hot(str(f0), os.stat(f0)) is a


def test_pool_never_hands_out_a_pinned_buffer_and_checks_the_file(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKIT_LANDING_BYTES", "2MiB")
    pool = LandingPool()
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    a = pool.take(MB)
    assert a is not None
    pool.publish(a, str(f), os.stat(f))
    reader = pool.hot(str(f), os.stat(f))
    assert reader is a
    b = pool.take(MB)
    assert b is not None and b is not a
    assert pool.take(MB) is None  # a is read from, b is filling
    assert pool.take(3 * MB) is None  # larger than the budget
    pool.release(b)
    pool.release(a)
    os.utime(f, ns=(1, 2))  # the file changed: the buffer no longer matches it
    assert pool.hot(str(f), os.stat(f)) is None
    pool.forget(str(f))
    assert pool.hot(str(f), os.stat(f)) is None


def test_pool_grows_a_buffer_by_freeing_idle_small_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKIT_LANDING_BYTES", "4MiB")
    pool = LandingPool()
    small = [pool.take(MB) for _ in range(3)]
    for s in small:
        assert s is not None
        pool.release(s)
    big = pool.take(3 * MB)
    assert big is not None and big.capacity == 3 * MB
    assert pool.held_bytes() <= 4 * MB


def test_landing_budget_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKIT_LANDING_BYTES", "0")
    assert landing_budget() == 0 and LandingPool().take(1) is None
    monkeypatch.setenv("SHARDKIT_LANDING_BYTES", "lots")
    with pytest.raises(ConfigError, match="SHARDKIT_LANDING_BYTES"):
        landing_budget()


def test_forked_child_starts_with_an_empty_pool() -> None:
    buf = LANDING.take(MB)
    assert buf is not None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.write(w, b"%d" % len(LANDING._all))
        os._exit(0)
    os.close(w)
    got = os.read(r, 16)
    os.close(r)
    os.waitpid(pid, 0)
    LANDING.release(buf)
    assert got == b"0"


# ---- the writer ----------------------------------------------------------------------------


def test_direct_writer_writes_parts_out_of_order_and_cuts_to_size(tmp_path: Path) -> None:
    size = 3 * MB + 123
    data = np.random.default_rng(1).bytes(size)
    buf, path = buffer_holding(data, tmp_path / "f")
    w = DirectWriter(str(path), buf)
    assert w.direct == direct_supported(tmp_path)
    threads = [threading.Thread(target=w.write, args=(lo, min(size, lo + MB))) for lo in range(0, size, MB)][::-1]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert w.written == size
    w.finish(size)
    LANDING.release(buf)
    assert path.read_bytes() == data


def test_direct_writer_falls_back_when_the_device_refuses_a_write(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(range(256)) * 40
    buf, path = buffer_holding(data, tmp_path / "f")
    real, refused = os.pwrite, []

    def pwrite(fd: int, chunk: Any, offset: int) -> int:  # a device with stricter alignment
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, chunk, offset)

    w = DirectWriter(str(path), buf)
    opened_direct = w.direct
    monkeypatch.setattr(os, "pwrite", pwrite)
    w.write(0, 4096)
    w.write(4096, len(data))
    monkeypatch.undo()
    w.finish(len(data))
    LANDING.release(buf)
    assert not w.direct and path.read_bytes() == data
    assert refused == ([0] if opened_direct else [])


def test_direct_writer_unaligned_offsets_still_land_whole(tmp_path: Path) -> None:
    # O_DIRECT on a disk refuses an offset that is not a multiple of the block (then the writer
    # goes buffered); tmpfs takes it. Either way the file ends up with exactly the bytes.
    data = bytes(range(256)) * 40
    buf, path = buffer_holding(data, tmp_path / "f")
    w = DirectWriter(str(path), buf)
    w.write(100, len(data))
    w.write(0, 100)
    w.finish(len(data))
    LANDING.release(buf)
    assert path.read_bytes() == data


# ---- the cache -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PartRemote(PosRemote):
    """PosRemote whose readers report each part (as the ranged reader ShardSource.fetch gives does)."""

    reports: bool = True


def part_store(tmp_path: Path, sizes: list[int], **kw: Any) -> tuple[Store, PartRemote]:
    s = make_store(tmp_path, sizes)
    return s, PartRemote(s.remote.src, str(tmp_path / "pos-calls.log"), **kw)


@pytest.mark.parametrize("reporting", [True, False])
def test_landing_fill_publishes_verified_file_and_serves_it_hot(tmp_path: Path, reporting: bool) -> None:
    sizes = [3 * MB + 5, 0, 2 * MB]
    s, fetch = part_store(tmp_path, sizes) if reporting else pos_store(tmp_path, sizes)
    with s.cache(100 * MB) as cache:
        for ref in s.refs:
            with cache.open(ref, fetch, landing=True) as shard:
                want = fetch.data(ref.name)
                assert shard.verified and shard.hot is not None and bytes(shard.hot) == want
                assert Path(shard.path).read_bytes() == want
            assert shard.hot is None
        assert len(LANDING._all) == 1  # one buffer, reused shard after shard
        # The last shard is still in it; the first one's bytes were replaced (read from the file).
        with cache.open(s.refs[2], fetch, landing=True) as shard:
            assert shard.hot is not None and bytes(shard.hot) == fetch.data(s.refs[2].name)
        with cache.open(s.refs[0], fetch, landing=True) as shard:
            assert shard.hot is None and bytes(shard.buffer()) == fetch.data(s.refs[0].name)
        with cache.open(s.refs[2], fetch) as shard:  # a reader that does not ask for it
            assert shard.hot is None
        st = cache.stats()
        assert (st["landed"], st["misses"], st["hits"]) == (3, 3, 3)
        assert s.temps() == []
    assert set(pins()) <= {0}


def test_landing_fill_writes_every_byte_of_the_file_with_o_direct(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Whether the kernel then keeps those pages out of the page cache is its business (a CI
    # run under load once found the first page cached where a probe said it would not be);
    # what the cache controls is that the landed file's bytes all go through O_DIRECT.
    written: list[tuple[int, int, bool]] = []
    real = os.pwrite

    def spy(fd: int, data: Any, offset: int) -> int:
        n = real(fd, data, offset)
        if "/.tmp/" in os.readlink(f"/proc/self/fd/{fd}"):  # the shard's temp file, not a lock's owner note
            written.append((offset, n, bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        return n

    monkeypatch.setattr(os, "pwrite", spy)
    s, fetch = part_store(tmp_path, [2 * MB])
    with s.cache(100 * MB) as cache:
        with cache.open(s.refs[0], fetch, landing=True) as shard:
            assert shard.hot is not None
            assert Path(shard.path).read_bytes() == fetch.data(s.refs[0].name)
    covered = sorted((off, off + n) for off, n, _ in written)
    assert covered[0][0] == 0 and all(a[1] >= b[0] for a, b in zip(covered, covered[1:]))
    assert max(hi for _, hi in covered) >= 2 * MB
    if direct_supported(Path(s.cache_dir)):
        assert all(direct for _, _, direct in written), written


def test_failed_landing_fill_unpins_and_the_next_open_starts_over(tmp_path: Path) -> None:
    s, fetch = part_store(tmp_path, [4 * MB + 3], fail_after=3)
    ref = s.refs[0]
    with s.cache(100 * MB) as cache:
        with pytest.raises(ConnectionError):
            cache.open(ref, fetch, landing=True)
        assert [p.stat().st_size for p in s.temps()] == [0] and set(pins()) <= {0}
        good = PartRemote(fetch.src, fetch.log)
        with cache.open(ref, good, landing=True) as shard:
            assert bytes(shard.hot or b"") == good.data(ref.name)
    assert [c[1] for c in fetch.calls()] == [0, 0]


def test_landing_fill_whose_write_fails_raises_unpins_and_starts_over(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # The cache disk fills up halfway through a landing fill: one CacheDiskFullError (an
    # OSError, errno ENOSPC) reaches the reader, nothing is published or left behind (the
    # reservation is given back), the buffer is free again, and the next open fetches it whole.
    s, fetch = part_store(tmp_path, [4 * MB + 3])
    ref = s.refs[0]
    real = os.pwrite

    def pwrite(fd: int, chunk: Any, offset: int) -> int:
        if offset >= MB:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, chunk, offset)

    with s.cache(100 * MB) as cache:
        monkeypatch.setattr(os, "pwrite", pwrite)
        with pytest.raises(CacheDiskFullError) as err:
            cache.open(ref, fetch, landing=True)
        monkeypatch.undo()
        assert err.value.errno == errno.ENOSPC and s.cache_dir in str(err.value)
        assert s.temps() == [] and set(pins()) <= {0}
        assert not s.final(ref).exists() and cache.stats()["landed"] == 0
        with cache.open(ref, fetch, landing=True) as shard:
            assert shard.hot is not None and Path(shard.path).read_bytes() == fetch.data(ref.name)


def test_corrupt_landing_fill_raises_after_one_retry_and_unpins(tmp_path: Path) -> None:
    s, fetch = part_store(tmp_path, [MB + 7], corrupt=True)
    with s.cache(100 * MB) as cache:
        with pytest.raises(IntegrityError, match=s.refs[0].name):
            cache.open(s.refs[0], fetch, landing=True)
        assert s.temps() == [] and not s.final(s.refs[0]).exists() and cache.stats()["landed"] == 0
    assert len(fetch.calls()) == 2 and set(pins()) <= {0}


def test_eviction_drops_the_hot_copy(tmp_path: Path) -> None:
    s, fetch = part_store(tmp_path, [2 * MB, 2 * MB])
    a, b = s.refs
    with s.cache(3 * MB) as cache:
        with cache.open(a, fetch, landing=True):
            pass
        with cache.open(b, fetch, landing=True):  # evicts a
            pass
        assert s.cached() == {b.name} and str(s.final(a)) not in LANDING._hot
        with cache.open(a, fetch, landing=True) as shard:  # fetched again, into a buffer
            assert bytes(shard.hot or b"") == fetch.data(a.name)
        assert cache.stats()["landed"] == 3


@pytest.mark.parametrize("budget", ["0", "1MiB"])
def test_without_room_for_a_buffer_the_fill_goes_through_a_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                budget: str) -> None:
    monkeypatch.setenv("SHARDKIT_LANDING_BYTES", budget)
    s, fetch = part_store(tmp_path, [2 * MB])
    with s.cache(100 * MB) as cache:
        with cache.open(s.refs[0], fetch, landing=True) as shard:
            assert shard.hot is None and Path(shard.path).read_bytes() == fetch.data(s.refs[0].name)
        assert cache.stats()["landed"] == 0


# ---- end to end, SeaweedFS -----------------------------------------------------------------


def test_cold_batches_land_and_match_the_source_s3(s3_env: Any, s3_bucket: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec
    import xxhash

    import shardkit
    from shardkit import StreamingDataset, unpack
    from shardkit.read import shard_source as shardio

    monkeypatch.setattr(shardio, "FETCH_PART_SIZE", 256 << 10)  # several O_DIRECT parts per shard
    rng = np.random.default_rng(11)
    content = {f"k{i:04d}": rng.bytes(int(rng.integers(1, 40_000))) for i in range(300)}
    url = f"{s3_bucket}/ds"
    shardkit.pack(iter({"__key__": k, "bin": v, "cls": b"%d" % (i % 5)} for i, (k, v) in enumerate(content.items())),
                  url, shard_bytes="1MB", progress=False)
    ds = shardkit.open_dataset(url)
    assert len(ds.shard_list) >= 4

    def epoch(cache: Path, **kw: Any) -> tuple[dict[str, bytes], dict[str, Any]]:
        sd = StreamingDataset(url, cache_dir=cache, batch_size=64, shuffle=True, seed=3, **kw)
        got: dict[str, bytes] = {}
        for batch in sd:
            for key, body in zip(batch["__key__"], unpack(batch, "bin")):
                assert key not in got
                got[key] = bytes(body)
        return got, sd.stats()

    got, st = epoch(tmp_path / "c")
    assert got == content
    assert st["landed"] == len(ds.shard_list) and st["bytes_fetched"] == sum(i.bytes for i in ds.shard_list)
    fs = fsspec.filesystem("s3")
    for info in ds.shard_list:  # every cached file is the object, byte for byte
        cached = next((tmp_path / "c").rglob(info.path.replace("/", "%2F")))
        assert xxhash.xxh3_128_hexdigest(cached.read_bytes()) == xxhash.xxh3_128_hexdigest(
            fs.cat_file(f"{url}/{info.path}".removeprefix("s3://")))

    # A zero-copy stream hands out views of the files: its fills go through maps.
    got, st = epoch(tmp_path / "z", zero_copy=True)
    assert got == content and st["landed"] == 0


def test_default_prefetch_is_four_for_one_reader_process_and_two_per_worker(tmp_path: Path) -> None:
    from randomds import pack_random
    from shardkit import StreamingDataset
    from shardkit.read.topology import Topology

    url, _ = pack_random(tmp_path, n=20, max_body=100, classes=2, shard_bytes="1MB", seed=0, prefix="p")
    alone, worker = Topology(0, 1, 0, 1), Topology(0, 1, 1, 2)
    cached = StreamingDataset(url, cache_dir=tmp_path / "c", batch_size=4)
    assert cached._prefetch(alone) == 4 and cached._prefetch(worker) == 2
    assert StreamingDataset(url, batch_size=4)._prefetch(alone) == 2  # no cache: spans held in memory
    assert StreamingDataset(url, cache_dir=tmp_path / "c", prefetch=1)._prefetch(alone) == 1
