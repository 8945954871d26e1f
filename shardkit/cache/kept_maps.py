"""Read-only maps of cache files that one process keeps from one epoch to the next.

Zero-copy batches are views into mapped cache files. A fresh map costs a page fault per few
4 KiB pages on first touch (about what copying the page costs); a map kept from the epoch
before has its page tables filled, so a warm epoch reads faster through it (see
benchmarks/RESULTS.md).

A kept map holds its file's inode. When the cache evicts the file (any process on the node
may), its disk space comes back only when the map goes, so entries whose file is gone or was
replaced are dropped: at once for evictions in this process (:meth:`KeptMaps.forget`),
otherwise on the first shard this process opens (any dataset) ``PRUNE_EVERY`` seconds after
the last check. The bytes kept are bounded (``SHARDKIT_KEEP_MAPS``, default 16 GiB, ``0``
turns keeping off); page tables cost 8 bytes per 4 KiB page mapped in.
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
            return new.map

    def forget(self, path: str) -> None:
        """Drop the map of a file this process is deleting.

        Args:
            path: the file.
        """
        with self._mu:
            if path in self._maps:
                self._drop(path)

    def kept_bytes(self) -> int:
        """How much is mapped.

        Returns:
            Bytes of the maps kept now.
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
        # that does not exist in it.
        self._mu = threading.Lock()


KEPT = KeptMaps()
"""This process's kept maps."""
os.register_at_fork(after_in_child=KEPT._after_fork)
