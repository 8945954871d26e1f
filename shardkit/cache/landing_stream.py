"""A shard's bytes front to back as a read-only stream, while the shard lands.

For readers that parse the tar themselves (WebDataset, through ``wds_shards``): a byte is read
once the sample holding it is verified (its xxh3-64 matched as it landed); bytes no sample
holds (the archive's end, padding between samples) once the whole shard is (its xxh3-128), when
the stream goes on from the published, pinned cache file. A stream never returns a byte the
manifest has not vouched for.
"""

from __future__ import annotations

import io
import os
from typing import Any, Callable

from shardkit.cache.cached_shard import CachedShard
from shardkit.cache.landing_shard import LandingShard
from shardkit.errors import IntegrityError

__all__ = ["LandingStream"]


class LandingStream(io.RawIOBase):
    """Shard bytes from byte 0 as they are vouched for (use through ``io.BufferedReader``).

    Args:
        shard: the shard as the cache opened it (still landing, or cached).
        reopen: opens the shard again (``ShardCache.open(ref, fetch, stream=True)``) once its
            landing is over: the published file, or the next attempt's landing.
        started: called once, when the first ``started_after`` bytes were read (or all of them).
        started_after: see ``started``.
    """

    def __init__(self, shard: CachedShard | LandingShard, reopen: Callable[[], CachedShard | LandingShard],
                 started: Callable[[], None] | None = None, started_after: int = 32 << 20) -> None:
        super().__init__()
        self._shard: CachedShard | LandingShard | None = shard
        self._reopen, self._started, self._started_after = reopen, started, started_after
        self._size = shard.ref.size
        self._pos = 0
        self._avail = 0  # bytes from _pos on known to be vouched for

    def readable(self) -> bool:
        """A stream to read.

        Returns:
            True.
        """
        return True

    def readinto(self, buf: Any) -> int:
        """Read the next bytes, waiting until they are vouched for.

        Args:
            buf: a writable buffer.

        Returns:
            Bytes read (0 at the end of the shard).

        Raises:
            IntegrityError: the cached file ends before the shard does (changed under the reader).
            Whatever opening the shard again raises (a download that failed for good).
        """
        out = memoryview(buf).cast("B")
        if self._pos >= self._size or not len(out):
            return 0
        while self._avail <= 0:
            shard = self._shard
            if shard is None:
                raise ValueError("read from a closed shard stream")
            if not isinstance(shard, LandingShard):
                self._avail = self._size - self._pos  # the whole file checked out
                break
            self._avail = shard.servable(self._pos)
            if self._avail <= 0:  # the landing is over: go on from what the cache has now
                self._shard = None
                shard.close()
                self._shard = self._reopen()
        assert self._shard is not None
        n = os.preadv(self._shard.fileno(), [out[:min(len(out), self._avail)]], self._pos)
        if n <= 0:
            raise IntegrityError(f"shard {self._shard.ref.name}: its file ends at byte {self._pos}, before "
                                 f"byte {self._size}")
        self._pos += n
        self._avail -= n
        if self._started is not None and (self._pos >= self._started_after or self._pos >= self._size):
            started, self._started = self._started, None
            started()
        return n

    def close(self) -> None:
        """Close the shard (unpin it)."""
        if self._shard is not None:
            shard, self._shard = self._shard, None
            shard.close()
        super().close()
