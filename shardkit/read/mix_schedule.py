"""One reader's walk through its share of a mixture: which shards of each stream it needs (in
first-need order, for prefetch), and the runs of each stream's samples in the order it reads them.

A reader of a mixture keeps one shard source per stream; :class:`MixtureWalk` hands each of them
its own run stream (``(shard, positions)`` as :func:`shardkit.read.partition.worker_schedule`
yields for one dataset) and the reader the stream of each position, so the sources are read in
``M``'s order. Everything is generated in pieces; a stream's runs stop at its last item of the
share, so a stream that is done never makes the walk read further ahead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from numpy.typing import NDArray

from shardkit.read.mixture import MixtureOrder, positions_of
from shardkit.read.partition import Range
from shardkit.read.rows import ShardRows
from shardkit.read.segments import _PLANS_KEPT, SPREAD_OVER_WORKERS, SegmentPlanner
from shardkit.util.lru import LRU

__all__ = ["MixtureWalk", "NeededSegments", "mixture_schedule"]

IntArray = NDArray[np.int64]
Run = tuple[int, IntArray]


def mixture_schedule(order: MixtureOrder, ranges: Sequence[Range], needed: bool = False
                     ) -> tuple[list[list[int]], list[int], list[dict[int, IntArray]]]:
    """One pass over a reader's ranges: per stream, its shards and items.

    Args:
        order: the epoch's mixture.
        ranges: the reader's M ranges (a worker's share).
        needed: also collect, per stream and shard, the in-shard positions read (for reads
            without a cache, which fetch only those bytes).

    Returns:
        (per stream the distinct shards in first-need order, per stream the items read,
        per stream ``{shard: ascending positions}`` (empty dicts unless ``needed``)).
    """
    streams = len(order.counts)
    seen = [np.zeros(len(s), dtype=bool) for s in order.shard_sizes]
    sched: list[list[int]] = [[] for _ in range(streams)]
    counts = [0] * streams
    parts: list[dict[int, list[IntArray]]] = [{} for _ in range(streams)]
    for pos in positions_of(ranges):
        s_of, samples = order.take(pos)
        for i in np.unique(s_of).tolist():
            shards, in_shard = order.shard_of(i, samples[s_of == i])
            counts[i] += shards.size
            unique, first = np.unique(shards, return_index=True)
            fresh = unique[~seen[i][unique]]
            fresh = fresh[np.argsort(first[~seen[i][unique]], kind="stable")]
            seen[i][fresh] = True
            sched[i].extend(fresh.tolist())
            if needed:
                for s in np.unique(shards).tolist():
                    parts[i].setdefault(s, []).append(in_shard[shards == s])
    need = [{s: np.unique(np.concatenate(p)) for s, p in d.items()} for d in parts]
    return sched, counts, need


class MixtureWalk:
    """The runs of each stream, and the stream of each position, for one reader's ranges.

    Args:
        order: the epoch's mixture.
        ranges: the reader's M ranges.
        counts: per stream, its items in ``ranges`` (from :func:`mixture_schedule`).
    """

    def __init__(self, order: MixtureOrder, ranges: Sequence[Range], counts: Sequence[int]) -> None:
        self.order = order
        self._pieces = positions_of(ranges)
        self._labels: deque[IntArray] = deque()
        self._runs: list[deque[Run]] = [deque() for _ in counts]
        self._left = list(counts)  # items of each stream not yet cut into runs

    def _load(self) -> bool:
        pos = next(self._pieces, None)
        if pos is None:
            return False
        s_of, samples = self.order.take(pos)
        self._labels.append(s_of)
        for i in np.unique(s_of).tolist():
            shards, in_shard = self.order.shard_of(i, samples[s_of == i])
            cuts = np.flatnonzero(shards[1:] != shards[:-1]) + 1
            firsts = [0] + cuts.tolist()
            lasts = cuts.tolist() + [shards.size]
            q = self._runs[i]
            for shard, a, z in zip(shards[firsts].tolist(), firsts, lasts):
                q.append((shard, in_shard[a:z]))
        return True

    def runs(self, stream: int) -> Iterator[Run]:
        """The runs of ``stream`` in reading order.

        Args:
            stream: the stream.

        Yields:
            ``(shard, positions in shard)``.
        """
        q = self._runs[stream]
        while self._left[stream] > 0:
            while not q:
                if not self._load():
                    return
            run = q.popleft()
            self._left[stream] -= run[1].size
            yield run

    def labels(self) -> Iterator[int]:
        """The stream of each position of the ranges, in order.

        Yields:
            Stream indices.
        """
        while True:
            while not self._labels:
                if not self._load():
                    return
            yield from self._labels.popleft().tolist()


class NeededSegments(SegmentPlanner):
    """A :class:`~shardkit.read.segments.SegmentPlanner` over positions known in advance (a
    stream's share of a mixture), for reads without a cache.

    Args:
        needed: ``{shard: ascending in-shard positions}`` the reader reads.
        rows: the manifest rows of a shard.
        may_warn: as for SegmentPlanner.
        why: as for SegmentPlanner.
    """

    def __init__(self, needed: dict[int, IntArray], rows: Callable[[int], ShardRows],
                 may_warn: Callable[[], bool] | None = None, why: str = SPREAD_OVER_WORKERS) -> None:
        # Not SegmentPlanner.__init__: that one derives the positions from one EpochOrder.
        self.rows, self._may_warn, self._why = rows, may_warn, why
        self._plans = LRU(_PLANS_KEPT)
        self._needed = needed

    def needed(self, shard: int) -> IntArray:
        """In-shard positions of ``shard`` the reader reads, ascending.

        Args:
            shard: the shard id.

        Returns:
            The positions (empty when none).
        """
        return self._needed.get(shard, np.zeros(0, np.int64))
