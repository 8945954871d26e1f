"""Filling a reserved temp file with one shard's bytes from a :class:`~shardkit.storage.ranged.RangeReader`.

Three ways, each returning the file's size and the xxh3-128 of its bytes for the cache to check:

* :func:`fill_stream`: a sequential reader, front to back through a hashing sink; what landed
  before a fault stays in the file, and the next attempt resumes from its length.
* :func:`fill_map`: a parallel reader, all at once into a writable map of the file.
* :func:`fill_landing`: a parallel reader into a landing buffer (:mod:`.landing`), each part
  written to the file with ``O_DIRECT`` as it lands.

Parts of a parallel reader land out of order, so the length of a partial file means nothing:
when such a fill fails, the error is raised and the cache puts a new empty file under the name
(the reservation stays; readers of the old inode keep the samples they were told were verified).
A parallel fill may be tracked (:class:`Track`): told the bytes it lands into before the first
part, then of every range landed (:mod:`.progress` verifies samples from it as they complete).
It asks for the bytes from ``first`` on before those ahead of it: a reader's first need comes first.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Callable, Protocol

import xxhash

from shardkit.cache.files import HashingSink, ShardRef, allocate
from shardkit.cache.landing import BLOCK, DirectWriter, Landing
from shardkit.storage.ranged import PartCallback, RangeReader

__all__ = ["fill_stream", "fill_map", "fill_landing", "Track", "FIRST_GRAIN"]


class Track(Protocol):
    """What follows a parallel fill as it lands (see :class:`shardkit.cache.progress.Progress`)."""

    def __call__(self, view: memoryview) -> PartCallback:
        """The fill lands into ``view`` (shard byte 0 on); the returned callback hears of each
        range landed (also one the reader did not report, once its ``read_into`` returned)."""
        ...

    def settle(self) -> None:
        """Every part is in: put right what the tracker left for this moment (a sample to read
        again), before the fill writes or hashes its last bytes."""
        ...

    def quiesce(self) -> None:
        """The fill lets go of the bytes it landed into next: nobody may read them from now on."""
        ...

    @property
    def repaired(self) -> list[tuple[int, int]]:
        """Byte ranges put into ``view`` again after the fill reported them (refetched samples)."""
        ...

log = logging.getLogger(__name__)

# One read_into call of a sequential reader, and one write to the file: as large as the reads
# a stream over fsspec made before (each read of an s3fs file without a cache is one GET).
_STREAM_CHUNK = 8 * 2**20
# A fill asked to start at a reader's first need starts at the multiple of this before it: a
# need in the first few MiB costs no second request (a small shard stays one GET).
FIRST_GRAIN = 4 * 2**20


def fill_stream(reader: RangeReader, ref: ShardRef, fd: int, start: int,
                fetched: Callable[[int], None]) -> tuple[int, str]:
    """Bytes ``[start, ref.size)`` of the shard, front to back, appended to the temp file ``fd``.

    Args:
        reader: the shard's reader (sequential or not).
        ref: the shard.
        fd: the temp file, holding bytes ``[0, start)`` already.
        start: where this attempt starts.
        fetched: told how many bytes this attempt moved, also when it fails.

    Returns:
        (bytes in the file, xxh3-128 of them).

    Raises:
        Whatever the reader raises; the bytes that landed before stay in the file.
    """
    sink = HashingSink(fd, ref, start)
    try:
        chunk = memoryview(bytearray(min(_STREAM_CHUNK, ref.size - start)))
        while sink.pos < ref.size:
            n = reader.read_into(sink.pos, chunk[:ref.size - sink.pos])
            if n <= 0:
                break  # the object ended early: the size check says so
            sink.write(chunk[:n])
    finally:
        fetched(sink.pos - start)
    return sink.pos, sink.digest()


def _fill_all(reader: RangeReader, view: memoryview, on_part: PartCallback | None, first: int = 0,
              also: PartCallback | None = None) -> int:
    """Call ``reader.read_into`` until ``view`` is full or the object ends, from ``first``
    (rounded down to :data:`FIRST_GRAIN`) to the end, then from byte 0 to there; bytes moved.
    ``also`` hears of every range when ``read_into`` returned (the reader may not report its parts)."""
    cut = min(max(first, 0) // FIRST_GRAIN * FIRST_GRAIN, len(view))
    moved = 0
    for lo, hi in ((cut, len(view)), (0, cut)):
        pos = lo
        while pos < hi:
            n = reader.read_into(pos, view[pos:hi], on_part)
            if n <= 0:
                break
            if also is not None:
                also(pos, pos + n)
            pos += n
        moved += pos - lo
    return moved


def fill_map(reader: RangeReader, ref: ShardRef, fd: int, fetched: Callable[[int], None],
             track: Track | None = None, first: int = 0) -> tuple[int, str]:
    """The whole shard into a writable map of the temp file ``fd``.

    Args:
        reader: the shard's reader (parallel: it gets the whole shard at once).
        ref: the shard.
        fd: the temp file (its blocks reserved).
        fetched: told how many bytes moved, once all of them did.
        track: follows the fill as it lands, if given.
        first: the shard byte asked for first (a reader's first need).

    Returns:
        (size of the file, xxh3-128 of the whole file).

    Raises:
        OSError: the disk has no room for the shard (ENOSPC, EDQUOT): nothing was written.
        Whatever the reader (or ``track``) raises; parts landed out of order, so nothing in the
        file can be trusted (the caller puts a new empty file under its name).
    """
    # Full size at once, every block allocated for real before the map is written: a page
    # whose block the disk cannot give is SIGBUS in a map, not an error (preallocate may not
    # have reserved them). Readers of a shard still landing map it too: it never shrinks.
    allocate(fd, ref.size)
    mm = mmap.mmap(fd, ref.size, access=mmap.ACCESS_WRITE) if ref.size else None
    view = memoryview(mm) if mm is not None else memoryview(bytearray(0))
    try:
        on_part = track(view) if track is not None else None
        moved = _fill_all(reader, view, on_part, first, on_part)
        if track is not None:
            track.settle()
        fetched(moved)
        # One pass over the map while its bytes are still in the page cache.
        digest = xxhash.xxh3_128_hexdigest(mm if mm is not None else b"")
        return os.fstat(fd).st_size, digest
    finally:
        if track is not None:
            track.quiesce()
        try:
            view.release()
            if mm is not None:
                mm.close()
        except BufferError:  # the reader kept a slice: unmapped when that is dropped
            log.debug("cache: shard %s: reader still holds a view of the temp file", ref.name)


def fill_landing(reader: RangeReader, ref: ShardRef, fd: int, tmp: str, buf: Landing,
                 fetched: Callable[[int], None], track: Track | None = None, first: int = 0) -> tuple[int, str]:
    """The whole shard into the landing buffer ``buf``, written to the temp file as it lands.

    Each part the reader reports is written (``O_DIRECT``) while others land; what it did not
    report is written after.

    Args:
        reader: the shard's reader (parallel: it gets the whole shard at once).
        ref: the shard.
        fd: the temp file (its blocks reserved).
        tmp: its path (opened again for ``O_DIRECT`` writes).
        buf: a pinned landing buffer of at least ``ref.size`` bytes (the caller unpins it).
        fetched: told how many bytes moved, once all of them did.
        track: follows the fill as it lands, if given (told of each part once it is written).
        first: the shard byte asked for first (a reader's first need).

    Returns:
        (size of the file, xxh3-128 of the buffer's bytes).

    Raises:
        Whatever the reader, ``track`` or a write raises, as in :func:`fill_map`.
    """
    allocate(fd, ref.size)  # the disk says now if it has no room, not at a part's write
    writer = DirectWriter(tmp, buf)
    view = memoryview(buf.map)[:ref.size]
    try:
        landed = track(view) if track is not None else None

        def on_part(lo: int, hi: int) -> None:
            writer.write(lo, hi)
            if landed is not None:
                landed(lo, hi)

        moved = _fill_all(reader, view, on_part, first, landed)
        if track is not None:
            track.settle()
        if writer.written < ref.size:  # parts the reader did not report (or none)
            writer.write(0, ref.size)
        for lo, hi in (track.repaired if track is not None else ()):  # all parts are in: whole blocks again
            writer.write(lo // BLOCK * BLOCK, hi)
        writer.finish(ref.size)
    except BaseException:
        writer.close()
        raise
    fetched(moved)
    return os.fstat(fd).st_size, xxhash.xxh3_128_hexdigest(view)
