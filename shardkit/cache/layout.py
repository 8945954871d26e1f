"""Where the node cache keeps its files in ``cache_dir``, and the locks that guard them.

Processes coordinate only through files and ``flock`` (Linux), so a killed process releases
its locks with its file descriptors. Layout of ``cache_dir`` (the limit covers all of it)::

    .global.lock                    flock EX: space accounting (reserve, evict, rename, sweep)
    <ns>/<file>                     verified shards; <file> = percent-quoted shard name
    <ns>/.tmp/<file>.<size>.<pid>   downloads in flight; each counts <size> from its creation
                                    (a parallel download has st_size <size> while in flight)
    <ns>/.locks/<file>.pin          flock SH by readers while open, EX|NB by the evictor
    <ns>/.locks/<file>.dl           flock EX by the one process downloading the shard
    <ns>/.locks/<file>.landed       the progress of a download in flight (128 bytes and one per
                                    sample; emptied when it ends, or when room is reserved
                                    after its downloader died): counted with the downloads

Lock order is pin -> dl -> global. The global lock is held only for metadata work and tries
other locks only with LOCK_NB, so nobody waits while holding it and nothing can deadlock.
Lock files are never deleted: deleting one would let two processes lock different inodes.
No lock is waited for without bound (:mod:`.lock_wait`): a wait says who holds the lock, and
gives up (the shard is read around the cache) when that process makes no progress.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from shardkit.cache.files import NO_SPACE, FileLock, list_with_stat, preallocate, unlink_quiet
from shardkit.cache.lock_wait import wait_lock
from shardkit.cache.progress_file import PROGRESS_SUFFIX
from shardkit.config import human_bytes
from shardkit.errors import CacheDiskFullError, ConfigError
from shardkit.util.procs import pid_alive

__all__ = ["CacheDir", "CacheEntry", "EX_NB", "no_space_errno"]

log = logging.getLogger(__name__)

EX_NB = fcntl.LOCK_EX | fcntl.LOCK_NB
_NAMESPACE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_TEMP = re.compile(r"^(?P<file>.+)\.(?P<size>\d+)\.(?P<pid>\d+)$")


@dataclass
class CacheEntry:
    """A file that counts against the limit."""

    path: str
    ns: str
    file: str
    size: int  # st_size of a shard; the full reservation of a temp file
    last_use: int  # ns: a shard's atime (set on every open), a temp file's mtime
    temp: bool
    pid: int = 0


class CacheDir:
    """One namespace's paths and locks in a cache directory, and the scan of all of it.

    Args:
        root: the cache directory (made if missing).
        ns: the namespace (a subdirectory).
        lock_wait: seconds a wait for the global lock goes on while its holder makes no
            progress (see :mod:`.lock_wait`); None: ``SHARDKIT_LOCK_WAIT``.

    Raises:
        ConfigError: a namespace that is not a short plain name, or a directory that cannot be
            made or written (a read-only one, say).
        CacheDiskFullError: no room on the disk for the cache's own directories and locks.
    """

    def __init__(self, root: str, ns: str, lock_wait: float | None = None) -> None:
        if not _NAMESPACE.match(ns):
            raise ConfigError(f"cache namespace must match {_NAMESPACE.pattern}, got {ns!r}")
        self.root, self.ns, self.lock_wait = root, ns, lock_wait
        try:
            for sub in (".tmp", ".locks"):
                os.makedirs(os.path.join(root, ns, sub), exist_ok=True)
            # The cache writes locks and downloads here: a read-only directory (one that already
            # holds shards, say) is said now, in one line, not as a raw OSError at the first lock.
            os.close(os.open(os.path.join(root, ".global.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
        except OSError as exc:
            if exc.errno in NO_SPACE:
                raise self.no_space(exc.errno, "the cache's own directories and locks", 0, 0) from exc
            raise ConfigError(self.unusable(exc)) from exc

    def unusable(self, exc: OSError) -> str:
        """The one-line message for a cache directory the cache cannot write.

        Args:
            exc: the error a write (or a directory or lock made) gave.

        Returns:
            The message, naming the directory and what to do.
        """
        why = os.strerror(exc.errno) if exc.errno else type(exc).__name__
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return (f"cache_dir {self.root} is not writable ({why}): the node cache writes its locks and downloads "
                    f"there, even to read the shards it already holds; pass a writable directory on local disk as "
                    f"cache_dir, or cache_dir=None to stream without a cache")
        return f"cache_dir {self.root} is not usable ({why}): pass a directory on local disk as cache_dir"

    def no_space(self, err: int, name: str, need: int, limit: int) -> CacheDiskFullError:
        """The one error a full disk (or quota) under the cache becomes.

        Args:
            err: ``ENOSPC`` or ``EDQUOT``.
            name: what was being written (a shard's name).
            need: the bytes it needed (0: unknown).
            limit: the cache's limit (0: unknown).

        Returns:
            The error (to raise), naming the directory, the room needed and what to do.
        """
        try:
            vfs = os.statvfs(self.root)
            free = vfs.f_bavail * vfs.f_frsize
        except OSError:
            free = -1
        try:
            held = sum(e.size for e in self.scan())
        except OSError:
            held = -1
        room = f"{name} needs {human_bytes(need)}" if need else name
        have = f"the disk has {human_bytes(free)} free" if free >= 0 else "the disk is full"
        if held >= 0 and free >= 0 and limit:
            fix = (f"the cache holds {human_bytes(held)} of its cache_limit {human_bytes(limit)}: lower cache_limit "
                   f"to {human_bytes(held + free)} or less (what this disk can hold), or free space on that disk")
        else:
            fix = "lower cache_limit, or free space on that disk"
        return CacheDiskFullError(f"cache_dir {self.root}: {os.strerror(err)}: {room}, {have}; {fix}", err)

    def temp_progress(self, file: str) -> tuple[tuple[str, int, int, int], ...]:
        """What changes while a download of ``file`` moves: its temp files' names, sizes,
        mtimes and blocks (a map fill has its full size from the start).

        Args:
            file: the shard's file name.

        Returns:
            A value to compare with the one before.
        """
        out = []
        for t, st in list_with_stat(os.path.join(self.root, self.ns, ".tmp")):
            m = _TEMP.match(t.name)
            if m is not None and m["file"] == file:
                out.append((t.name, st.st_size, st.st_mtime_ns, st.st_blocks))
        return tuple(sorted(out))

    def final(self, file: str) -> str:
        """Where a verified shard lives.

        Args:
            file: its file name (:func:`~shardkit.cache.files.file_name`).

        Returns:
            The path.
        """
        return os.path.join(self.root, self.ns, file)

    def temp(self, file: str, size: int, pid: int | str | None = None) -> str:
        """A process's download of a shard.

        Args:
            file: its file name.
            size: the bytes it reserves.
            pid: the downloading process (default: this one).

        Returns:
            The temp file's path.
        """
        return os.path.join(self.root, self.ns, ".tmp", f"{file}.{size}.{os.getpid() if pid is None else pid}")

    def fresh_temp(self, tmp: str, size: int, quiet: bool = False) -> None:
        """A new, empty inode under this process's temp name ``tmp`` (its reservation stays).

        Readers of a shard still landing may hold the old inode open and mapped: it is never
        cut or written over, only unlinked.

        Args:
            tmp: the temp file (the caller holds the shard's download lock).
            size: the bytes it reserves (preallocated again).
            quiet: log a failure instead of raising it (an error is on its way already).

        Raises:
            OSError: ENOSPC or EDQUOT (the disk has no room), or the new file cannot be made.
            CacheLockedError: the global lock's holder made no progress.
        """
        try:
            with self.locked():  # the name is gone only while the lock is held: scans never miss it
                unlink_quiet(tmp)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                preallocate(fd, size)
            finally:
                os.close(fd)
        except Exception as exc:
            if not quiet:
                raise
            log.warning("cache: could not empty %s after a failed download: %s", tmp, exc)

    def lock_path(self, ns: str, file: str, kind: str) -> str:
        """A lock file.

        Args:
            ns: the namespace (eviction locks other namespaces' files too).
            file: the shard's file name.
            kind: ``"pin"`` (readers) or ``"dl"`` (the download).

        Returns:
            The lock file's path.
        """
        return os.path.join(self.root, ns, ".locks", f"{file}.{kind}")

    def gone(self) -> bool:
        """Whether this namespace's lock directory is gone.

        Returns:
            True when the cache was removed while in use.
        """
        return not os.path.isdir(os.path.join(self.root, self.ns, ".locks"))

    @contextmanager
    def locked(self, op: int = fcntl.LOCK_EX) -> Iterator[None]:
        """Hold the global lock for the ``with`` block.

        Yields:
            Nothing; the lock is held until the block ends.

        Args:
            op: ``LOCK_EX``, or ``LOCK_SH`` to only read the accounting.

        Yields:
            Nothing: the lock is held inside the block.

        Raises:
            CacheLockedError: its holder made no progress for :func:`~shardkit.config.lock_wait` seconds.
        """
        lock = wait_lock(os.path.join(self.root, ".global.lock"), op, f"the space accounting of {self.root}",
                         limit=self.lock_wait)
        try:
            yield
        finally:
            lock.release()

    def scan(self) -> list[CacheEntry]:
        """Every file that counts against the limit, all namespaces.

        Returns:
            The entries (exact with the global lock held).
        """
        out: list[CacheEntry] = []
        for ns, _ in list_with_stat(self.root):
            if ns.name.startswith(".") or not ns.is_dir(follow_symlinks=False):
                continue
            for e, st in list_with_stat(ns.path):
                if not e.is_dir(follow_symlinks=False):
                    out.append(CacheEntry(e.path, ns.name, e.name, st.st_size, st.st_atime_ns, False))
            for t, st in list_with_stat(os.path.join(ns.path, ".tmp")):
                m = _TEMP.match(t.name)
                file, size, pid = (m["file"], int(m["size"]), int(m["pid"])) if m else (t.name, 0, 0)
                out.append(CacheEntry(t.path, ns.name, file, max(st.st_size, size), st.st_mtime_ns, True, pid))
        return out

    def progress_bytes(self, reserving: str) -> int:
        """Bytes the progress files of downloads in flight take, all namespaces. Call with the
        global lock held. A non-empty one whose download lock nobody holds was left by a killed
        downloader: it is emptied here (its readers then wait for the published shard) and not
        counted, so it never keeps room from a tight cache.

        Args:
            reserving: the file (in this namespace) whose download is reserving room: its own
                progress file is started anew by that download, and counted by the caller.

        Returns:
            Their sizes' sum.
        """
        total = 0
        for ns, _ in list_with_stat(self.root):
            if ns.name.startswith(".") or not ns.is_dir(follow_symlinks=False):
                continue
            for path, size in self._progress_files(ns.path):
                file = os.path.basename(path)[:-len(PROGRESS_SUFFIX)]
                if ns.name == self.ns and file == reserving:
                    continue
                dl = FileLock.try_take(self.lock_path(ns.name, file, "dl"), EX_NB)
                if dl is None:  # a download in flight
                    total += size
                    continue
                try:
                    with open(path, "r+b") as f:
                        f.truncate(0)
                except OSError:
                    total += size  # could not empty it: it still takes its bytes
                finally:
                    dl.release()
        return total

    @staticmethod
    def _progress_files(ns_path: str) -> list[tuple[str, int]]:
        """(path, size) of the non-empty progress files in a namespace's ``.locks``."""
        out = []
        try:
            with os.scandir(os.path.join(ns_path, ".locks")) as it:
                for e in it:  # stat only the progress files: the locks beside them are many
                    if e.name.endswith(PROGRESS_SUFFIX):
                        try:
                            size = e.stat(follow_symlinks=False).st_size
                        except FileNotFoundError:
                            continue
                        if size:
                            out.append((e.path, size))
        except FileNotFoundError:
            pass
        return out

    def adopt(self, file: str, size: int) -> tuple[str, int] | None:
        """Take over a partial download of ``file`` (``size`` bytes) left by any process.

        Call with the global and download locks held, so nobody writes it. Other temp files of
        ``file`` (another size, or longer than it) are deleted.

        Args:
            file: the shard's file name.
            size: its size.

        Returns:
            The file under this process's name and the bytes in it, or None.
        """
        found = None
        for t, st in list_with_stat(os.path.join(self.root, self.ns, ".tmp")):
            m = _TEMP.match(t.name)
            if m is not None and m["file"] == file:
                if found is None and int(m["size"]) == size and st.st_size <= size:
                    found = t.path, st.st_size
                else:
                    unlink_quiet(t.path)
        if found is None:
            return None
        mine = self.temp(file, size)
        os.replace(found[0], mine)
        return mine, found[1]

    def sweep_dead(self) -> None:
        """Delete the partial downloads of dead processes that nobody adopted (global lock held)."""
        for e in self.scan():
            dl = None
            if e.temp and e.pid and not pid_alive(e.pid):
                dl = FileLock.try_take(self.lock_path(e.ns, e.file, "dl"), EX_NB)
            if dl is not None:
                log.info("cache: removing stale partial download %s", e.path)
                unlink_quiet(e.path)
                dl.release()


def no_space_errno(exc: BaseException | None) -> int | None:
    """The ``ENOSPC`` or ``EDQUOT`` behind an error: its own errno, or that of an error it was
    raised from (a storage error translated from a write into the cache, say).

    Args:
        exc: the error.

    Returns:
        The errno, or None.
    """
    for _ in range(8):
        if exc is None:
            return None
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return exc.errno
        exc = exc.__cause__
    return None
