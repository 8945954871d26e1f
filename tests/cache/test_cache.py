"""The node-local shard cache, with real processes on a local directory (no network).

The "remote" is a directory of random shard files (cachefakes); its readers log every download
attempt (shard, start byte, pid) to a file with O_APPEND, so attempts from several processes
can be counted.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import multiprocessing as mp
import os
import random
import signal
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import pytest

from cachefakes import MB, NS, FnReader, Remote, Store, UsageSampler, make_store, wait_for
from shardkit.cache import room as room_mod
from shardkit.cache.shard_cache import ReaderFor, ShardCache, ShardRef
from shardkit.errors import CacheFullError, NoRoomError
from shardkit.cache.files import FileLock, file_name
from shardkit.errors import ConfigError, IntegrityError, ShardkitError

SPAWN = mp.get_context("spawn")
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", autouse=True)
def resource_tracker() -> None:
    """Start multiprocessing's per-session helper before the leak police takes its snapshot."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    yield
    leaked = [t.name for t in threading.enumerate() if t.name.startswith("shardkit-cache")]
    assert not leaked, f"leaked threads: {leaked}"


def read_ok(cache: ShardCache, ref: ShardRef, fetch: ReaderFor, remote: Remote) -> bool:
    with cache.open(ref, fetch) as shard:
        return bytes(shard.buffer()) == remote.data(ref.name) and os.path.getsize(shard.path) == ref.size


# ---- child processes (module level so "spawn" can import them) ---------------------------

def _reader(out: Any, cache_dir: str, limit: int, refs: list[ShardRef], remote: Remote, go: Any) -> None:
    try:
        cache = ShardCache(cache_dir, limit, namespace=NS, wait_timeout=30)
        go.wait(30)
        bad = [r.name for r in refs if not read_ok(cache, r, remote, remote)]
        out.put((os.getpid(), cache.stats(), bad))
        cache.close()
    except BaseException:
        out.put((os.getpid(), None, traceback.format_exc()))


def _holder(cache_dir: str, limit: int, refs: list[ShardRef], remote: Remote, ready: Any, release: Any) -> None:
    cache = ShardCache(cache_dir, limit, namespace=NS)
    shards = [cache.open(r, remote) for r in refs]
    ready.set()
    release.wait(30)
    for s in shards:
        s.close()


