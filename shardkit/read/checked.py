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

from shardkit.format.checksums import bad_blocks, block_span
from shardkit.errors import IntegrityError, ManifestError
from shardkit.read.dataset import ShardInfo, ShardRows
from shardkit.storage.ranged import RangeReader, read_fully

log = logging.getLogger(__name__)


def block_checksums(info: ShardInfo, rows: ShardRows, pos: int) -> tuple[np.ndarray, int] | None:
    """(block checksums, block size) of sample ``pos``, or None when it has none."""
    digests = rows.block_checksums(pos)
    if digests is None:
        return None
    block_bytes = rows.block_bytes
    if block_bytes is None:
        raise ManifestError(f"manifest rows of shard {info.shard} ({info.path}) have block_checksums but no "
                            "shardkit.block_bytes in their schema metadata")
    size = int(rows.size[pos])
    if len(digests) != -(-size // block_bytes):
        raise ManifestError(f"sample {rows.key(pos)!r} in {info.path}: {len(digests)} block checksums for "
                            f"{size} bytes in blocks of {block_bytes}")
    return digests, block_bytes


def read_sample(read: RangeReader, info: ShardInfo, rows: ShardRows, pos: int, index: int) -> np.ndarray:
    """The whole of sample ``pos``, its checksum checked."""
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
    """Checked bytes of sample ``pos`` covering the shard range ``[start, end)``, and the shard
    offset where they begin: the blocks around the range, or the whole sample."""
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
