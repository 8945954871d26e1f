"""Filling a reserved temp file with one shard's bytes from a :class:`~shardkit.storage.ranged.RangeReader`.

Three ways, each returning the file's size and the xxh3-128 of its bytes for the cache to check:

* :func:`fill_stream`: a sequential reader, front to back through a hashing sink; what landed
  before a fault stays in the file, and the next attempt resumes from its length.
* :func:`fill_map`: a parallel reader, all at once into a writable map of the file.
* :func:`fill_landing`: a parallel reader into a landing buffer (:mod:`.landing`), each part
  written to the file with ``O_DIRECT`` as it lands.

Parts of a parallel reader land out of order, so the length of a partial file means nothing:
when such a fill fails its file is emptied (the reservation stays) and the error is raised.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Callable

import xxhash

from shardkit.cache.files import HashingSink, ShardRef, allocate
from shardkit.cache.landing import DirectWriter, Landing
from shardkit.storage.ranged import PartCallback, RangeReader

__all__ = ["fill_stream", "fill_map", "fill_landing"]

log = logging.getLogger(__name__)

# One read_into call of a sequential reader, and one write to the file: as large as the reads
# a stream over fsspec made before (each read of an s3fs file without a cache is one GET).
_STREAM_CHUNK = 8 * 2**20


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


def _fill_all(reader: RangeReader, view: memoryview, on_part: PartCallback | None) -> int:
    """Call ``reader.read_into`` from byte 0 until ``view`` is full or the object ends; bytes moved."""
    pos = 0
    while pos < len(view):
        n = reader.read_into(pos, view[pos:], on_part)
        if n <= 0:
            break
        pos += n
    return pos


def fill_map(reader: RangeReader, ref: ShardRef, fd: int, fetched: Callable[[int], None]) -> tuple[int, str]:
    """The whole shard from byte 0 into a writable map of the temp file ``fd``.

    Args:
        reader: the shard's reader (parallel: it gets the whole shard at once).
        ref: the shard.
        fd: the temp file (its blocks reserved).
        fetched: told how many bytes moved, once all of them did.

    Returns:
        (size of the file, xxh3-128 of the whole file).

    Raises:
        OSError: the disk has no room for the shard (ENOSPC, EDQUOT): nothing was written.
        Whatever the reader raises; the file is emptied first (its name keeps the reservation),
        so whoever tries next starts from 0.
    """
    try:
        # Full size at once, every block allocated for real before the map is written: a
        # page whose block the disk cannot give is SIGBUS in a map, not an error (preallocate
        # may not have reserved them, and a failed fill truncated them away).
        allocate(fd, ref.size)
    except OSError:
        os.ftruncate(fd, 0)
        raise
    mm = mmap.mmap(fd, ref.size, access=mmap.ACCESS_WRITE) if ref.size else None
    view = memoryview(mm) if mm is not None else memoryview(bytearray(0))
    try:
        try:
            moved = _fill_all(reader, view, None)
        except BaseException:
            os.ftruncate(fd, 0)  # parts landed out of order: nothing here can be trusted
            raise
        fetched(moved)
        # One pass over the map while its bytes are still in the page cache.
        digest = xxhash.xxh3_128_hexdigest(mm if mm is not None else b"")
        return os.fstat(fd).st_size, digest
    finally:
        try:
            view.release()
            if mm is not None:
                mm.close()
        except BufferError:  # the reader kept a slice: unmapped when that is dropped
            log.debug("cache: shard %s: reader still holds a view of the temp file", ref.name)


def fill_landing(reader: RangeReader, ref: ShardRef, fd: int, tmp: str, buf: Landing,
                 fetched: Callable[[int], None]) -> tuple[int, str]:
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

    Returns:
        (size of the file, xxh3-128 of the buffer's bytes).

    Raises:
        Whatever the reader or a write raises; the file is emptied first, as in :func:`fill_map`.
    """
    try:
        allocate(fd, ref.size)  # the disk says now if it has no room, not at a part's write
    except OSError:
        os.ftruncate(fd, 0)
        raise
    writer = DirectWriter(tmp, buf)
    view = memoryview(buf.map)[:ref.size]
    try:
        moved = _fill_all(reader, view, writer.write)
        if writer.written < ref.size:  # parts the reader did not report (or none)
            writer.write(0, ref.size)
        writer.finish(ref.size)
    except BaseException:
        writer.close()
        os.ftruncate(fd, 0)  # parts landed out of order: nothing here can be trusted
        raise
    fetched(moved)
    return os.fstat(fd).st_size, xxhash.xxh3_128_hexdigest(view)