@contextlib.contextmanager
def pinned_elsewhere(s: Store, limit: int, refs: list[ShardRef]) -> Iterator[Any]:
    """Another process holds ``refs`` open (pinned) in the cache until the yielded event is set."""
    ready, release = SPAWN.Event(), SPAWN.Event()
    holder = SPAWN.Process(target=_holder, args=(s.cache_dir, limit, refs, s.remote, ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        yield release
    finally:
        release.set()
        holder.join(10)
    assert holder.exitcode == 0


def _open_one(cache_dir: str, limit: int, ref: ShardRef, remote: Remote, out: Any = None) -> None:
    cache = ShardCache(cache_dir, limit, namespace=NS)
    ok = read_ok(cache, ref, remote, remote)
    if out is not None:
        out.put((ok, cache.stats()))


def run_readers(store: Store, limit: int, orders: list[list[ShardRef]], remote: Remote) -> list[dict[str, float]]:
    out, go = SPAWN.Queue(), SPAWN.Event()
    procs = [SPAWN.Process(target=_reader, args=(out, store.cache_dir, limit, o, remote, go)) for o in orders]
    for p in procs:
        p.start()
    go.set()
    results = [out.get(timeout=45) for _ in procs]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    for _, stats, bad in results:
        assert stats is not None, bad
        assert bad == []
    return [stats for _, stats, _ in results]


# ---- single process ------------------------------------------------------------------------

def test_miss_then_hit_stats_and_content(tmp_path: Path) -> None:
    s = make_store(tmp_path, [3 * MB, 1 * MB + 7])
    with s.cache(100 * MB) as cache:
        for ref in s.refs * 2:
            assert read_ok(cache, ref, s.remote, s.remote)
        st = cache.stats()
        assert (st["hits"], st["misses"], st["evictions"]) == (2, 2, 0)
        assert st["bytes_fetched"] == sum(r.size for r in s.refs)
        assert cache.usage() == sum(r.size for r in s.refs)
        assert len(s.remote.calls()) == 2
        with cache.open(s.refs[0], s.remote) as shard:
            view = shard.buffer()
            assert view.readonly and len(view) == s.refs[0].size
        with pytest.raises(ValueError):
            shard.buffer()


def test_download_locks_left_behind_take_no_disk(tmp_path: Path) -> None:
    # A download lock file stays for every shard the node ever fetched (removing it would race
    # a waiter); the owner note it carries while the download runs must not stay with it, or
    # each file keeps a disk block outside cache_limit (4 KiB a shard: 400 MB for 100k shards).
    s = make_store(tmp_path, [MB, MB + 3, 2 * MB])
    with s.cache(100 * MB) as cache:
        for ref in s.refs:
            assert read_ok(cache, ref, s.remote, s.remote)
    locks = [p for p in Path(s.cache_dir).rglob("*.dl")]
    assert len(locks) == 3
    assert [(p.name, p.stat().st_size, p.stat().st_blocks) for p in locks if p.stat().st_size or p.stat().st_blocks] == []


def test_shard_invisible_until_verified(tmp_path: Path) -> None:
    s = make_store(tmp_path, [2 * MB])
    ref = s.refs[0]
    seen: list[tuple[bool, list[str], int]] = []
    with s.cache(10 * MB) as cache:
        def fetch(r: ShardRef) -> FnReader:
            data = s.remote.data(r.name)

            def read_into(start: int, out: memoryview, on_part: Any = None) -> int:
                if start:  # the first half is in the temp file now
                    seen.append((s.final(r).exists(), [p.name for p in s.temps()], cache.usage()))
                end = min(len(data) // 2 if start == 0 else len(data), start + len(out))
                out[:end - start] = data[start:end]
                return end - start
            return FnReader(read_into, parallel=False)

        assert read_ok(cache, ref, fetch, s.remote)
    exists, temps, usage = seen[0]
    assert not exists
    assert temps == [f"{s.final(ref).name}.{ref.size}.{os.getpid()}"]
    assert usage == ref.size  # the whole shard is reserved from the start
    assert s.temps() == [] and s.final(ref).exists()


@pytest.mark.parametrize("bad", ["checksum", "short", "long"])
def test_bad_download_retried_once_then_integrity_error(tmp_path: Path, bad: str) -> None:
    s = make_store(tmp_path, [1 * MB])
    good = s.refs[0]
    ref = {"checksum": replace(good, checksum="0" * 32), "short": replace(good, size=good.size + 10),
           "long": replace(good, size=good.size - 10)}[bad]
    with s.cache(10 * MB) as cache:
        with pytest.raises(IntegrityError, match="shard shards/shard-000000.tar"):
            cache.open(ref, s.remote)
        assert [c[:2] for c in s.remote.calls()] == [(ref.name, 0)] * 2
        assert cache.usage() == 0 and s.temps() == [] and not s.final(ref).exists()


def test_bad_arguments_are_config_errors(tmp_path: Path) -> None:
    s = make_store(tmp_path, [2 * MB])
    with s.cache(1 * MB) as cache:
        with pytest.raises(ConfigError, match=r"shard shards/shard-000000.tar is 2.1 MB, larger than cache_limit 1.0 MB"):
            cache.open(s.refs[0], s.remote)
    assert s.remote.calls() == []
    for kw in ({"limit": 0}, {"namespace": "../x"}, {"namespace": ""}, {"wait_timeout": -1}):
        with pytest.raises(ConfigError):
            s.cache(kw.pop("limit", MB), **kw)


def test_namespaces_share_one_limit(tmp_path: Path) -> None:
    s = make_store(tmp_path, [1 * MB] * 3)
    limit = int(2.5 * MB)
    with s.cache(limit, namespace="a") as a, s.cache(limit, namespace="b") as b:
        assert read_ok(a, s.refs[0], s.remote, s.remote) and read_ok(a, s.refs[1], s.remote, s.remote)
        assert read_ok(b, s.refs[2], s.remote, s.remote)
        assert b.stats()["evictions"] == 1 and s.cached("a") == {s.refs[1].name}
        assert a.usage() == b.usage() == 2 * MB


@pytest.mark.parametrize("opened, schedule, evicted", [
    ("ab", "cab", "b"),  # both scheduled: the one needed last goes, though "a" is older
    ("ba", "cb", "a"),   # "a" is not scheduled: it goes first, though "b" is older
    ("ab", "", "a"),     # no schedule: least recently used
])
def test_eviction_follows_schedule(tmp_path: Path, opened: str, schedule: str, evicted: str) -> None:
    s = make_store(tmp_path, [1 * MB] * 3)
    ref = dict(zip("abc", s.refs))
    with s.cache(int(2.5 * MB)) as cache:
        for k in opened:
            assert read_ok(cache, ref[k], s.remote, s.remote)
            time.sleep(0.01)
        cache.set_schedule([ref[k].name for k in schedule])
        assert read_ok(cache, ref["c"], s.remote, s.remote)
        assert s.cached() == {ref[k].name for k in "abc" if k != evicted}


def test_resume_after_failed_fetch(tmp_path: Path) -> None:
    s = make_store(tmp_path, [3 * MB + 5])
    ref, half = s.refs[0], (3 * MB + 5) // 2
    with s.cache(10 * MB) as cache:
        with pytest.raises(ConnectionError):
            cache.open(ref, replace(s.remote, fail_at=half))
        [tmp] = s.temps()
        assert tmp.stat().st_size == half and cache.usage() == ref.size
        assert read_ok(cache, ref, s.remote, s.remote)
        assert [c[:2] for c in s.remote.calls()] == [(ref.name, 0), (ref.name, half)]
        assert cache.stats()["bytes_fetched"] == ref.size and s.temps() == []


def test_resume_onto_bad_prefix_restarts_from_zero(tmp_path: Path) -> None:
    s = make_store(tmp_path, [2 * MB])
    ref, half = s.refs[0], MB
    with s.cache(10 * MB) as cache:
        with pytest.raises(ConnectionError):
            cache.open(ref, replace(s.remote, fail_at=half))
        [tmp] = s.temps()
        with open(tmp, "r+b") as f:
            f.write(b"\0" * 16)
        assert read_ok(cache, ref, s.remote, s.remote)
        assert [c[1] for c in s.remote.calls()] == [0, half, 0]


def test_truncated_cached_shard_is_refetched(tmp_path: Path) -> None:
    s = make_store(tmp_path, [1 * MB])
    ref = s.refs[0]
    with s.cache(10 * MB, verify=False) as cache:
        assert read_ok(cache, ref, s.remote, s.remote)
        os.truncate(s.final(ref), 1000)
        assert read_ok(cache, ref, s.remote, s.remote)
        assert cache.stats()["corrupt_refetches"] == 1 and len(s.remote.calls()) == 2


# ---- prefetch --------------------------------------------------------------------------------

def test_prefetch_then_open_hits_and_close_stops_thread(tmp_path: Path) -> None:
    s = make_store(tmp_path, [1 * MB, 2 * MB, 3 * MB])
    cache = s.cache(100 * MB)
    cache.prefetch(s.refs[1:], replace(s.remote, delay=0.001), max_ahead=2)
    wait_for(lambda: cache.stats()["prefetched"] == 2)
    for ref in s.refs[1:]:
        assert read_ok(cache, ref, s.remote, s.remote)
    st = cache.stats()
    assert (st["hits"], st["misses"]) == (2, 0)
    assert any(t.name == "shardkit-cache-prefetch" for t in threading.enumerate())
    cache.close()
    assert not any(t.name == "shardkit-cache-prefetch" for t in threading.enumerate())


def test_prefetch_downloads_the_planned_shards_at_once(tmp_path: Path) -> None:
    # at_once=3: each planned shard gets a download thread of its own, so all three are in
    # flight (their temp files exist) together.
    s = make_store(tmp_path, [2 * MB] * 3)
    with s.cache(100 * MB) as cache:
        cache.prefetch(s.refs, replace(s.remote, delay=0.05), max_ahead=3, at_once=3)
        wait_for(lambda: len(s.temps()) == 3)
        wait_for(lambda: s.cached() == {r.name for r in s.refs})
        assert cache.stats()["prefetched"] == 3 and sorted(c[0] for c in s.remote.calls()) == [r.name for r in s.refs]


def test_prefetch_stays_within_limit_and_skips_what_does_not_fit(tmp_path: Path) -> None:
    s = make_store(tmp_path, [1 * MB] * 6)
    limit = int(2.5 * MB)
    with s.cache(limit) as cache:
        sampler = UsageSampler(cache)
        sampler.start()
        cache.prefetch(s.refs, replace(s.remote, delay=0.01), max_ahead=6)
        wait_for(lambda: cache.stats()["prefetched"] + cache.stats()["prefetch_skipped"] == 6)
        assert sampler.finish() <= limit and sampler.samples > 5
        # the plan's own order protects its earlier shards from its later ones
        assert s.cached() == {s.refs[0].name, s.refs[1].name}
        assert cache.stats()["evictions"] == 0


def test_prefetch_never_evicts_a_shard_needed_sooner(tmp_path: Path) -> None:
    s = make_store(tmp_path, [1 * MB] * 3)
    a, b, c = s.refs
    with s.cache(int(2.5 * MB)) as cache:
        assert read_ok(cache, a, s.remote, s.remote) and read_ok(cache, b, s.remote, s.remote)
        cache.set_schedule([a.name, b.name, c.name])
        cache.prefetch([c], s.remote)
        wait_for(lambda: cache.stats()["prefetch_skipped"] == 1)
        assert s.cached() == {a.name, b.name}
        cache.set_schedule([c.name, a.name, b.name])
        cache.prefetch([c], s.remote)
        wait_for(lambda: cache.stats()["prefetched"] == 1)
        assert s.cached() == {a.name, c.name}



@pytest.mark.parametrize("plan_from", [1, 2])
def test_a_cache_of_one_shard_fetches_each_shard_once_in_a_sequential_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan_from: int) -> None:
    # A reader holding shard k asks to prefetch k+1, k+2, ... (plan_from=1), or, as the streaming
    # reader does, k+2, ... as it is about to open k+1 itself (plan_from=2). No later shard may
    # take the room that k frees a moment after, as k+1 is needed first: with a cache_limit of
    # one or two shards, most shards were fetched twice.
    s = make_store(tmp_path, [1 * MB] * 6)
    skipped, closed = threading.Event(), threading.Event()
    real = ShardCache._reserve

    def reserve(self: ShardCache, ref: ShardRef, file: str, prefetch: Any) -> Any:
        got = real(self, ref, file, prefetch)
        if got is None:  # no room: let the reader close its shard before the plan goes on
            skipped.set()
            closed.wait(5)
        return got

    monkeypatch.setattr(ShardCache, "_reserve", reserve)
    with s.cache(int(1.5 * MB)) as cache:
        cache.set_schedule([r.name for r in s.refs], [r.size for r in s.refs])
        for i, ref in enumerate(s.refs):
            shard = cache.open(ref, s.remote)
            skipped.clear()
            closed.clear()
            cache.prefetch(s.refs[i + plan_from:], s.remote, max_ahead=4, at_once=4)  # as a reader does
            if i + plan_from < len(s.refs):
                assert skipped.wait(5)
            shard.close()
            closed.set()
            time.sleep(0.05)  # the plan's later shards try while none is open
        fetched = sorted(c[0] for c in s.remote.calls())
    assert fetched == [r.name for r in s.refs]  # each once

# ---- several processes -------------------------------------------------------------------

def test_concurrent_processes_fetch_each_shard_once(tmp_path: Path) -> None:
    s = make_store(tmp_path, [random.Random(i).randint(1 * MB, 4 * MB) for i in range(6)])
    orders = [random.Random(10 + i).sample(s.refs, len(s.refs)) for i in range(4)]
    stats = run_readers(s, 100 * MB, orders, replace(s.remote, delay=0.003))
    per_shard = collections.Counter(name for name, _, _ in s.remote.calls())
    assert per_shard == {r.name: 1 for r in s.refs}
    assert sum(st["misses"] for st in stats) == 6 and sum(st["hits"] for st in stats) == 18


def test_limit_holds_with_four_processes(tmp_path: Path) -> None:
    s = make_store(tmp_path, [random.Random(i).randint(1 * MB, 2 * MB) for i in range(8)])
    limit = int(2.5 * 2 * MB)
    orders = [random.Random(20 + i).sample(s.refs, len(s.refs)) * 2 for i in range(4)]
    with s.cache(limit) as watcher:
        sampler = UsageSampler(watcher)
        sampler.start()
        stats = run_readers(s, limit, orders, replace(s.remote, delay=0.002))
        peak = sampler.finish()
    assert 0 < peak <= limit and sampler.samples > 50
    assert sum(st["evictions"] for st in stats) > 0
    assert sum(st["hits"] + st["misses"] for st in stats) == 4 * 16


def test_pinned_shards_are_never_evicted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    s = make_store(tmp_path, [1 * MB] * 4)
    x, y, z, w = s.refs
    limit = int(2.5 * MB)
    with pinned_elsewhere(s, limit, [x]) as release, s.cache(limit) as cache:
        assert read_ok(cache, y, s.remote, s.remote)
        assert read_ok(cache, z, s.remote, s.remote)  # must evict y: x is pinned by the holder
        assert s.cached() == {x.name, z.name}
        with cache.open(z, s.remote):  # now x and z are both pinned: w cannot fit
            t0 = time.monotonic()
            with pytest.raises(CacheFullError) as err:
                s.cache(limit, wait_timeout=0.4).open(w, s.remote)
            assert time.monotonic() - t0 >= 0.4
            msg = str(err.value)
            assert msg.startswith("cache_limit 2.6 MB too small: 2 shards in use by readers hold 2.1 MB")
            assert w.name in msg and "\n" not in msg
            assert isinstance(err.value, ShardkitError)
            assert s.cached() == {x.name, z.name}
            # the holder lets go of x while we wait: the open goes through
            threading.Timer(0.5, release.set).start()
            waiter = s.cache(limit, wait_timeout=20)
            monkeypatch.setattr(room_mod, "WAIT_NOTE_SECONDS", 0.1)  # a blocked reader says so
            with caplog.at_level("WARNING", logger="shardkit.cache.room"):
                assert read_ok(waiter, w, s.remote, s.remote)
            assert waiter.stats()["wait_seconds"] >= 0.3
            assert f"{w.name} waits" in caplog.text and "keep 2 shards open" in caplog.text
            assert s.cached() == {z.name, w.name}


def test_room_held_by_pinned_shards_gives_up_after_room_wait(tmp_path: Path) -> None:
    # A reader that pins a shard may be waiting for this one (a DDP rank in a collective):
    # with room_wait, an open gives up on such room in bounded time, and leaves nothing behind.
    s = make_store(tmp_path, [1 * MB] * 3)
    x, y, z = s.refs
    limit = int(1.5 * MB)
    with pinned_elsewhere(s, limit, [x]):
        cache = s.cache(limit, room_wait=0.3, wait_timeout=30)
        t0 = time.monotonic()
        with pytest.raises(NoRoomError) as err:
            cache.open(y, s.remote)
        assert 0.3 <= time.monotonic() - t0 < 10
        assert isinstance(err.value, CacheFullError) and y.name in str(err.value) and "1 shards in use" in str(err.value)
        assert s.cached() == {x.name} and s.temps() == []  # no reservation left behind
        dl = FileLock.try_take(str(Path(s.cache_dir) / NS / ".locks" / f"{file_name(y.name)}.dl"), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert dl is not None  # nor its download lock
        dl.release()
    # Room held only by a download in flight is waited for: downloads end.
    dl = FileLock.take(str(Path(s.cache_dir) / NS / ".locks" / f"{file_name(z.name)}.dl"))
    tmp = Path(s.cache_dir) / NS / ".tmp" / f"{file_name(z.name)}.{z.size}.{os.getpid()}"
    tmp.write_bytes(b"")

    def finish() -> None:
        tmp.unlink()
        dl.release()

    threading.Timer(0.8, finish).start()
    t0 = time.monotonic()
    with s.cache(limit, room_wait=0.1, wait_timeout=30) as waiter:  # x (unpinned) goes: room for y after z's reservation
        assert read_ok(waiter, y, s.remote, s.remote)
    assert time.monotonic() - t0 >= 0.7


def test_room_wait_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        ShardCache(tmp_path, MB, namespace=NS, room_wait=-1)


def _start_hung_download(s: Store, ref: ShardRef) -> Any:
    proc = SPAWN.Process(target=_open_one, args=(s.cache_dir, 10 * MB, ref, replace(s.remote, hang_at=ref.size // 2)))
    proc.start()
    tmp_dir = Path(s.cache_dir) / NS / ".tmp"
    wait_for(lambda: tmp_dir.exists() and any(p.stat().st_size >= ref.size // 2 for p in tmp_dir.iterdir()))
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    return proc


def test_killed_download_is_swept_and_lock_freed(tmp_path: Path) -> None:
    s = make_store(tmp_path, [2 * MB])
    ref = s.refs[0]
    proc = _start_hung_download(s, ref)
    [tmp] = s.temps()
    assert tmp.name.endswith(f".{proc.pid}") and not s.final(ref).exists()
    fd = os.open(Path(s.cache_dir) / NS / ".locks" / f"{s.final(ref).name}.dl", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the dead holder's lock is gone
    os.close(fd)
    with s.cache(10 * MB) as cache:
        assert s.temps() == [] and cache.usage() == 0
        assert read_ok(cache, ref, s.remote, s.remote)
    assert [c[1] for c in s.remote.calls()] == [0, 0]


def test_dead_processes_partial_download_is_adopted(tmp_path: Path) -> None:
    s = make_store(tmp_path, [2 * MB])
    ref = s.refs[0]
    with s.cache(10 * MB) as cache:  # opened before the death, so it never swept
        _start_hung_download(s, ref)
        assert read_ok(cache, ref, s.remote, s.remote)
        assert [c[1] for c in s.remote.calls()] == [0, ref.size // 2]
        assert cache.stats()["bytes_fetched"] == ref.size - ref.size // 2


def test_corrupt_cached_shard_detected_in_new_process(tmp_path: Path) -> None:
    s = make_store(tmp_path, [2 * MB, 1 * MB])
    ref = s.refs[0]
    with s.cache(10 * MB) as cache:
        assert read_ok(cache, ref, s.remote, s.remote)
    with open(s.final(ref), "r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = SPAWN.Queue()
    proc = SPAWN.Process(target=_open_one, args=(s.cache_dir, 10 * MB, ref, s.remote, out))
    proc.start()
    ok, stats = out.get(timeout=30)
    proc.join(10)
    assert ok and stats["corrupt_refetches"] == 1 and stats["misses"] == 1
    assert [c[0] for c in s.remote.calls()] == [ref.name] * 2
    assert s.final(ref).read_bytes() == s.remote.data(ref.name)


def test_verified_shard_is_not_hashed_again_by_a_new_cache_until_it_changes(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import shardkit.cache.shard_cache as cache_mod

    s = make_store(tmp_path, [1 * MB])
    ref = s.refs[0]
    with s.cache(10 * MB) as cache:
        assert read_ok(cache, ref, s.remote, s.remote)
    hashed: list[int] = []
    real = cache_mod.hash_fd
    monkeypatch.setattr(cache_mod, "hash_fd", lambda fd, size: hashed.append(size) or real(fd, size))
    with s.cache(10 * MB) as cache:  # a new cache (as in a new DataLoader worker): stamp trusted
        assert read_ok(cache, ref, s.remote, s.remote)
        assert hashed == [] and cache.stats()["hits"] == 1
    with open(s.final(ref), "r+b") as f:  # any write moves the mtime off the stamp
        first = f.read(1)
        f.seek(0)
        f.write(first)
    with s.cache(10 * MB) as cache:
        assert read_ok(cache, ref, s.remote, s.remote)
        assert hashed == [ref.size] and cache.stats()["corrupt_refetches"] == 0
    assert len(s.remote.calls()) == 1  # the rewrite kept the bytes: verified again, not fetched


def test_a_cache_without_verify_never_stamps_what_it_did_not_hash(tmp_path: Path) -> None:
    s = make_store(tmp_path, [1 * MB])
    ref = s.refs[0]
    with s.cache(10 * MB) as cache, cache.open(ref, s.remote) as shard:
        assert shard.verified  # downloaded and hashed
    with open(s.final(ref), "r+b") as f:  # rewritten in place: the stamp is gone
        first = f.read(1)
        f.seek(0)
        f.write(first)
    with s.cache(10 * MB, verify=False) as cache, cache.open(ref, s.remote) as shard:
        assert not shard.verified  # trusted by size for this reader only
    with s.cache(10 * MB, verify=False) as cache, cache.open(ref, s.remote) as shard:
        assert not shard.verified, "an unhashed file was stamped as verified"
    with s.cache(10 * MB) as cache, cache.open(ref, s.remote) as shard:
        assert shard.verified and bytes(shard.buffer()) == s.remote.data(ref.name)
    assert len(s.remote.calls()) == 1
