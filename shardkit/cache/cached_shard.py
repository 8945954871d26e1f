"""A verified shard in the node cache, open for reading: pinned against eviction until closed."""

from __future__ import annotations

import logging
import mmap
import os

from shardkit.cache.files import FileLock, ShardRef
from shardkit.cache.kept_maps import KEPT
from shardkit.cache.landing import LANDING, Landing
from shardkit.cache.open_shard import OpenShard

__all__ = ["CachedShard"]

log = logging.getLogger(__name__)


class CachedShard(OpenShard):
    """A verified shard on local disk, pinned against eviction until :meth:`close`.

    Made by :meth:`~shardkit.cache.shard_cache.ShardCache.open`.

    Args:
        ref: the shard.
        path: its file in the cache.
        fd: the file, open for reading (closed by :meth:`close`).
        pin: the shard's pin lock, held shared (released by :meth:`close`).
        verified: the whole file matched the manifest's checksum and is unchanged since (its
            mtime is the cache's stamp); False only for a cache with verify=False and an
            unstamped file.
        landing: the landing buffer this process fetched the shard into, pinned for this
            reader, when it still holds the shard (unpinned by :meth:`close`).

    Attributes:
        ref: the shard.
        path: local file path, valid while the shard is open.
        verified: as given.
    """

    def __init__(self, ref: ShardRef, path: str, fd: int, pin: FileLock, *, verified: bool = False,
                 landing: Landing | None = None) -> None:
        super().__init__(ref, path, fd, landing)
        self.verified = verified
        self._pin = pin
        self._mmap: mmap.mmap | None = None
        self._view: memoryview | None = None

    def buffer(self, keep: bool = False) -> memoryview:
        """A read-only memoryview of the whole file (mapped on first call).

        Args:
            keep: map it through the process's kept maps (:mod:`.kept_maps`), so the next
                epoch's reads find the page tables already filled.

        Returns:
            The file's bytes.

        Raises:
            ValueError: the shard is closed.
        """
        fd = self.fileno()  # refuses a closed shard
        if self._view is None:
            kept = KEPT.get(self.path, fd, self.ref.size) if keep else None
            if kept is not None:
                self._view = memoryview(kept)  # not self._mmap: close() leaves a kept map open
                return self._view
            if self.ref.size:
                # No MAP_POPULATE: DataLoader workers take turns in batches, so each reads only
                # part of a shard; populating all of it in every worker faults in pages it never reads.
                self._mmap = mmap.mmap(fd, self.ref.size, access=mmap.ACCESS_READ)
            self._view = memoryview(self._mmap if self._mmap is not None else b"")
        return self._view

    def close(self) -> None:
        """Unmap the file and unpin the shard."""
        if self._fd < 0:
            return
        if self._view is not None:
            try:
                self._view.release()
            except BufferError:  # arrays over it are alive (zero-copy batches): they keep it mapped
                pass
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # The caller still holds slices: the mapping lives until they are dropped,
                # and stays valid even if the file is evicted (Linux keeps the inode).
                log.debug("shard %s: buffer slices still alive at close", self.ref.name)
        os.close(self._fd)
        self._fd = -1
        if self._landing is not None:
            LANDING.release(self._landing)
            self._landing = None
        self._pin.release()

    def __enter__(self) -> CachedShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
