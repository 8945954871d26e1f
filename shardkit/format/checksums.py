"""Per-sample xxh3-64 hashes, whole and per block, computed in one streaming pass.

A sample's ``checksum`` covers its bytes ``[offset, offset+size)``; a partial read of a
300 MB sample cannot check it without fetching all 300 MB. So samples larger than one block
also get ``block_checksums``: the xxh3-64 of each ``BLOCK_BYTES`` block of the same bytes
(the last block may be shorter), and a reader checks only the blocks it fetched. The packer
(:mod:`shardkit.packing.writer`) and ``shardkit index`` both feed bytes through :class:`SampleHasher`
as they stream, so neither holds a sample in memory.
"""

from __future__ import annotations

import numpy as np
import xxhash

__all__ = ["BLOCK_BYTES", "BLOCK_BYTES_KEY", "SampleHasher", "bad_blocks", "block_span"]

BLOCK_BYTES = 2**20
# Parquet schema metadata key of a samples fragment: the block size its block_checksums use.
BLOCK_BYTES_KEY = b"shardkit.block_bytes"


class SampleHasher:
    """xxh3-64 of one sample's bytes, and of each block of them when it spans more than one.

    ``update`` takes the bytes in order, in pieces of any size; ``intdigest`` is the sample
    checksum, ``blocks`` the block checksums (None for a sample of one block or less, whose
    checksum already covers it). The first block's hash is the whole hash taken at the block
    boundary, so a small sample is hashed once, as before block checksums existed.

    Args:
        block_bytes: the block size.
    """

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self.whole = xxhash.xxh3_64()
        self._block: xxhash.xxh3_64 | None = None  # None: still in the first block (``whole`` is its hash)
        self._fill = 0  # bytes in the current block
        self._done: list[int] = []

    def copy(self) -> "SampleHasher":
        """An independent hasher in the same state (``shardkit index`` hashes a member that
        may or may not turn out to lie inside the sample into a copy).

        Returns:
            The copy.
        """
        twin = SampleHasher(self.block_bytes)
        twin.whole = self.whole.copy()
        twin._block = None if self._block is None else self._block.copy()
        twin._fill = self._fill
        twin._done = list(self._done)
        return twin

    def reset(self) -> None:
        """Start over, for the next sample."""
        self.whole.reset()
        self._block = None
        self._fill = 0
        self._done = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Hash the sample's next bytes.

        Args:
            data: the bytes, in order after those given before (a byte buffer).
        """
        n = len(data)
        if self._fill + n < self.block_bytes:  # the common case: the bytes stay in the current block
            self.whole.update(data)
            if self._block is not None:
                self._block.update(data)
            self._fill += n
            return
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_bytes - self._fill)
            part = view[:take]
            self.whole.update(part)
            if self._block is not None:
                self._block.update(part)
            self._fill += take
            view = view[take:]
            if self._fill == self.block_bytes:
                self._close_block()

    def _close_block(self) -> None:
        if self._block is None:
            self._done.append(self.whole.intdigest())
            self._block = xxhash.xxh3_64()
        else:
            self._done.append(self._block.intdigest())
            self._block.reset()
        self._fill = 0

    def intdigest(self) -> int:
        """The sample's checksum so far.

        Returns:
            The xxh3-64 of every byte given to :meth:`update` since the start (or the last
            :meth:`reset`).
        """
        return int(self.whole.intdigest())

    def blocks(self) -> list[int] | None:
        """The block checksums of the bytes given so far.

        Returns:
            The xxh3-64 of each ``block_bytes`` block, the last one possibly shorter, or None
            when the sample is at most one block long.
        """
        if not self._done or (len(self._done) == 1 and self._fill == 0):
            return None
        if self._fill and self._block is not None:  # a part block at the end (past the first block)
            return self._done + [self._block.intdigest()]
        return list(self._done)


def block_span(sample_offset: int, sample_size: int, start: int, end: int, block_bytes: int) -> tuple[int, int, int]:
    """The blocks a read of the byte range ``[start, end)`` of a sample must fetch to check them.

    Args:
        sample_offset: the sample's offset in the shard.
        sample_size: the sample's size.
        start: the first shard byte wanted.
        end: the shard byte after the last one wanted.
        block_bytes: the block size.

    Returns:
        ``(first block, shard byte where it starts, shard byte where the last needed block ends)``.
    """
    first = (start - sample_offset) // block_bytes
    last = -(-(end - sample_offset) // block_bytes)  # ceil
    return first, sample_offset + first * block_bytes, min(sample_offset + last * block_bytes,
                                                            sample_offset + sample_size)


def bad_blocks(data: np.ndarray, first: int, want: np.ndarray, block_bytes: int) -> list[int]:
    """The blocks of ``data`` whose xxh3-64 is not the one recorded.

    Args:
        data: a flat uint8 array of the sample's bytes from block ``first`` to a block boundary
            or the sample's end.
        first: the block ``data`` starts at.
        want: the sample's recorded block checksums.
        block_bytes: the block size.

    Returns:
        The indices (within the sample) of the bad blocks, in order.
    """
    view = data.data
    bad = []
    for k in range(-(-len(view) // block_bytes)):
        got = xxhash.xxh3_64_intdigest(view[k * block_bytes:(k + 1) * block_bytes])
        if first + k >= len(want) or got != int(want[first + k]):
            bad.append(first + k)
    return bad
