"""Faults of the node cache on a real node: a full disk (a small tmpfs mounted by the test), a
lock held by a stopped process (SIGSTOP), a read-only cache directory, and disk held beyond
``cache_limit`` by maps of files another process evicted.

Each test ends with the expected bytes or one clear error, within a bounded time; never a
SIGBUS, never a hang. The tmpfs tests need root (or CAP_SYS_ADMIN) to mount; where that is
impossible they skip, saying so, and the simulated full disk test (ENOSPC from the cache's own
allocation calls) still covers the cache's handling.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from cachefakes import MB, NS, PosRemote, Remote, Store, make_store, wait_for
from shardkit.cache import files as files_mod
from shardkit.cache import lock_wait as lock_wait_mod
from shardkit.cache.files import FileLock, file_name
from shardkit.cache.kept_maps import KEPT
from shardkit.cache.shard_cache import ShardCache, ShardRef
from shardkit.errors import CacheDiskFullError, CacheLockedError, ConfigError, NoRoomError

SPAWN = mp.get_context("spawn")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def resource_tracker() -> None:
    """Start multiprocessing's per-session helper before the leak police takes its snapshot."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


# ---- a small real file system --------------------------------------------------------------

MountFs = Callable[[str], Path]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[MountFs]:
    """``mount(size)``: a fresh tmpfs of ``size`` (``"8m"``) mounted under ``tmp_path``,
    unmounted after the test; skips the test where no tmpfs can be mounted."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (or CAP_SYS_ADMIN); test_simulated_full_disk covers the "
                        "cache's handling of ENOSPC without one")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); test_simulated_full_disk covers the "
                        "cache's handling of ENOSPC without one")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fs_used(path: Path) -> int:
    """Bytes in use on the file system of ``path`` (what ``df`` shows)."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def fill(path: Path, nbytes: int) -> None:
    """Take ``nbytes`` of the disk with a file that is not the cache's."""
    with open(path, "wb") as f:
        f.write(b"\1" * nbytes)


def on_fs(s: Store, fs: Path) -> Store:
    return replace(s, cache_dir=str(fs / "cache"))


def temps(s: Store) -> list[str]:
    tmp = Path(s.cache_dir) / NS / ".tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.exists() else []


# ---- child processes (module level so "spawn" can import them) ---------------------------

def _open_each(out: Any, cache_dir: str, limit: int, refs: list[ShardRef], remote: Any, landing: bool) -> None:
    """Open each shard once; report ("ok", bytes match) or (error type, message, errno) per shard."""
    cache = ShardCache(cache_dir, limit, namespace=NS)
    got: list[tuple[Any, ...]] = []
    for ref in refs:
        try:
            with cache.open(ref, remote, landing=landing) as shard:
                got.append(("ok", bytes(shard.buffer()) == remote.data(ref.name)))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            got.append((type(exc).__name__, str(exc), getattr(exc, "errno", None)))
    cache.close()
    out.put(got)


def run_child(target: Callable[..., None], *args: Any) -> list[tuple[Any, ...]]:
    """Run ``target(out, *args)`` in a spawned process; its report, or a failure naming how it died."""
    out = SPAWN.Queue()
    proc = SPAWN.Process(target=target, args=(out, *args))
    proc.start()
    try:
        got: list[tuple[Any, ...]] = out.get(timeout=60)
    except queue.Empty:
        got = []
    proc.join(30)
    if proc.exitcode is None:
        proc.kill()
        proc.join(10)
    assert proc.exitcode == 0, f"the reader died with exit code {proc.exitcode} (-{int(signal.SIGBUS)}: SIGBUS)"
    return got


def _hold_and_stop(path: str, ready: Any) -> None:
    """Take the lock ``path`` exclusively, then stop (SIGSTOP) holding it."""
    lock = FileLock.take(path)
    lock_wait_mod.write_owner(lock)
    ready.set()
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rfind(")") + 2:].split()[0]


class Stopped:
    """A spawned process that holds the lock ``path`` and is stopped (SIGSTOP), until ended."""

    def __init__(self, path: str) -> None:
        ready = SPAWN.Event()
        self.proc = SPAWN.Process(target=_hold_and_stop, args=(path, ready))
        self.proc.start()
        assert ready.wait(30)
        wait_for(lambda: _state(self.pid) == "T")

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.exitcode is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)


