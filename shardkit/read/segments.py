"""What a reader without a node cache reads of each shard: byte segments covering the samples
it needs this epoch, and little beyond them.

DataLoader workers take turns in whole batches, so each worker needs every N-th batch of a
shard; reading the span of its samples meant reading the whole shard in every worker (N times
the traffic, and whole shards held in memory). Instead a reader plans, per shard, the samples
its own G ranges hold (a pure function of the epoch order and those ranges, see partition),
merges their byte intervals where the gap between two is cheaper to read than another request
(``GAP_BYTES``), and cuts the result into segments of about ``SEGMENT_BYTES`` (at least one
sample), so what it holds is bounded by segments, not by shards. Runs are split at segment
boundaries (:meth:`SegmentPlanner.split`), so every run lies inside one segment.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from shardkit.read.epoch_order import EpochOrder
from shardkit.read.partition import Range
from shardkit.read.rows import ShardRows
from shardkit.util.lru import LRU

__all__ = ["GAP_BYTES", "SEGMENT_BYTES", "SHARE_EDGE", "SPREAD_OVER_WORKERS", "Run", "SegmentPlanner",
           "ShardSegments", "merge_segments"]

log = logging.getLogger(__name__)

Run = tuple[int, np.ndarray]  # (shard, in-shard positions) as partition.worker_schedule yields them

# Samples closer than this share a read: a small gap costs less to read than one more request.
# Not much larger: the gaps between a worker's batches are its siblings' batches, and every
# byte of them read would be read once per worker (the traffic this module removes).
GAP_BYTES = 1 << 20
# A segment's size, about: bounds what a reader holds per shard it reads from (one sample
# bigger than this is a segment of its own).
SEGMENT_BYTES = 64 << 20
_PLANS_KEPT = 64  # shard plans one reader keeps (a shuffle block needs a few at a time)
_WASTE_WARNING = 1.5  # read / needed bytes of a shard above which a reader says so, once
_warned = False  # this process has warned, or been told another reader of its rank did
# Why a reader needs only a scattered part of a shard, for the warning (the caller knows which).
SPREAD_OVER_WORKERS = ("DataLoader workers take turns in batches, so its siblings' samples lie between its own in "
                       "every shard, and gaps under 1 MiB are read through (cheaper than a request each): batches "
                       "under 1 MiB, or a shuffled order, which spreads each shard's samples over all batches (in "
                       "order, batches of 1 MiB or more avoid it)")
SHARE_EDGE = ("its share of the shuffled epoch (a rank's part, or what a resumed epoch has left) starts or ends "
              "inside a shuffle block, so it needs a scattered part of that block's shards' small samples "
              "(a smaller shuffle_block narrows this)")


@dataclass(frozen=True)
class ShardSegments:
    """The segments of one shard: ``lo[k]:hi[k]`` are shard byte ranges, ``segment[i]`` the
    segment of needed position ``positions[i]`` (ascending)."""

    positions: np.ndarray
    segment: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def of(self, positions: np.ndarray) -> np.ndarray:
        """Segment ids of in-shard ``positions``.

        Args:
            positions: in-shard positions, each one this plan needs.

        Returns:
            The segment id of each position, in the order given.

        Raises:
            AssertionError: a position is none this plan needs (a caller's bug).
        """
        idx = np.searchsorted(self.positions, positions)
        if (idx >= len(self.positions)).any() or (self.positions[np.minimum(idx, len(self.positions) - 1)]
                                                  != positions).any():
            raise AssertionError("shardkit: a run holds a sample its reader's segment plan does not")
        return self.segment[idx]

    def bounds(self, segment: int) -> tuple[int, int]:
        """The shard byte range ``[lo, hi)`` of ``segment``.

        Args:
            segment: a segment id of this shard.

        Returns:
            (lo, hi), shard byte offsets.
        """
        return int(self.lo[segment]), int(self.hi[segment])

    def members(self, segment: int) -> np.ndarray:
        """The needed positions inside ``segment`` (segment ids ascend with positions).

        Args:
            segment: a segment id of this shard.

        Returns:
            The in-shard positions the reader needs from it, ascending.
        """
        a, z = np.searchsorted(self.segment, [segment, segment + 1])
        return self.positions[a:z]


def merge_segments(starts: np.ndarray, ends: np.ndarray, gap: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group byte intervals sorted by start into segments: a new one where the gap from the
    previous interval exceeds ``gap``, or where the group has grown past ``size``.

    Args:
        starts: the intervals' first bytes, ascending.
        ends: the bytes after their last ones.
        gap: the largest gap read through rather than starting a new segment.
        size: about the largest segment (one interval may make it longer).

    Returns:
        (segment id per interval, segment starts, segment ends).
    """
    n = len(starts)
    if n == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    new_group = np.concatenate(([True], starts[1:] - ends[:-1] > gap))
    group = np.cumsum(new_group) - 1
    group_start = starts[new_group][group]
    # Within a group, cut every ``size`` bytes from its start: each piece is at most ``size``
    # plus one interval long.
    piece = (starts - group_start) // size
    key = np.stack([group, piece])
    first = np.concatenate(([True], (key[:, 1:] != key[:, :-1]).any(axis=0)))
    segment = np.cumsum(first) - 1
    lo = starts[first]
    hi = np.maximum.reduceat(ends, np.flatnonzero(first))
    return segment.astype(np.int64), lo.astype(np.int64), hi.astype(np.int64)


class SegmentPlanner:
    """Segments of every shard a reader's G ranges touch, planned when first asked for.

    Args:
        order: the epoch sequence.
        ranges: the reader's G ranges (a worker's share; may repeat positions when padded).
        rows: the manifest rows of a shard (offsets and sizes of its samples).
        may_warn: asked once, when this process would first warn that it fetches much more
            than its samples: False if another reader of the rank (a sibling DataLoader
            worker) has said so already. Default: always this process's first time.
        why: the warning's reason: :data:`SPREAD_OVER_WORKERS` where DataLoader workers
            share the rank's shards, else :data:`SHARE_EDGE`.
    """

    def __init__(self, order: EpochOrder, ranges: Sequence[Range], rows: Callable[[int], ShardRows],
                 may_warn: Callable[[], bool] | None = None, why: str = SPREAD_OVER_WORKERS) -> None:
        self.order, self.rows = order, rows
        self._may_warn, self._why = may_warn, why
        arr = np.asarray(list(ranges), dtype=np.int64).reshape(-1, 2)
        self._starts, self._stops = arr[:, 0], arr[:, 1]
        block_of = np.empty(order.num_shards, np.int64)
        block_of[order.shard_order] = np.arange(order.num_shards, dtype=np.int64) // order.block_shards
        self._block_of = block_of
        self._plans: LRU[int, ShardSegments] = LRU(_PLANS_KEPT)

    def plan(self, shard: int) -> ShardSegments:
        """The segments of ``shard`` (planned on first use; the plans used last are kept).

        Planning a shard may warn, once per process, that the reader fetches much more than
        its samples (see ``may_warn``).

        Args:
            shard: the shard id.

        Returns:
            The shard's plan (no segments when the reader needs none of its samples).

        Raises:
            ManifestError: ``rows`` found the shard's manifest rows unreadable (a reader's
                ``rows`` is :meth:`shardkit.read.dataset.Dataset.cached_rows`).
            StorageError: ``rows`` could not read them from storage.
        """
        plan = self._plans.get(shard)
        if plan is None:
            plan = self._make(shard)
            self._plans.put(shard, plan)
        return plan

    def needed(self, shard: int) -> np.ndarray:
        """In-shard positions of ``shard`` the reader's ranges hold, ascending, each once.

        Only the G positions of the shard's shuffle block are generated and looked at.

        Args:
            shard: the shard id.

        Returns:
            The positions (int64), empty when the ranges hold none of the shard's samples.
        """
        b = int(self._block_of[shard])
        g_lo, g_hi = int(self.order.block_offsets[b]), int(self.order.block_offsets[b + 1])
        lo = np.maximum(self._starts, g_lo)
        hi = np.minimum(self._stops, g_hi)
        keep = hi > lo
        if not keep.any():
            return np.zeros(0, np.int64)
        positions = np.concatenate([np.arange(a, z, dtype=np.int64) for a, z in zip(lo[keep].tolist(), hi[keep].tolist())])
        shards, in_shard = self.order.shard_of(self.order.take(positions))
        return np.unique(in_shard[shards == shard])

    def _make(self, shard: int) -> ShardSegments:
        positions = self.needed(shard)
        rows = self.rows(shard)
        starts = rows.offset[positions].astype(np.int64)
        ends = starts + rows.size[positions].astype(np.int64)
        segment, lo, hi = merge_segments(starts, ends, GAP_BYTES, SEGMENT_BYTES)
        _warn_if_wasteful(shard, int(np.sum(hi - lo)), int(np.sum(ends - starts)), self._may_warn, self._why)
        return ShardSegments(positions, segment, lo, hi)

    def segments_of(self, runs: Iterable[Run]) -> list[tuple[int, int]]:
        """(shard, segment) of each run, in order, by its first sample (a run from
        :meth:`split` lies in one segment): one lookup per shard.

        Args:
            runs: (shard, in-shard positions) runs, none empty.

        Returns:
            One (shard, segment) per run, in the order of ``runs``.

        Raises:
            AssertionError: a run holds a sample this reader's plan does not (a caller's bug).
        """
        at: dict[int, list[int]] = {}
        firsts: list[tuple[int, int]] = []
        for shard, positions in runs:
            slot = at.setdefault(shard, [])
            firsts.append((shard, len(slot)))
            slot.append(int(positions[0]))
        found = {shard: self.plan(shard).of(np.asarray(p, np.int64)).tolist() for shard, p in at.items()}
        return [(shard, found[shard][i]) for shard, i in firsts]

    def split(self, runs: Iterator[Run]) -> Iterator[Run]:
        """The same runs, cut where a run crosses from one segment into another.

        Args:
            runs: (shard, in-shard positions) runs of samples this plan needs.

        Yields:
            (shard, positions) runs in the same order, each inside one segment.

        Raises:
            AssertionError: a run holds a sample this reader's plan does not (a caller's bug).
        """
        for shard, positions in runs:
            seg = self.plan(shard).of(positions)
            if len(seg) < 2 or (seg == seg[0]).all():
                yield shard, positions
                continue
            cuts = (np.flatnonzero(seg[1:] != seg[:-1]) + 1).tolist()
            for a, z in zip([0] + cuts, cuts + [len(positions)]):
                yield shard, positions[a:z]


def _warn_if_wasteful(shard: int, read: int, needed: int, may_warn: Callable[[], bool] | None, why: str) -> None:
    # DataLoader workers reading without a cache each need every N-th batch of a shard (and in
    # a shuffled order a random share of it); where the gaps between a worker's samples (its
    # siblings' batches) are small, reading them beats a request each, so each worker fetches
    # most of the shard. A single reader meets the same where its contiguous part of the
    # epoch order begins or ends inside a shuffle block (ranks split the order; a resumed
    # epoch has a consumed part cut out): at most two blocks per share, but with small shares
    # or datasets that is most of it.
    global _warned
    if _warned or read <= _WASTE_WARNING * needed:
        return
    _warned = True
    # Every worker of the rank gets here at about the same time: one line per rank, not one
    # per worker (each with its own figure), is what the user needs.
    if may_warn is not None and not may_warn():
        return
    log.warning("reading without a cache, this reader fetches %.1fx the bytes of its samples (shard %d): %s; "
                "a cache_dir (a local disk, or /dev/shm with a cache_limit) fetches each shard once per node",
                read / max(needed, 1), shard, why)
