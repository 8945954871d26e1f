"""The exact sample order of one epoch, ``G``: a pure function of (shard sizes, epoch, seed), the
same in every rank and DataLoader worker (see :mod:`shardkit.read.partition` for how G is split
over them, and for the coordinate systems: global sample index, G position).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from shardkit.config import int_arg
from shardkit.errors import ConfigError

__all__ = ["DEFAULT_BLOCK_SHARDS", "EpochOrder"]

IntArray = NDArray[np.int64]

DEFAULT_BLOCK_SHARDS = 4  # shards per shuffle block (the shuffle buffer width) unless a reader says
# Domain tags keep the shard permutation's random stream apart from the blocks' streams.
_SHARD_TAG = 0
_BLOCK_TAG = 1


def _permutation(seed: int, key: tuple[int, ...], n: int) -> IntArray:
    # Generator.permutation's algorithm may change between numpy releases, which would
    # silently change G under a resumed job; the raw PCG64 stream is guaranteed stable, so
    # the permutation is the stable argsort of raw 64-bit draws.
    bits = np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key))
    draws = bits.random_raw(n)
    return np.argsort(draws, kind="stable").astype(np.int64, copy=False)


class EpochOrder:
    """The sample sequence G of one epoch, independent of ranks and workers.

    With ``shuffle``, shards are permuted (seeded by ``(seed, epoch)``), the permuted list is
    cut into blocks of ``block_shards`` shards and the samples of each block are permuted
    (seeded by ``(seed, epoch, block)``). A reader therefore needs the shards of one block at
    a time: a bounded shuffle buffer. Without ``shuffle``, G is the global order.

    Nothing of size N is stored: only per-shard arrays and the last block generated.

    Args:
        shard_sizes: Samples per shard, shard ids ``0..S-1``; zeros are allowed.
        epoch: Epoch number, ``0 <= epoch < 2**32``.
        seed: Shuffle seed, ``0 <= seed < 2**64``.
        shuffle: Whether to shuffle.
        block_shards: Shards per shuffle block (the shuffle buffer width).

    Raises:
        ConfigError: An argument is out of range or a size is negative.
    """

    __slots__ = ("_block_offsets", "_cache", "_offsets", "_shard_order", "_sizes",
                 "block_shards", "epoch", "seed", "shuffle")

    def __init__(self, shard_sizes: ArrayLike, epoch: int = 0, seed: int = 0,
                 shuffle: bool = True, block_shards: int = DEFAULT_BLOCK_SHARDS) -> None:
        raw = np.asarray(shard_sizes)
        if raw.ndim != 1 or (raw.size and raw.dtype.kind not in "iu"):
            raise ConfigError("shard_sizes must be a 1-D sequence of integers")
        sizes = raw.astype(np.int64)
        if sizes.size and sizes.min() < 0:
            bad = int(np.flatnonzero(sizes < 0)[0])
            raise ConfigError(f"shard_sizes[{bad}] is negative ({int(sizes[bad])})")
        self.epoch = int_arg("epoch", epoch, 0, 2**32 - 1)
        self.seed = int_arg("seed", seed, 0, 2**64 - 1)
        self.shuffle = bool(shuffle)
        self.block_shards = int_arg("block_shards", block_shards, 1)
        sizes.setflags(write=False)
        self._sizes = sizes
        self._offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        n_shards = sizes.size
        if self.shuffle:
            self._shard_order = _permutation(self.seed, (self.epoch, _SHARD_TAG), n_shards)
        else:
            self._shard_order = np.arange(n_shards, dtype=np.int64)
        # Block b holds shard_order[b*B:(b+1)*B]; its G positions are block_offsets[b:b+2].
        block_sizes = np.add.reduceat(sizes[self._shard_order], np.arange(
            0, n_shards, self.block_shards)) if n_shards else np.zeros(0, np.int64)
        self._block_offsets = np.concatenate(([0], np.cumsum(block_sizes))).astype(np.int64)
        self._cache: tuple[int, IntArray] | None = None

    def __reduce__(self) -> tuple[type[EpochOrder], tuple[object, ...]]:
        # Rebuild in the receiving process (DataLoader worker) instead of shipping the cache.
        return (EpochOrder, (self._sizes, self.epoch, self.seed, self.shuffle,
                             self.block_shards))

    def __repr__(self) -> str:
        return (f"EpochOrder(num_samples={len(self)}, num_shards={self.num_shards}, "
                f"epoch={self.epoch}, seed={self.seed}, shuffle={self.shuffle}, "
                f"block_shards={self.block_shards})")

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def num_shards(self) -> int:
        """Number of shards S."""
        return int(self._sizes.size)

    @property
    def shard_sizes(self) -> IntArray:
        """Samples per shard (read-only)."""
        return self._sizes

    @property
    def first_sample(self) -> IntArray:
        """Global index of each shard's first sample (length S)."""
        return self._offsets[:-1]

    @property
    def shard_order(self) -> IntArray:
        """Shard ids in the order their blocks appear in G."""
        return self._shard_order

    @property
    def block_offsets(self) -> IntArray:
        """G positions where each block starts, plus N at the end (length blocks + 1)."""
        return self._block_offsets

    def block(self, b: int) -> IntArray:
        """Shard ids of block ``b`` (the shards whose samples fill ``block_offsets[b:b+2]``).

        Args:
            b: the block number, ``0 <= b < len(block_offsets) - 1`` (not checked).

        Returns:
            The block's shard ids, in the permuted order (a view: do not write it).
        """
        return self._shard_order[b * self.block_shards:(b + 1) * self.block_shards]

    def _block_sequence(self, b: int) -> IntArray:
        cached = self._cache
        if cached is not None and cached[0] == b:
            return cached[1]
        shards = self.block(b)
        sizes = self._sizes[shards]
        local_start = np.cumsum(sizes) - sizes
        seq = (np.arange(int(sizes.sum()), dtype=np.int64)
               + np.repeat(self._offsets[shards] - local_start, sizes))
        if self.shuffle:
            seq = seq[_permutation(self.seed, (self.epoch, _BLOCK_TAG, b), seq.size)]
        seq.setflags(write=False)
        # One block is the shuffle buffer the reader holds anyway; keeping it makes
        # sequential scans (and pieces that cut a block) generate each block once.
        self._cache = (b, seq)
        return seq

    def indices(self, start: int, stop: int) -> IntArray:
        """Global sample indices ``G[start:stop]``, generating only the blocks it overlaps.

        Args:
            start: the first G position.
            stop: the G position after the last one.

        Returns:
            The global sample indices, ``stop - start`` of them.

        Raises:
            ConfigError: ``start`` or ``stop`` is no integer, or not
                ``0 <= start <= stop <= len(self)``.
        """
        start = int_arg("start", start, 0, len(self))
        stop = int_arg("stop", stop, start, len(self))
        if not self.shuffle:
            return np.arange(start, stop, dtype=np.int64)
        out = np.empty(stop - start, dtype=np.int64)
        offsets = self._block_offsets
        b = int(np.searchsorted(offsets, start, side="right")) - 1
        pos = start
        while pos < stop:
            lo, hi = int(offsets[b]), int(offsets[b + 1])
            if hi > pos:  # empty blocks are skipped
                end = min(hi, stop)
                out[pos - start:end - start] = self._block_sequence(b)[pos - lo:end - lo]
                pos = end
            b += 1
        return out

    def take(self, positions: ArrayLike) -> IntArray:
        """Global sample indices ``G[positions]`` for any array of G positions.

        Each block touched is generated once per call, so scattered positions (a worker's
        interleaved chunks) cost no more than a slice.

        Args:
            positions: G positions, integers of any shape (read flattened).

        Returns:
            The global sample index of each position, a new 1-D array in the order given.

        Raises:
            ConfigError: The positions are no integers, or one is outside ``[0, len(self))``.
        """
        pos = self._check_indices("positions", positions)
        if not self.shuffle or pos.size == 0:
            return pos.copy()
        blocks = np.searchsorted(self._block_offsets, pos, side="right") - 1
        order = (np.arange(pos.size) if bool(np.all(blocks[1:] >= blocks[:-1]))
                 else np.argsort(blocks, kind="stable"))
        sorted_blocks = blocks[order]
        cuts = np.flatnonzero(sorted_blocks[1:] != sorted_blocks[:-1]) + 1
        out = np.empty_like(pos)
        for lo, hi in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [pos.size]))):
            b = int(sorted_blocks[lo])
            idx = order[lo:hi]
            out[idx] = self._block_sequence(b)[pos[idx] - self._block_offsets[b]]
        return out

    def shard_of(self, global_indices: ArrayLike) -> tuple[IntArray, IntArray]:
        """Map global sample indices to ``(shard_ids, positions_in_shard)``.

        Args:
            global_indices: global sample indices, integers of any shape (read flattened).

        Returns:
            (the shard of each index, its position in that shard), two 1-D arrays in the
            order given.

        Raises:
            ConfigError: The indices are no integers, or one is outside ``[0, len(self))``.
        """
        g = self._check_indices("global_indices", global_indices)
        # side="right" skips empty shards, which share their first_sample with the next one.
        shard = np.searchsorted(self._offsets, g, side="right").astype(np.int64) - 1
        return shard, g - self._offsets[shard]

    def _check_indices(self, name: str, values: ArrayLike) -> IntArray:
        arr = np.asarray(values).reshape(-1)
        if arr.size and arr.dtype.kind not in "iu":
            raise ConfigError(f"{name} must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
        if arr.size and (arr.min() < 0 or arr.max() >= len(self)):
            raise ConfigError(f"{name} must lie in [0, {len(self)})")
        return arr
