"""Landing buffers: where a cold shard's ranged GETs land before the cache file is written.

A cold cache fill through a map of the new file makes the kernel hand out a fresh page-cache
page for every 4 KiB, and memory a VM guest has not touched lately can come slowly
(``benchmarks/bench_fill.py``): client CPU the GETs already need. So the fill of a reader
that only copies out of its shards, alone in its process (``num_workers=0``), goes instead:

1. ranged GETs into a landing buffer: anonymous memory this process reuses shard after shard;
2. each part written to the temp file with ``O_DIRECT`` as it lands (the kernel moves it to
   the disk from the buffer; no page-cache page is made), the hash over the buffer, the rename;
3. the buffer stays attached to the published file (*hot*), so this process's first reads of
   the shard copy from memory instead of reading the file back from disk.

Cold epochs fill faster this way than through maps (``benchmarks/bench_cold.py``, figures in
benchmarks/RESULTS.md). The process's first landing epoch also touches its buffers for the
first time.

The file still holds every byte, verified: other processes, later epochs and a restart read
it as before. Not in the page cache after the fill is the point for a dataset larger than
memory (the cache file would be evicted before its next epoch anyway); a dataset that fits
comes into the page cache on its first warm read. Zero-copy streams and WebDataset URLs read
the file itself and keep the fill through a map.

Bounded per process by ``SHARDKIT_LANDING_BYTES`` (default 512 MiB, ``0`` = off). When the
buffers are all in use, or a shard is larger than the budget, the fill goes through a map as
before. A file system without ``O_DIRECT`` (tmpfs) gets ordinary writes from the buffer.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
from collections import OrderedDict

from shardkit.cache.files import FileId
from shardkit.config import landing_budget

__all__ = ["Landing", "LandingPool", "LANDING", "DirectWriter", "BLOCK"]

log = logging.getLogger(__name__)

BLOCK = 4096  # O_DIRECT alignment of offsets, lengths and buffers (covers 512 B and 4 KiB sectors)
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 off Linux: ordinary writes
_GRAIN = 2**20  # buffer sizes round up to this, so shards of nearly equal size share buffers


class Landing:
    """One reusable page-aligned buffer of ``capacity`` bytes (a multiple of :data:`BLOCK`).

    Args:
        capacity: its bytes (anonymous memory, mapped now, touched by the first fill).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.map = mmap.mmap(-1, capacity)
        self.size = 0  # bytes of the shard it holds
        self.pins = 0  # a fill writing it, or open shards reading it
        self.hot: tuple[str, FileId] | None = None  # the published file it holds, if any
        self.opened = False  # a reader has had the hot copy (a fill ahead of the reader: not yet)

    def view(self) -> memoryview:
        """The shard's bytes.

        Returns:
            A view of the first ``size`` bytes.
        """
        return memoryview(self.map)[:self.size]