def bounded(fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    """``fn()`` in a thread: its result, its error raised here, or a failure if it is still
    waiting after ``timeout`` seconds (a hang fails the test instead of hanging it)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box["error"] = exc

    t = threading.Thread(target=run, name="bounded-call", daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still waiting after {timeout:.0f} s (a hang)"
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---- a full disk -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["map", "stream", "landing"])
def test_a_full_cache_disk_is_one_clear_error_not_sigbus(tmp_path: Path, small_fs: MountFs, kind: str) -> None:
    # 8 MiB of disk, 4 MiB of it taken by other files, a cache_limit of 64 MiB: the second
    # 3 MiB shard finds no disk. Before: a map fill died of SIGBUS (fallocate's ENOSPC
    # ignored, then writes through a map of a sparse file); a stream or landing fill raised a
    # raw OSError [Errno 28].
    fs = small_fs("8m")
    fill(fs / "other-files", 4 * MB)
    s = on_fs(make_store(tmp_path, [3 * MB, 3 * MB, 3 * MB]), fs)
    remote: Any = s.remote if kind == "stream" else PosRemote(s.remote.src, str(tmp_path / "pos.log"),
                                                                reports=kind == "landing")
    got = run_child(_open_each, s.cache_dir, 64 * MB, s.refs, remote, kind == "landing")
    assert got[0] == ("ok", True)
    for name, message, err in got[1:]:
        assert name == "CacheDiskFullError" and err == errno.ENOSPC, (name, message)
        assert "\n" not in message and s.cache_dir in message
        assert "needs 3.1 MB" in message and "lower cache_limit to" in message and "free space" in message
    assert temps(s) == []  # nothing half-written left
    assert s.cached() == {s.refs[0].name}
    with s.cache(64 * MB) as cache:  # what is there still reads
        with cache.open(s.refs[0], s.remote) as shard:
            assert bytes(shard.buffer()) == s.remote.data(s.refs[0].name)


def test_simulated_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without a small file system: the cache's allocation calls fail as on a full disk.
    s = make_store(tmp_path, [2 * MB])

    def no_room(fd: int, mode: int, offset: int, size: int) -> int:
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(files_mod, "_fallocate", no_room)
    with s.cache(64 * MB) as cache:
        with pytest.raises(CacheDiskFullError, match="No space left on device") as info:
            cache.open(s.refs[0], s.remote)
        assert info.value.errno == errno.ENOSPC and s.cache_dir in str(info.value)
    assert temps(s) == []

    # A file system that cannot reserve blocks (EOPNOTSUPP) and a disk that then has none for
    # a map fill: no map is written, the same one error.
    def unsupported(fd: int, mode: int, offset: int, size: int) -> int:
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1

    def posix_fallocate(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files_mod, "_fallocate", unsupported)
    monkeypatch.setattr(os, "posix_fallocate", posix_fallocate)
    remote = PosRemote(s.remote.src, str(tmp_path / "pos.log"))
    with s.cache(64 * MB) as cache:
        with pytest.raises(CacheDiskFullError):
            cache.open(s.refs[0], remote)
    assert temps(s) == [] and remote.calls() == []  # refused before any byte was fetched


def test_a_local_dataset_on_a_full_cache_disk_blames_the_disk_not_storage(tmp_path: Path, small_fs: MountFs) -> None:
    from randomds import pack_random
    from shardkit import StreamingDataset

    url, _ = pack_random(tmp_path, n=40, max_body=200_000, classes=2, shard_bytes="1MB", seed=3, prefix="d")
    fs = small_fs("8m")
    fill(fs / "other-files", 6 * MB)
    cache_dir = fs / "cache"
    with pytest.raises(CacheDiskFullError) as info:
        for _ in StreamingDataset(url, cache_dir=cache_dir, cache_limit="1GB"):
            pass
    message = str(info.value)
    assert str(cache_dir) in message and "lower cache_limit" in message and "storage" not in message
    assert not list((cache_dir / next(p.name for p in cache_dir.iterdir() if not p.name.startswith("."))
                     / ".tmp").iterdir())


# ---- locks held by a stopped process -------------------------------------------------------

def _hung_download(out: Any, cache_dir: str, ref: ShardRef, remote: Remote) -> None:
    cache = ShardCache(cache_dir, 64 * MB, namespace=NS)
    out.put(os.getpid())
    cache.open(ref, remote)  # hangs at remote.hang_at


def test_a_download_lock_of_a_stopped_reader_is_waited_for_with_a_bound_and_said(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the second reader waited on the stopped reader's download lock without end,
    # printing nothing.
    monkeypatch.setattr(lock_wait_mod, "LOCK_NOTE_SECONDS", 0.5)
    s = make_store(tmp_path, [4 * MB])
    ref = s.refs[0]
    out = SPAWN.Queue()
    holder = SPAWN.Process(target=_hung_download, args=(out, s.cache_dir, ref, replace(s.remote, hang_at=2 * MB)))
    holder.start()
    try:
        pid = out.get(timeout=30)
        wait_for(lambda: any(p.stat().st_size >= 2 * MB for p in (Path(s.cache_dir) / NS / ".tmp").iterdir()))
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: _state(pid) == "T")
        with s.cache(64 * MB, lock_wait=2.0) as cache, caplog.at_level(logging.WARNING, "shardkit.cache"):
            with pytest.raises(CacheLockedError) as info:
                bounded(lambda: cache.open(ref, s.remote))
            assert isinstance(info.value, NoRoomError)  # readers then read the shard around the cache
            message = str(info.value)
            assert f"pid {pid} (stopped)" in message and "SHARDKIT_LOCK_WAIT" in message and "\n" not in message
            assert any(f"pid {pid} (stopped)" in r.getMessage() and "has waited" in r.getMessage()
                       for r in caplog.records)
            assert cache.stats()["lock_fallbacks"] == 1
            # Killed, the stopped reader lets go; its partial download is taken over.
            os.kill(pid, signal.SIGKILL)
            holder.join(10)
            with bounded(lambda: cache.open(ref, s.remote)) as shard:
                assert bytes(shard.buffer()) == s.remote.data(ref.name)
    finally:
        if holder.exitcode is None:
            os.kill(holder.pid or 0, signal.SIGKILL)
            holder.join(10)


def test_a_download_that_moves_is_waited_for_past_the_bound(tmp_path: Path) -> None:
    # A slow download is no stuck one: its temp file grows, and the reader waits for it.
    s = make_store(tmp_path, [3 * MB])
    ref = s.refs[0]
    slow = replace(s.remote, delay=0.05, chunk=64 << 10)  # ~2.4 s for the shard
    out = SPAWN.Queue()
    holder = SPAWN.Process(target=_open_each, args=(out, s.cache_dir, 64 * MB, [ref], slow, False))
    holder.start()
    try:
        wait_for(lambda: (Path(s.cache_dir) / NS / ".tmp").exists() and
                 any((Path(s.cache_dir) / NS / ".tmp").iterdir()))
        with s.cache(64 * MB, lock_wait=0.5) as cache:
            with bounded(lambda: cache.open(ref, s.remote)) as shard:
                assert bytes(shard.buffer()) == s.remote.data(ref.name)
            assert cache.stats()["lock_fallbacks"] == 0 and cache.stats()["hits"] == 1
        assert out.get(timeout=30) == [("ok", True)]
    finally:
        holder.join(30)
    assert len(s.remote.calls()) == 1  # fetched once, by the first reader


def test_the_global_lock_of_a_stopped_process_is_bounded_too(tmp_path: Path) -> None:
    s = make_store(tmp_path, [1 * MB])
    Path(s.cache_dir).mkdir()
    stopped = Stopped(str(Path(s.cache_dir) / ".global.lock"))
    try:
        cache = bounded(lambda: s.cache(64 * MB, lock_wait=1.0))  # skips its sweep, says so
        with pytest.raises(CacheLockedError, match=f"pid {stopped.pid} \\(stopped\\)"):
            bounded(lambda: cache.open(s.refs[0], s.remote))
        stopped.kill()
        with bounded(lambda: cache.open(s.refs[0], s.remote)) as shard:
            assert bytes(shard.buffer()) == s.remote.data(s.refs[0].name)
        cache.close()
    finally:
        stopped.kill()


@contextlib.contextmanager
def shard_lock_held_by_a_stopped_reader(tmp_path: Path, n: int, seed: int, shard: int
                                        ) -> Iterator[tuple[str, dict[str, bytes], Path]]:
    """A dataset whose shard ``shard`` has its download lock in the node cache held by a
    SIGSTOPped process: yields (url, expected bodies by key, cache_dir); the process is killed after."""
    from randomds import pack_random
    from shardkit.read.cache_refs import cache_namespace
    from shardkit.read.dataset import Dataset

    url, bodies = pack_random(tmp_path, n=n, max_body=20_000, classes=2, shard_bytes="100KB", seed=seed, prefix="k")
    ds = Dataset(url)
    cache_dir = tmp_path / "cache"
    locks = cache_dir / cache_namespace(ds) / ".locks"
    locks.mkdir(parents=True)
    stopped = Stopped(str(locks / f"{file_name(ds.shard_list[shard].path)}.dl"))
    try:
        yield url, bodies, cache_dir
    finally:
        stopped.kill()


def test_a_stream_reads_around_a_shard_whose_download_lock_a_stopped_reader_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit import StreamingDataset

    monkeypatch.setenv("SHARDKIT_LOCK_WAIT", "1")
    with shard_lock_held_by_a_stopped_reader(tmp_path, n=40, seed=5, shard=1) as (url, bodies, cache_dir):
        sd = StreamingDataset(url, cache_dir=cache_dir, cache_limit="1GB")
        got = bounded(lambda: {s["__key__"]: bytes(s["bin"]) for s in sd})
        assert got == bodies
        stats = sd.stats()
        assert stats["lock_fallbacks"] == 1 and stats["uncached_reads"] == 1


def test_random_access_reads_around_a_shard_whose_download_lock_a_stopped_reader_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit import ShardDataset

    monkeypatch.setenv("SHARDKIT_LOCK_WAIT", "1")
    with shard_lock_held_by_a_stopped_reader(tmp_path, n=20, seed=6, shard=0) as (url, bodies, cache_dir):
        sd = ShardDataset(url, cache_dir=cache_dir, cache_shards=True)
        got = bounded(lambda: {s["__key__"]: bytes(s["bin"]) for s in (sd[i] for i in range(len(sd)))})
        assert got == bodies


# ---- a read-only cache directory -----------------------------------------------------------

def test_a_read_only_cache_directory_holding_shards_is_one_clear_error(tmp_path: Path, small_fs: MountFs) -> None:
    # Before: a raw OSError [Errno 30] Read-only file system from the first lock.
    fs = small_fs("16m")
    s = on_fs(make_store(tmp_path, [1 * MB, 1 * MB]), fs)
    with s.cache(64 * MB) as cache:
        for ref in s.refs:
            cache.open(ref, s.remote).close()
    subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True, timeout=30)
    with pytest.raises(ConfigError) as info:
        s.cache(64 * MB)
    message = str(info.value)
    assert message.startswith(f"cache_dir {s.cache_dir} is not writable (Read-only file system)")
    assert "cache_dir=None" in message and "\n" not in message


# ---- disk held by maps of evicted files ------------------------------------------------------

def test_maps_of_files_another_process_evicted_let_go_of_the_disk_while_idle(tmp_path: Path,
                                                                             small_fs: MountFs) -> None:
    # This process keeps maps of two shards (zero-copy epochs do), then idles; another process
    # evicts them to make room for its own. The unlinked files stay on disk while mapped: the
    # cache's files stay within cache_limit, the disk does not. Bound: the kept maps of files
    # evicted in the last PRUNE_EVERY seconds or so. Before, an idle process held them on for
    # as long as it lived (they were dropped only at its next open).
    fs = small_fs("32m")
    limit = 8 * MB
    s = on_fs(make_store(tmp_path, [3 * MB] * 4), fs)
    KEPT.clear()
    try:
        base = fs_used(fs)
        with s.cache(limit) as cache:
            for ref in s.refs[:2]:
                with cache.open(ref, s.remote) as shard:
                    assert len(shard.buffer(keep=True)) == ref.size
        assert KEPT.kept_bytes() == 6 * MB
        got = run_child(_open_each, s.cache_dir, limit, s.refs[2:], s.remote, False)
        assert got == [("ok", True), ("ok", True)]
        assert s.cached() == {r.name for r in s.refs[2:]}  # the kept ones were evicted
        held = fs_used(fs) - base
        assert held <= limit + KEPT.kept_bytes() + MB  # the bound: limit + kept maps of evicted files
        wait_for(lambda: fs_used(fs) - base <= limit + MB, timeout=15)  # let go without another open
        assert KEPT.kept_bytes() == 0
    finally:
        KEPT.clear()
