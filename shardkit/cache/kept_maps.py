"""Read-only maps of cache files that one process keeps from one epoch to the next.

Zero-copy batches are views into mapped cache files. A fresh map costs a page fault per few
4 KiB pages on first touch (about what copying the page costs); a map kept from the epoch
before has its page tables filled, so a warm epoch reads faster through it (see
benchmarks/RESULTS.md).

A kept map holds its file's inode. When the cache evicts the file (any process on the node
may), its disk space comes back only when the map goes, so entries whose file is gone or was
replaced are dropped: at once for evictions in this process (:meth:`KeptMaps.forget`),
otherwise on the first shard this process opens (any dataset) ``PRUNE_EVERY`` seconds after
the last check, and, while any map is kept, by a daemon thread every ``PRUNE_EVERY`` seconds
(a process that opens nothing more, between epochs or done reading, lets go too). The bytes
kept are bounded (``SHARDKIT_KEEP_MAPS``, default 16 GiB, ``0`` turns keeping off); page
tables cost 8 bytes per 4 KiB page mapped in.

The bound on disk, then: the files under ``cache_dir`` stay within ``cache_limit``; what lies
beyond it is the unlinked files still mapped, which are the kept maps of files another process
evicted in the last ``PRUNE_EVERY`` seconds or so (a check runs at most that long after the
eviction), plus the files of views a caller still holds (zero-copy batches kept alive after
their epoch: their map goes when they do). ``tests/cache/test_cache_faults.py`` measures it on
a small tmpfs.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from typing import NamedTuple

from shardkit.cache.files import FileId
from shardkit.config import keep_maps_budget
from shardkit.util.lru import LRU

__all__ = ["KeptMaps", "KEPT"]

log = logging.getLogger(__name__)

PRUNE_EVERY = 1.0  # seconds between checks that kept files still exist


class _Kept(NamedTuple):
    path: str
    file: FileId
    map: mmap.mmap
    size: int


def _unmap(kept: _Kept) -> None:
    try:
        kept.map.close()
    except BufferError:
        # Batches still hold views into it: the map goes when the last of them does.
        log.debug("kept map of %s: views still alive, unmapped when they go", kept.path)


class KeptMaps:
    """Maps by path, least recently used first, at most :func:`shardkit.config.keep_maps_budget` bytes in all."""

    def __init__(self) -> None:
        # The limit is set from keep_maps_budget() at each get (the variable is read then, not at import).
        self._maps: LRU[str, _Kept] = LRU(0, cost=lambda kept: kept.size, on_evict=_unmap)
        self._mu = threading.Lock()
        self._pruned = time.monotonic()
        self._pruner: int | None = None  # the pid whose pruning thread runs (threads do not survive a fork)

    def get(self, path: str, fd: int, size: int) -> mmap.mmap | None:
        """A read-only map of open file ``fd`` (at ``path``), kept for later calls while the file stays the same.

        Args:
            path: the file's path (the key; a replaced file gets a new map).
            fd: the file, open for reading.
            size: bytes to map.

        Returns:
            The map, or None when keeping is off or ``size`` is over the budget.
        """
        budget = keep_maps_budget()
        if size <= 0 or size > budget:
            return None
        here = FileId.of(os.fstat(fd))
        with self._mu:
            self._prune_locked()
            kept = self._maps.get(path)
            if kept is not None and kept.file == here:
                return kept.map
            if kept is not None:
                self._drop(path)  # the file was replaced (fetched again): its old map goes
            new = _Kept(path, here, mmap.mmap(fd, size, access=mmap.ACCESS_READ), size)
            self._maps.limit = budget
            self._maps.put(path, new)  # unmaps the least recently used beyond the budget
            self._start_pruner()
            return new.map

    def _start_pruner(self) -> None:
        """Start this process's pruning thread if it is not running (``_mu`` held)."""
        if self._pruner == os.getpid():
            return
        self._pruner = os.getpid()
        threading.Thread(target=self._prune_loop, name="shardkit-keptmaps-prune", daemon=True).start()

    def _prune_loop(self) -> None:
        """Drop the maps of files evicted elsewhere every ``PRUNE_EVERY`` s, while any map is kept."""
        while True:
            time.sleep(PRUNE_EVERY)
            with self._mu:
                if self._pruner != os.getpid():
                    return
                if not self._maps:
                    self._pruner = None  # the next kept map starts a new thread
                    return
                self._pruned = 0.0  # due now
                self._prune_locked()

    def forget(self, path: str) -> None:
        """Drop the map of a file this process is deleting.

        Args:
            path: the file.
        """
        with self._mu:
            if path in self._maps:
                self._drop(path)

    def kept_bytes(self) -> int:
        """Bytes of the maps kept now.

        Returns:
            Their sum.
        """
        with self._mu:
            return self._maps.total

    def clear(self) -> None:
        """Drop every kept map."""
        with self._mu:
            for path in list(self._maps):
                self._drop(path)

    def prune(self) -> None:
        """Drop the maps of files that are gone or replaced (at most every ``PRUNE_EVERY`` s).

        The cache calls it on every open, so a process that reads other data (or other
        datasets) lets go of the files another process evicted."""
        if self._maps:
            with self._mu:
                self._prune_locked()

    def _prune_locked(self) -> None:
        # Another process may have evicted a kept file: without this, its disk space would
        # stay in use (outside the cache's accounting) for as long as this process lives.
        now = time.monotonic()
        if not self._maps or now - self._pruned < PRUNE_EVERY:
            return
        self._pruned = now
        for path in list(self._maps):
            kept = self._maps.peek(path)
            try:
                same = kept is not None and FileId.of(os.stat(path))[:2] == kept.file[:2]
            except OSError:
                same = False
            if not same:
                self._drop(path)

    def _drop(self, path: str) -> None:
        kept = self._maps.pop(path)
        if kept is not None:
            _unmap(kept)

    def _after_fork(self) -> None:
        # A forked child inherits the maps (still valid) but maybe a lock held by a thread
        # that does not exist in it, and no pruning thread (the next kept map starts one).
        self._mu = threading.Lock()
        self._pruner = None


KEPT = KeptMaps()
"""This process's kept maps."""
os.register_at_fork(after_in_child=KEPT._after_fork)
