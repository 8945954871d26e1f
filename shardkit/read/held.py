"""What a reader holds of a shard: a pinned file of the node cache, or bytes read into memory."""

from __future__ import annotations

import mmap

import numpy as np

from shardkit.cache.shard_cache import CachedShard, LandingShard, ReaderFor, ShardCache, ShardRef

__all__ = ["Held", "open_held", "STREAM_OPENS"]

# Opens of a shard still landing before a reader settles for the ordinary open (waiting for the
# whole shard): each ends when the download's attempt ends before the samples asked for were
# verified (published: the next open is a hit; failed: a new attempt follows).
STREAM_OPENS = 4


class Held:
    """Bytes of one shard held open for the reader: ``view`` starts at shard byte ``base``.

    A cached shard (``handle``) is mapped only when ``view`` or ``array`` is first used: raw
    batches copy its members with ``os.preadv`` from ``fd`` instead, because faulting
    page-cache pages into a map costs more than copying them (see benchmarks/RESULTS.md), and
    every fresh DataLoader worker would map them again.

    A shard still landing (``handle`` a :class:`LandingShard`) holds only the samples its
    reader waited for: :attr:`landing` is set, and each new need is waited for (``ShardSource.get``).

    Args:
        base: the shard byte ``view`` starts at.
        end: the shard byte after the last one held.
        handle: the cached shard (pinned until :meth:`close`), when the bytes are in the cache,
            or the shard still landing.
        data: the bytes in memory otherwise: a segment read without a cache, or a shard read
            around a cache that had no room.
        keep_map: map ``handle``'s file through the process's kept maps, which outlive this
            object (zero-copy reads across epochs).
    """

    def __init__(self, base: int, end: int, *, handle: CachedShard | LandingShard | None = None,
                 data: bytes | bytearray | memoryview | None = None, keep_map: bool = False) -> None:
        self.base, self.end = base, end
        self.handle = handle
        self.keep_map = keep_map  # map the cached file through the process's kept maps
        self._view: memoryview | None = memoryview(data) if data is not None else None
        self._array: np.ndarray | None = None
        self.users = 0  # batch copies in flight in other threads (rawbatch.copy_into)

    @property
    def landing(self) -> LandingShard | None:
        """The shard still landing these bytes come from, if they do (only waited-for samples are valid)."""
        return self.handle if isinstance(self.handle, LandingShard) else None

    @property
    def view(self) -> memoryview:
        """The bytes held, from shard byte ``base`` (a cached shard is mapped on first use)."""
        if self._view is None:
            assert self.handle is not None
            self._view = self.handle.buffer(keep=self.keep_map)
        return self._view

    @property
    def mapped(self) -> object:
        """What owns the pages ``view`` shows: the same object for every Held over one kept map."""
        owner = self.view.obj
        return owner if isinstance(owner, mmap.mmap) else self

    @property
    def array(self) -> np.ndarray:
        """uint8 over the same bytes as ``view`` (for vectorised slicing)."""
        if self._array is None:
            view = self.view
            self._array = np.frombuffer(view, np.uint8) if len(view) else np.zeros(0, np.uint8)
        return self._array

    @property
    def hot(self) -> np.ndarray | None:
        """The shard's bytes in this process's landing buffer (from shard byte 0), if it still
        holds them: copy from here instead of reading the file back. Never hand out views of it."""
        hot = self.handle.hot if self.handle is not None else None
        return np.frombuffer(hot, np.uint8) if hot is not None and self.base == 0 else None

    @property
    def fd(self) -> int:
        """The cached file to ``preadv`` from, or -1 when the bytes are in memory."""
        return self.handle.fileno() if self.handle is not None else -1

    def close(self) -> None:
        """Unmap and unpin. Call only when no copy from it is in flight (``users == 0``)."""
        self._array = None  # drop our export of the map first, so the handle can unmap it
        self._view = None
        if self.handle is not None:
            self.handle.close()


def open_held(cache: ShardCache, ref: ShardRef, fetch: ReaderFor, positions: np.ndarray, first: int, *,
              landing: bool, stream: bool, keep_map: bool, join_below: float = 1.0) -> Held:
    """Shard ``ref`` from the node cache: the verified file, or with ``stream`` (and ``ref``'s
    samples) the shard while it lands, once the samples ``positions`` are verified.

    Args:
        cache: the node cache.
        ref: the shard.
        fetch: gives the reader a download reads the shard with.
        positions: the samples the caller reads next.
        first: the shard byte it needs first (a download it starts asks for it first).
        landing: the caller only copies out of the shard (see ``ShardCache.open``).
        stream: read the shard as it lands.
        keep_map: map a cached file through the process's kept maps.
        join_below: see ``ShardCache.open``.

    Returns:
        The bytes held (the shard still landing: only ``positions`` and the samples waited for
        later may be read).

    Raises:
        NoRoomError: the cache has no room, or a download another process runs stalled: read
            the shard around the cache.
        As ``ShardCache.open`` and ``LandingShard.wait``.
    """
    for tries in range(STREAM_OPENS + 1):
        handle = cache.open(ref, fetch, landing=landing, stream=stream and tries < STREAM_OPENS, first=first,
                            join_below=join_below)
        if not isinstance(handle, LandingShard):
            return Held(0, handle.ref.size, handle=handle, keep_map=keep_map)
        if handle.hot is not None and not landing:
            # This process's download lands in a buffer and writes the file behind it (a
            # sample read again reaches the file last): only a caller copying from the buffer
            # may read the shard while it lands; views of the file wait for the published shard.
            handle.close()
            stream = False
            continue
        try:
            if handle.wait(positions):
                return Held(0, handle.ref.size, handle=handle)
        except BaseException:
            handle.close()
            raise
        handle.close()  # the attempt ended first: published (the next open is a hit), or failed
    raise AssertionError("unreachable")  # the last try is the ordinary open
