"""Ranged reads of part of one sample, checked against its manifest row before use.

A sample with ``block_checksums`` (written for samples larger than one block) is read in
whole blocks around the bytes asked for, and each block is checked: two rows of a 300 MB
array cost at most two blocks more than the rows. A sample without them (one block or less,
or a manifest written before the column existed) is read whole and checked against its
``checksum``. Each read that fails its check is read once more, which tells corruption in
transit (gone on the second read) from corruption at rest (an IntegrityError).
"""

from __future__ import annotations

import logging

import numpy as np
import xxhash

from shardkit.errors import IntegrityError, ManifestError
from shardkit.format.checksums import bad_blocks, block_span
from shardkit.read.rows import ShardInfo, ShardRows, block_checksums
from shardkit.storage.ranged import RangeReader, read_fully

__all__ = ["read_checked", "read_sample"]

log = logging.getLogger(__name__)


def read_sample(read: RangeReader, info: ShardInfo, rows: ShardRows, pos: int, index: int) -> np.ndarray:
    """The whole of sample ``pos``, its checksum checked (read a second time if it fails).

    Args:
        read: the shard object's reader.
        info: the shard's row of shards.parquet.
        rows: its manifest rows.
        pos: the sample's position in the shard.
        index: its global index (names it in messages).

    Returns:
        The sample's bytes.

    Raises:
        ManifestError: the manifest places the sample beyond the shard.
        IntegrityError: both reads fail the checksum (corrupt bytes on storage).
    """
    start, size = int(rows.offset[pos]), int(rows.size[pos])
    if start < 0 or start + size > info.bytes:
        raise ManifestError(f"sample {rows.key(pos)!r} (index {index}): bytes [{start}, {start + size}) lie "
                            f"beyond {info.path} ({info.bytes} bytes)")
    buf = np.empty(size, dtype=np.uint8)
    for attempt in (1, 2):
        read_fully(read, start, buf.data, info.path)
        if xxhash.xxh3_64_intdigest(buf.data) == int(rows.checksum[pos]):
            return buf
        log.warning("sample %r (index %d) in %s failed its checksum (attempt %d)", rows.key(pos), index,
                    info.path, attempt)
    raise IntegrityError(f"sample {rows.key(pos)!r} (index {index}) in {info.path} fails its checksum "
                         "(corrupt bytes on storage)")


def read_checked(read: RangeReader, info: ShardInfo, rows: ShardRows, pos: int, index: int, start: int,
                 end: int) -> tuple[np.ndarray, int]:
    """Checked bytes of sample ``pos`` covering the shard range ``[start, end)``: the blocks
    around the range, or the whole sample when it has no block checksums.

    Args:
        read: the shard object's reader.
        info: the shard's row of shards.parquet.
        rows: its manifest rows.
        pos: the sample's position in the shard.
        index: its global index (names it in messages).
        start: the first shard byte wanted (inside the sample).
        end: the shard byte after the last one wanted.

    Returns:
        (the bytes, the shard offset where they begin).

    Raises:
        ManifestError: the sample's manifest row is inconsistent (see :func:`read_sample` and
            :func:`shardkit.read.rows.block_checksums`).
        IntegrityError: both reads fail a checksum (corrupt bytes on storage).
    """
    blocks = block_checksums(info, rows, pos)
    if blocks is None:
        return read_sample(read, info, rows, pos, index), int(rows.offset[pos])
    digests, block_bytes = blocks
    first, lo, hi = block_span(int(rows.offset[pos]), int(rows.size[pos]), start, end, block_bytes)
    buf = np.empty(hi - lo, dtype=np.uint8)
    bad: list[int] = []
    for attempt in (1, 2):
        read_fully(read, lo, buf.data, info.path)
        bad = bad_blocks(buf, first, digests, block_bytes)
        if not bad:
            return buf, lo
        log.warning("sample %r (index %d) in %s: block %d failed its checksum (attempt %d)", rows.key(pos), index,
                    info.path, bad[0], attempt)
    at = int(rows.offset[pos]) + bad[0] * block_bytes
    raise IntegrityError(f"sample {rows.key(pos)!r} (index {index}) in {info.path}: block {bad[0]} (bytes "
                         f"[{at}, {min(at + block_bytes, int(rows.offset[pos]) + int(rows.size[pos]))})) fails its "
                         "checksum (corrupt bytes on storage)")
