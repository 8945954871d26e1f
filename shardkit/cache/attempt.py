"""One attempt of a shard download: fill the temp file, check it whole, publish it.

A parallel attempt (and any second attempt) fills a new inode under the temp name: readers of
a shard still landing (:mod:`.streamed`) may hold the last one open and mapped, so a temp file
is never cut or written over; what it held for them stays as it was.
"""

from __future__ import annotations

import os
from typing import Callable

from shardkit.cache.files import ShardRef, stamp_verified
from shardkit.cache.fill import fill_landing, fill_map, fill_stream
from shardkit.cache.landing import LANDING
from shardkit.cache.layout import CacheDir
from shardkit.cache.streamed import Streams
from shardkit.errors import IntegrityError
from shardkit.storage.ranged import RangeReader

__all__ = ["attempt"]


def attempt(where: CacheDir, streams: Streams, reader: RangeReader, ref: ShardRef, file: str, tmp: str, start: int,
            landing: bool, first: int, fetched: Callable[[int], None], last: bool) -> tuple[str, int, str]:
    """Fill ``tmp`` (``start`` bytes in it) from ``reader``; publish it if it matches ``ref``.

    Args:
        where: the cache directory (its global lock guards the rename).
        streams: follows the attempt for readers of the shard while it lands.
        reader: the attempt's reader.
        ref: the shard.
        file: the shard's file name.
        tmp: the temp file (this process's reservation).
        start: bytes already in it (a sequential reader resumes from there); -1: start
            over in a new file (a second attempt).
        landing: a parallel reader may land the shard in a landing buffer.
        first: the shard byte a reader needs first.
        fetched: told how many bytes moved.
        last: no attempt follows this one (its readers learn the error if it fails).

    Returns:
        (``"landed"`` when published from a landing buffer, ``"published"``, or ``""`` when the
        file does not match; bytes in the file; their xxh3-128).

    Raises:
        Whatever the reader or the fill raises (a parallel attempt's file is emptied first).
    """
    final = where.final(file)
    how = "published"
    if start < 0 or (reader.parallel and start > 0):
        # Parts land out of order, so a partial file is no prefix to resume from; and a reader
        # of the attempt before (or of the download a dead process left) may hold it. An empty
        # file (just reserved) has neither: it is filled as it is.
        where.fresh_temp(tmp, ref.size)
    fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
    buf = LANDING.take(ref.size) if reader.parallel and landing else None  # pinned until published
    track = streams.tracker(ref, file, tmp, fd, buf, reader)
    try:
        try:
            if buf is not None:
                pos, digest = fill_landing(reader, ref, fd, tmp, buf, fetched, track, first)
            elif reader.parallel:
                pos, digest = fill_map(reader, ref, fd, fetched, track, first)
            else:
                pos, digest = fill_stream(reader, ref, fd, max(start, 0), fetched)
        except BaseException as exc:
            if track is not None:
                track.end(False, exc)
            if reader.parallel:  # parts landed out of order: nothing here can be trusted
                where.fresh_temp(tmp, ref.size, quiet=True)
            raise
        if pos == ref.size and digest == ref.checksum.lower():
            stamp_verified(fd, ref.checksum)
            with where.locked():
                os.replace(tmp, final)
            if buf is not None:
                LANDING.publish(buf, final, os.fstat(fd))  # unpins it
                buf, how = None, "landed"
            if track is not None:
                track.end(True)  # after the rename: its readers open the published file next
            return how, pos, digest
        if track is not None:  # a new attempt follows, or the caller raises this
            track.end(False, IntegrityError(f"shard {ref.name}: download does not match the manifest (size "
                                            f"{ref.size}, xxh3 {ref.checksum}) twice; last got {pos} bytes with "
                                            f"xxh3 {digest}") if last else None)
        return "", pos, digest
    finally:
        if buf is not None:
            LANDING.release(buf)
        os.close(fd)
