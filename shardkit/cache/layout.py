"""Where the node cache keeps its files in ``cache_dir``, and the locks that guard them.

Processes coordinate only through files and ``flock`` (Linux), so a killed process releases
its locks with its file descriptors. Layout of ``cache_dir`` (the limit covers all of it)::

    .global.lock                    flock EX: space accounting (reserve, evict, rename, sweep)
    <ns>/<file>                     verified shards; <file> = percent-quoted shard name
    <ns>/.tmp/<file>.<size>.<pid>   downloads in flight; each counts <size> from its creation
                                    (a parallel download has st_size <size> while in flight)
    <ns>/.locks/<file>.pin          flock SH by readers while open, EX|NB by the evictor
    <ns>/.locks/<file>.dl           flock EX by the one process downloading the shard

Lock order is pin -> dl -> global. The global lock is held only for metadata work and tries
other locks only with LOCK_NB, so nobody waits while holding it and nothing can deadlock.
Lock files are never deleted: deleting one would let two processes lock different inodes.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from shardkit.cache.files import FileLock, list_with_stat, unlink_quiet
from shardkit.errors import ConfigError
from shardkit.util.procs import pid_alive

__all__ = ["CacheDir", "CacheEntry", "EX_NB"]

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

    Raises:
        ConfigError: a namespace that is not a short plain name, or a directory that cannot be made.
    """

    def __init__(self, root: str, ns: str) -> None:
        if not _NAMESPACE.match(ns):
            raise ConfigError(f"cache namespace must match {_NAMESPACE.pattern}, got {ns!r}")
        self.root, self.ns = root, ns
        try:
            for sub in (".tmp", ".locks"):
                os.makedirs(os.path.join(root, ns, sub), exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cache_dir {root} is not usable: {exc}") from exc

    def final(self, file: str) -> str:
        """Where a verified shard lives.

        Args:
            file: its file name (:func:`~shardkit.cache.files.file_name`).

        Returns:
            The path.
        """
        return os.path.join(self.root, self.ns, file)

    def temp(self, file: str, size: int) -> str:
        """This process's download of a shard.

        Args:
            file: its file name.
            size: the bytes it reserves.

        Returns:
            The temp file's path.
        """
        return os.path.join(self.root, self.ns, ".tmp", f"{file}.{size}.{os.getpid()}")

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
        """Whether the cache was removed while in use.

        Returns:
            True when this namespace's lock directory is gone.
        """
        return not os.path.isdir(os.path.join(self.root, self.ns, ".locks"))

    @contextmanager
    def locked(self, op: int = fcntl.LOCK_EX) -> Iterator[None]:
        """Hold the global lock for the ``with`` block.

        Yields:
            Nothing; the lock is held until the block ends.

        Args:
            op: ``LOCK_EX``, or ``LOCK_SH`` to only read the accounting.
        """
        lock = FileLock.take(os.path.join(self.root, ".global.lock"), op)
        try:
            yield
        finally:
            lock.release()

    def scan(self) -> list[CacheEntry]:
        """List what counts against the limit (exact with the global lock held).

        Returns:
            An entry for every cached file and reservation, in all namespaces.
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