class LandingPool:
    """The process's landing buffers: free ones are reused (smallest that fits), hot ones are
    recycled least recently used first, and none is recycled while pinned."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._all: list[Landing] = []
        # Not util.lru.LRU: nothing here is dropped by count or size; _pick recycles buffers by
        # pins and reads, in this recency order.
        self._hot: OrderedDict[str, Landing] = OrderedDict()  # path -> buffer, least recently used first
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # A forked child must not reuse buffers its parent may still be filling or reading.
        self._mu = threading.Lock()
        self._all, self._hot = [], OrderedDict()

    def take(self, size: int) -> Landing | None:
        """A pinned buffer for a ``size``-byte shard.

        Args:
            size: the shard's bytes.

        Returns:
            The buffer (pinned: :meth:`publish` or :meth:`release` it), or None when the shard
            is over the budget or every buffer the budget allows is in use.

        Raises:
            ConfigError: ``SHARDKIT_LANDING_BYTES`` is not a size.
        """
        need = -(-max(size, 1) // _GRAIN) * _GRAIN
        budget = landing_budget()
        if need > budget:
            return None
        with self._mu:
            buf = self._pick(need, budget)
            if buf is None:
                return None
            if buf.hot is not None:
                self._hot.pop(buf.hot[0], None)
                buf.hot = None
            buf.size, buf.pins, buf.opened = size, 1, False
            return buf

    def _pick(self, need: int, budget: int) -> Landing | None:
        """In order: an idle buffer that holds nothing, the idle hot buffer a reader has had
        that was used longest ago, new memory within the budget, an idle hot buffer no reader
        has had yet, new memory after freeing idle buffers too small to reuse.

        Reuse comes before new memory: a process then holds only as many buffers as it has
        downloads in flight, shards open and shards landed ahead of the reader, and memory never
        touched before is what a landing fill avoids. But a shard landed ahead has not been read
        yet: recycling its buffer would send its reader to the disk (a file written with
        ``O_DIRECT`` is not in the page cache), which costs more than new memory; a process's
        first epoch used to do that for many of its shards.
        """
        idle = [b for b in self._all if b.pins == 0]
        empty = [b for b in idle if b.hot is None and b.capacity >= need]
        if empty:
            return min(empty, key=lambda b: b.capacity)
        hot = [b for b in self._hot.values() if b.pins == 0 and b.capacity >= need]  # LRU first
        for b in hot:
            if b.opened:
                return b
        held = sum(b.capacity for b in self._all)
        if held + need <= budget:
            return self._new(need)
        if hot:
            return hot[0]
        if held - sum(b.capacity for b in idle) + need > budget:
            return None  # even with every idle buffer freed
        for b in sorted(idle, key=lambda b: b.capacity):
            if held + need <= budget:
                break
            self._drop(b)
            held -= b.capacity
        return self._new(need)

    def _new(self, capacity: int) -> Landing:
        buf = Landing(capacity)
        self._all.append(buf)
        return buf

    def _drop(self, buf: Landing) -> None:
        self._all.remove(buf)
        if buf.hot is not None:
            self._hot.pop(buf.hot[0], None)
        try:
            buf.map.close()
        except BufferError:  # a view of it is still alive somewhere: unmapped when that goes
            pass

    def publish(self, buf: Landing, path: str, st: os.stat_result) -> None:
        """``buf`` now holds the verified file ``path``: unpin it, and let :meth:`hot` hand it
        to readers until it is recycled.

        Args:
            buf: the buffer a fill pinned.
            path: the published cache file.
            st: its stat (a later change of the file makes the buffer stale).
        """
        with self._mu:
            old = self._hot.pop(path, None)
            if old is not None and old is not buf:
                old.hot = None
            buf.hot = (path, FileId.of(st))
            self._hot[path] = buf
            buf.pins -= 1

    def hot(self, path: str, st: os.stat_result) -> Landing | None:
        """The buffer holding the file ``path`` exactly as ``st`` describes it.

        Args:
            path: a cache file.
            st: its stat now.

        Returns:
            The buffer, pinned for the caller (:meth:`release` it), or None.
        """
        with self._mu:
            buf = self._hot.get(path)
            if buf is None or buf.hot is None or buf.hot[1] != FileId.of(st):
                return None
            self._hot.move_to_end(path)
            buf.pins += 1
            buf.opened = True
            return buf

    def pin(self, buf: Landing) -> None:
        """Pin a buffer a fill holds pinned, for a reader of the shard still landing in it.

        Args:
            buf: the buffer (:meth:`release` it when done).
        """
        with self._mu:
            buf.pins += 1

    def release(self, buf: Landing) -> None:
        """Unpin a buffer (a fill that failed, or a reader done with it).

        Args:
            buf: the buffer.
        """
        with self._mu:
            buf.pins -= 1

    def forget(self, path: str) -> None:
        """Forget the buffer of a file that is going away: it holds nothing any more.

        Args:
            path: the cache file.
        """
        with self._mu:
            buf = self._hot.pop(path, None)
            if buf is not None:
                buf.hot = None

    def held_bytes(self) -> int:
        """Bytes of buffer memory this process holds.

        Returns:
            The buffers' capacities, summed.
        """
        with self._mu:
            return sum(b.capacity for b in self._all)

    def clear(self) -> None:
        """Free every buffer that is not pinned (tests; a process done streaming)."""
        with self._mu:
            for b in [b for b in self._all if b.pins == 0]:
                self._drop(b)


LANDING = LandingPool()
"""This process's landing buffers."""


class DirectWriter:
    """Writes byte ranges of a landing buffer to the same offsets of a file, with ``O_DIRECT``
    where the file system takes it (ordinary ``pwrite`` otherwise). Thread-safe: ranged GET
    threads write their parts as they land. Offsets must be multiples of :data:`BLOCK`; a
    range may end anywhere (the write rounds up into the buffer's slack, :meth:`finish` cuts
    the file back to ``size``).

    Args:
        path: the temp file (opened again here, for writing).
        buf: the landing buffer the bytes are in.
    """

    def __init__(self, path: str, buf: Landing) -> None:
        self.buf, self.path = buf, path
        self._mu = threading.Lock()
        self._written = 0
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | _O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        self.direct = bool(fcntl.fcntl(self._fd, fcntl.F_GETFL) & _O_DIRECT)

    def write(self, lo: int, hi: int) -> None:
        """Write buffer bytes ``[lo, hi)`` to the file at ``lo`` (a :data:`~shardkit.storage.ranged.PartCallback`).

        Args:
            lo: first byte, a multiple of :data:`BLOCK`.
            hi: the byte after the last.

        Raises:
            OSError: the write failed (ENOSPC...), other than a refused ``O_DIRECT`` alignment.
        """
        if hi <= lo:
            return
        end = min(-(-hi // BLOCK) * BLOCK, self.buf.capacity) if self.direct else hi
        view = memoryview(self.buf.map)[lo:end]
        try:
            self._pwrite_all(view, lo)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
            self._go_buffered()  # alignment this device does not take: write through the page cache
            self._pwrite_all(memoryview(self.buf.map)[lo:hi], lo)
        with self._mu:
            self._written += hi - lo

    def _go_buffered(self) -> None:
        with self._mu:
            if self.direct:
                flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
                self.direct = False
                log.info("landing: %s does not take O_DIRECT writes; writing through the page cache", self.path)

    def _pwrite_all(self, view: memoryview, offset: int) -> None:
        while view.nbytes:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    @property
    def written(self) -> int:
        """Bytes written so far."""
        with self._mu:
            return self._written

    def finish(self, size: int) -> None:
        """Cut the file to its size (the last block was written whole) and close it.

        Args:
            size: the shard's bytes.
        """
        try:
            os.ftruncate(self._fd, size)
        finally:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Close the file without cutting it (a fill that failed)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
