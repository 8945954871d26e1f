"""The epoch sequence of a mixture of datasets, ``M``: a pure function of (per-stream shard sizes,
per-stream counts, epoch, seed), the same in every rank and DataLoader worker.

**What an epoch is**: see :mod:`shardkit.read.mix_counts` (``weight``, ``repeat``, ``choose``,
``epoch_size``). The epoch is the sum of the per-stream counts ``c_i``.

**The sequence.** Stream ``i``'s own sequence ``S_i`` (length ``c_i``) is the concatenation of
copies of its :class:`~shardkit.read.epoch_order.EpochOrder` (copy ``q`` seeded from
``(seed, stream, q)``), the last one cut short: with ``shuffle``, a cut copy is a seeded subset of
whole shuffle blocks (random shards), so a reader of a stream still needs one block's shards at
a time; without it, the first samples. ``M`` merges the ``S_i`` at a fine grain: item ``k`` of
stream ``i`` sits at key ``(k + u_i) / c_i`` (``u_i`` a phase in ``[0, 1)`` seeded from
``(seed, epoch)``) and ``M`` is all items by key, so every prefix of ``M`` holds each stream's
share within about one sample. Positions of ``M`` are split over ranks and workers exactly as
the positions of ``G`` (:mod:`shardkit.read.partition`), so equal counts per rank, no overlap
and elastic resume carry over unchanged.

**A changed mixture mid-epoch** (:func:`rest_counts`, ``history``): the samples of the epoch
already consumed under the earlier mixtures are *seen*; the rest of the epoch is a new ``M``
over the *unseen* samples only, each stream's sequence being its copy-0 order with the seen
samples taken out. Promised: no sample seen this epoch is yielded again in it (DDP padding
aside: without ``drop_last`` ranks are evened out by repeating a few samples of the remaining
part, as for one dataset); the rest
follows the new weights as far as each stream's unseen samples allow (a stream that runs out
gives its remaining share to the others by weight); with absolute options, stream ``i`` gives
``c'_i`` minus what it already gave, at most its unseen samples.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from shardkit.config import int_arg
from shardkit.errors import ConfigError
from shardkit.read.epoch_order import DEFAULT_BLOCK_SHARDS, EpochOrder
from shardkit.read.mix_counts import Share, allocate, mixture_counts, rest_counts
from shardkit.read.partition import Range

__all__ = ["MixtureOrder", "Share", "Stage", "allocate", "changed_mixture", "consumed_ranges", "mixture_counts", "positions_of",
           "rest_counts"]

IntArray = NDArray[np.int64]

_PIECE = 65_536  # M items generated at once (the merge's chunk): bounds memory per call
# Domain tags keep the random streams of copies and phases apart.
_COPY_TAG = 2
_PHASE_TAG = 3


@dataclass(frozen=True)
class Stage:
    """An earlier mixture of the same epoch, left mid-way (a resume under other weights).

    Args:
        counts: its per-stream counts.
        remaining: its ascending M position ranges no rank had consumed when it was left.
    """

    counts: tuple[int, ...]
    remaining: tuple[Range, ...]


def _raw(seed: int, key: tuple[int, ...], n: int) -> NDArray[np.uint64]:
    # The raw PCG64 stream is stable across numpy releases (see epoch_order._permutation).
    return np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)).random_raw(n)


def positions_of(ranges: Sequence[Range], piece: int = _PIECE) -> Iterator[IntArray]:
    """The positions of ``ranges`` in order, at most ``piece`` at a time.

    Args:
        ranges: ``(start, stop)`` ranges (any order; padding may repeat some).
        piece: the most positions per array.

    Yields:
        int64 arrays of positions.
    """
    buf: list[IntArray] = []
    have = 0
    for a, b in ranges:
        for lo in range(int(a), int(b), piece):
            part = np.arange(lo, min(lo + piece, int(b)), dtype=np.int64)
            buf.append(part)
            have += part.size
            if have >= piece:
                yield np.concatenate(buf)
                buf, have = [], 0
    if buf:
        yield np.concatenate(buf)


def consumed_ranges(remaining: Sequence[Range], length: int) -> list[Range]:
    """The complement of ``remaining`` in ``[0, length)``: what was consumed.

    Args:
        remaining: ascending, disjoint ranges.
        length: the sequence's length.

    Returns:
        Ascending, disjoint ranges.
    """
    out, pos = [], 0
    for a, b in remaining:
        if a > pos:
            out.append((pos, int(a)))
        pos = max(pos, int(b))
    if pos < length:
        out.append((pos, length))
    return out


class MixtureOrder:
    """The mixture sequence ``M`` of one epoch (see the module docstring).

    Args:
        shard_sizes: per stream, its samples per shard.
        counts: per stream, samples it contributes this epoch (:func:`mixture_counts`, or
            :func:`rest_counts` with ``history``).
        epoch: epoch number.
        seed: the seed (``0 <= seed < 2**64``).
        shuffle: shuffle each stream's order (:class:`EpochOrder`).
        block_shards: shards per shuffle block.
        history: earlier mixtures of this epoch (oldest first): their consumed samples are
            left out of this one.
        selected: per stream, None or, for a stream that is a subset of its dataset, (the
            selected global indices ascending, each shard's first global index); its
            ``shard_sizes`` are then the selected counts per shard.

    Raises:
        ConfigError: a bad argument, or a count larger than a stream can give (more than its
            unseen samples, with ``history``).
    """

    def __init__(self, shard_sizes: Sequence[ArrayLike], counts: Sequence[int], *, epoch: int = 0, seed: int = 0,
                 shuffle: bool = True, block_shards: int = DEFAULT_BLOCK_SHARDS,
                 history: Sequence[Stage] = (), selected: Sequence[tuple[IntArray, IntArray] | None] = ()) -> None:
        if len(shard_sizes) != len(counts) or not counts:
            raise ConfigError("MixtureOrder: one count per stream, at least one stream")
        self.epoch = int_arg("epoch", epoch, 0, 2**32 - 1)
        self.seed = int_arg("seed", seed, 0, 2**64 - 1)
        self.shuffle, self.block_shards = bool(shuffle), int_arg("block_shards", block_shards, 1)
        self.shard_sizes = [np.asarray(s, dtype=np.int64) for s in shard_sizes]
        self.offsets = [np.concatenate(([0], np.cumsum(s))).astype(np.int64) for s in self.shard_sizes]
        self.sizes = [int(o[-1]) for o in self.offsets]
        self.counts = [int_arg("count", c, 0) for c in counts]
        self.history = tuple(history)
        # Per stream, (its selected global indices, each shard's first global index) when it is
        # a subset: its samples are then the selection's, and shard_of maps them back.
        self.selected = tuple(selected) or (None,) * len(self.shard_sizes)
        self._orders: dict[tuple[int, int], EpochOrder] = {}
        self._pools: list[IntArray] | None = None
        if self.history:
            seen = self.seen_before()
            self._pools = []
            for i, n in enumerate(self.sizes):
                full = self._copy(i, 0).indices(0, n)
                self._pools.append(full[~seen[i][full]])
            for i, (c, pool) in enumerate(zip(self.counts, self._pools)):
                if c > pool.size:
                    raise ConfigError(f"MixtureOrder: stream {i} has {pool.size} unseen samples, {c} asked for")
        else:
            for i, (c, n) in enumerate(zip(self.counts, self.sizes)):
                if c and not n:
                    raise ConfigError(f"MixtureOrder: stream {i} has no samples, {c} asked for")
        phases = _raw(self.seed, (_PHASE_TAG, self.epoch, len(self.history)), len(self.counts))
        self.phase = (phases >> np.uint64(11)).astype(np.float64) * 2.0**-53
        total = sum(self.counts)
        self._chunks = max(1, -(-total // _PIECE))
        # below[j, i]: items of stream i with a key below j / chunks (how many precede chunk j).
        x = np.arange(self._chunks + 1, dtype=np.float64)[:, None] / self._chunks
        cf = np.asarray(self.counts, dtype=np.float64)[None, :]
        self._below = np.clip(np.ceil(x * cf - self.phase[None, :]), 0, cf).astype(np.int64)
        self._below[-1] = self.counts  # exact at the end whatever the rounding
        self._chunk_start = self._below.sum(axis=1)
        self._cache: tuple[int, IntArray, IntArray] | None = None

    def __len__(self) -> int:
        return int(self._chunk_start[-1])

    def _copy(self, stream: int, q: int) -> EpochOrder:
        order = self._orders.get((stream, q))
        if order is None:
            seed = int(_raw(self.seed, (_COPY_TAG, stream, q), 1)[0])
            order = EpochOrder(self.shard_sizes[stream], epoch=self.epoch, seed=seed, shuffle=self.shuffle,
                               block_shards=self.block_shards)
            self._orders[(stream, q)] = order
        return order

    def _chunk(self, j: int) -> tuple[IntArray, IntArray]:
        if self._cache is not None and self._cache[0] == j:
            return self._cache[1], self._cache[2]
        lo, hi = self._below[j], self._below[j + 1]
        n = hi - lo
        streams = np.repeat(np.arange(len(self.counts), dtype=np.int64), n)
        items = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n - lo, n)
        keys = (items + self.phase[streams]) / np.asarray(self.counts, np.float64)[streams]
        order = np.lexsort((streams, keys))
        streams, items = streams[order], items[order]
        self._cache = (j, streams, items)
        return streams, items

    def items(self, positions: ArrayLike) -> tuple[IntArray, IntArray]:
        """``(stream, k)`` of each position: ``M[p]`` is item ``k`` of stream ``S_stream``.

        Args:
            positions: M positions, integers in ``[0, len(self))``.

        Returns:
            Two int64 arrays, in the order given.

        Raises:
            ConfigError: a position out of range.
        """
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and (pos.min() < 0 or pos.max() >= len(self)):
            raise ConfigError(f"positions must lie in [0, {len(self)})")
        streams = np.empty_like(pos)
        items = np.empty_like(pos)
        chunk = np.searchsorted(self._chunk_start, pos, side="right") - 1
        for j in np.unique(chunk).tolist():
            at = np.flatnonzero(chunk == j)
            s, k = self._chunk(j)
            local = pos[at] - self._chunk_start[j]
            streams[at], items[at] = s[local], k[local]
        return streams, items

    def take(self, positions: ArrayLike) -> tuple[IntArray, IntArray]:
        """``(stream, sample)`` of each position: the stream and its global sample index.

        Args:
            positions: M positions, integers in ``[0, len(self))``.

        Returns:
            Two int64 arrays, in the order given.

        Raises:
            ConfigError: a position out of range.
        """
        streams, items = self.items(positions)
        samples = np.empty_like(items)
        for i in np.unique(streams).tolist():
            at = np.flatnonzero(streams == i)
            samples[at] = self.sample_of(i, items[at])
        return streams, samples

    def sample_of(self, stream: int, items: IntArray) -> IntArray:
        """The global sample indices of items ``k`` of stream ``S_stream``.

        Args:
            stream: the stream.
            items: item numbers in ``[0, counts[stream])``.

        Returns:
            The stream's global sample indices.
        """
        if self._pools is not None:
            return self._pools[stream][items]
        n = self.sizes[stream]
        copies, within = np.divmod(items, n)
        out = np.empty_like(items)
        for q in np.unique(copies).tolist():
            at = np.flatnonzero(copies == q)
            out[at] = self._copy(stream, q).take(within[at])
        return out

    def shard_of(self, stream: int, samples: IntArray) -> tuple[IntArray, IntArray]:
        """Map a stream's global sample indices to ``(shard, position in shard)``.

        Args:
            stream: the stream.
            samples: its sample indices (positions in its selection, when it has one).

        Returns:
            Two int64 arrays: each sample's shard and its real position in that shard.
        """
        offsets = self.offsets[stream]
        shard = np.searchsorted(offsets, samples, side="right").astype(np.int64) - 1
        chosen = self.selected[stream]
        if chosen is None:
            return shard, samples - offsets[shard]
        indices, first = chosen
        return shard, np.asarray(indices[samples], np.int64) - first[shard]

    def seen_before(self) -> list[NDArray[np.bool_]]:
        """Per stream, which samples the ``history`` stages consumed.

        Returns:
            One bool array of ``n_i`` per stream.
        """
        seen = [np.zeros(n, dtype=bool) for n in self.sizes]
        for k, stage in enumerate(self.history):
            earlier = MixtureOrder(self.shard_sizes, stage.counts, epoch=self.epoch, seed=self.seed,
                                   shuffle=self.shuffle, block_shards=self.block_shards, history=self.history[:k])
            earlier.mark_seen(consumed_ranges(stage.remaining, len(earlier)), seen)
        return seen

    def mark_seen(self, ranges: Sequence[Range], seen: list[NDArray[np.bool_]]) -> None:
        """Mark the samples at M positions ``ranges`` in ``seen``.

        Args:
            ranges: M position ranges.
            seen: per-stream bool arrays, updated.
        """
        for pos in positions_of(ranges):
            streams, samples = self.take(pos)
            for i in np.unique(streams).tolist():
                seen[i][samples[streams == i]] = True

    def given(self, ranges: Sequence[Range]) -> list[int]:
        """Per stream, how many items the positions ``ranges`` hold.

        Args:
            ranges: M position ranges.

        Returns:
            Counts per stream.
        """
        out = np.zeros(len(self.counts), np.int64)
        for pos in positions_of(ranges):
            out += np.bincount(self.items(pos)[0], minlength=len(self.counts))
        return out.tolist()


def changed_mixture(shard_sizes: Sequence[ArrayLike], shares: Sequence[Share], epoch_size: int | None,
                    counts: Sequence[int], history: Sequence[Stage], left: Sequence[Range], *, epoch: int,
                    seed: int, shuffle: bool, block_shards: int) -> tuple[list[int], tuple[Stage, ...]]:
    """The rest of an epoch under new options, after a mixture left with ``left`` unconsumed.

    Args:
        shard_sizes: per stream, its samples per shard.
        shares: the new per-stream options.
        epoch_size: the new ``epoch_size`` option.
        counts: the counts of the mixture being left.
        history: that mixture's own earlier stages.
        left: its M ranges no rank consumed.
        epoch: the epoch.
        seed: the seed.
        shuffle: whether stream orders shuffle.
        block_shards: shards per shuffle block.

    Returns:
        (counts for the rest of the epoch, the history to build it with: ``history`` plus the
        stage being left).

    Raises:
        ConfigError: as :class:`MixtureOrder` and :func:`rest_counts`.
    """
    opts = {"epoch": epoch, "seed": seed, "shuffle": shuffle, "block_shards": block_shards}
    stages = (*history, Stage(tuple(int(c) for c in counts), tuple((int(a), int(b)) for a, b in left)))
    seen = [np.zeros(int(np.sum(s)), dtype=bool) for s in shard_sizes]
    given = np.zeros(len(counts), np.int64)
    for k, stage in enumerate(stages):
        order = MixtureOrder(shard_sizes, stage.counts, history=stages[:k], **opts)  # type: ignore[arg-type]
        done = consumed_ranges(stage.remaining, len(order))
        order.mark_seen(done, seen)
        given += np.asarray(order.given(done), np.int64)
    unseen = [int(s.size - s.sum()) for s in seen]
    sizes = [s.size for s in seen]
    return rest_counts(sizes, shares, epoch_size, given.tolist(), unseen), stages
