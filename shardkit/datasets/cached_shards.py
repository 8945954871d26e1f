"""Random access through the node cache: one process's open cached shards and checked samples.

``ShardDataset`` serves a sample from the node cache when its shard is there: the shard file is
opened (pinned against eviction) and mapped, the most recently used few stay open, and each
sample's checksum is checked on its first use in the process, unless the whole file still
bears the cache's "verified" stamp. With ``cache_shards``, a shard not cached yet is downloaded
(parallel ranged GETs, the part holding the sample asked for first) and the sample is served as
soon as its bytes are in and match their checksum (``ShardCache.open(stream=True)``): the
whole shard is checked before the file counts as cached.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import numpy as np
import xxhash

from shardkit.cache.shard_cache import CachedShard, LandingShard, ShardCache
from shardkit.errors import IntegrityError, NoRoomError
from shardkit.read.dataset import Dataset, ShardInfo, ShardRows
from shardkit.read.held import open_held
from shardkit.read.cache_refs import cache_namespace, shard_ref
from shardkit.util.lru import LRU

__all__ = ["CachedShards"]

log = logging.getLogger(__name__)

_PREAD_CHUNK = 8 * 2**20
_MMAP_HASH_MAX = 4 * 2**20   # smaller cached samples are hashed through the mapping
_VERIFIED_MAX = 1_000_000    # checked samples remembered; the set starts over beyond


class CachedShards:
    """This process's cached shards for random access, and the samples checked in them.

    Args:
        ds: the dataset read.
        cache_dir: the node cache directory.
        cache_limit: the cache's bound in bytes.
        cache_shards: download a shard that is not cached yet (else only cached shards are used).
        max_open: shards kept open (mapped and pinned) at once.
    """

    def __init__(self, ds: Dataset, cache_dir: str, cache_limit: int, *, cache_shards: bool, max_open: int) -> None:
        self.ds, self.cache_dir, self.cache_limit, self.cache_shards = ds, cache_dir, cache_limit, cache_shards
        self._cache: ShardCache | None = None  # opened on first use
        self._open: LRU[int, CachedShard | LandingShard] = LRU(max_open, on_evict=lambda c: c.close())
        self._verified: set[tuple[int, int]] = set()

    def _shard_cache(self) -> ShardCache:
        if self._cache is None:
            # verify=False: every download is hashed before it is published, and a file still
            # bearing the cache's "verified" stamp is trusted; an unstamped one (changed since,
            # or stamped by nobody) has its samples checked one by one (see check()).
            self._cache = ShardCache(self.cache_dir, self.cache_limit, namespace=cache_namespace(self.ds),
                                     verify=False)
        return self._cache

    def open(self, info: ShardInfo, fetch: Callable[..., Any], rows: ShardRows | None = None,
             pos: int = 0) -> CachedShard | LandingShard | None:
        """The mapped shard, kept open with the most recently used ones.

        Args:
            info: the shard.
            fetch: the download ``ShardCache.open`` calls when ``cache_shards`` fetches it.
            rows: the shard's manifest rows: with ``cache_shards``, a shard not cached yet is
                then read while it lands (sample ``pos`` as soon as it is verified).
            pos: the sample wanted (its bytes are asked for first).

        Returns:
            The open shard if it is in the cache (or ``cache_shards`` downloads it; then maybe
            still landing, sample ``pos`` verified), else None: also when a stopped process
            holds the shard's lock (CacheLockedError, said in the log): the sample is then
            read from storage.

        Raises:
            StorageError: a ``cache_shards`` download failed.
            IntegrityError: a downloaded shard fails its checksum twice.
        """
        want = np.array([pos])
        cached = self._open.get(info.shard)
        if cached is not None:
            try:
                if not isinstance(cached, LandingShard) or cached.wait(want):
                    return cached
            except NoRoomError as exc:  # another process's download stalled: read from storage
                log.warning("%s", exc)
                return None
            self._open.pop(info.shard)  # its download's attempt ended: open it again
            cached.close()
        ref = shard_ref(info)
        # ShardCache has no "open only if present": look for the published file first. If it is
        # evicted between this check and open(), open() downloads it again (rare, and correct).
        cache = self._shard_cache()
        present = cache.contains(ref)
        if not present and not self.cache_shards:
            return None
        stream = self.cache_shards and not present and rows is not None
        if stream:
            ref = shard_ref(info, rows)
        first = int(rows.offset[pos]) if stream and rows is not None else 0
        try:
            opened = open_held(cache, ref, fetch, want, first, landing=False, stream=stream, keep_map=False).handle
        except NoRoomError as exc:  # a lock whose holder is stuck: read around the cache, as streams do
            log.warning("%s", exc)
            return None
        assert opened is not None
        self._open.put(info.shard, opened)
        return opened

    def check(self, cached: CachedShard | LandingShard, info: ShardInfo, rows: ShardRows, pos: int,
              index: int) -> None:
        """Check sample ``pos``'s bytes in ``cached`` against its checksum, once per process.

        Args:
            cached: the open shard.
            info: the shard.
            rows: its manifest rows.
            pos: the sample's position in the shard.
            index: its global index (for the message).

        Raises:
            IntegrityError: the cached bytes fail the checksum (a corrupt cache file).
        """
        if cached.verified or isinstance(cached, LandingShard) or (info.shard, pos) in self._verified:
            # The whole shard file is verified and unchanged (the cache's stamp), or the sample
            # was as it landed (open waited for that).
            return
        start, size = int(rows.offset[pos]), int(rows.size[pos])
        if size <= _MMAP_HASH_MAX:
            got = xxhash.xxh3_64_intdigest(cached.buffer()[start:start + size])
        else:  # a big sample through pread: the mapping's pages are not touched, RSS stays flat
            got = _hash_file(cached.fileno(), start, size)
        if got != int(rows.checksum[pos]):
            raise IntegrityError(f"sample {rows.key(pos)!r} (index {index}) in cached {info.path} fails its "
                                 f"checksum (corrupt cache file {cached.path})")
        if len(self._verified) > _VERIFIED_MAX:
            self._verified.clear()
        self._verified.add((info.shard, pos))

    def close(self) -> None:
        """Unpin the open shards, least recently used first, and close the cache (it opens again
        on next use; arrays already returned stay valid)."""
        for shard in self._open:  # a copy of the keys
            cached = self._open.pop(shard)
            if cached is not None:
                cached.close()
        if self._cache is not None:
            self._cache.close()
            self._cache = None


def _hash_file(fd: int, start: int, size: int) -> int:
    """xxh3-64 of a file range through ``pread`` (page cache only: RSS stays flat)."""
    h = xxhash.xxh3_64()
    buf = bytearray(min(_PREAD_CHUNK, max(size, 1)))
    view = memoryview(buf)
    done = 0
    while done < size:
        n = os.preadv(fd, [view[:min(len(buf), size - done)]], start + done)
        if n <= 0:
            break
        h.update(view[:n])
        done += n
    return h.intdigest()
