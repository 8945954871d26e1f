"""What a reader without a cache reads: shardkit.read.segments (pure; no processes, no I/O)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.read import segments
from shardkit.read.partition import EpochOrder, rank_ranges, worker_ranges, worker_schedule
from shardkit.read.segments import SegmentPlanner, merge_segments


def test_close_intervals_share_a_segment_and_far_ones_do_not() -> None:
    starts = np.array([0, 10, 1_000, 500_000])
    ends = np.array([10, 20, 1_010, 500_010])
    seg, lo, hi = merge_segments(starts, ends, gap=100_000, size=1 << 20)
    assert seg.tolist() == [0, 0, 0, 1]
    assert lo.tolist() == [0, 500_000] and hi.tolist() == [1_010, 500_010]


def test_segments_are_cut_at_about_their_size() -> None:
    starts = np.arange(0, 100, 10)
    seg, lo, hi = merge_segments(starts, starts + 10, gap=0, size=25)
    assert seg.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert all(h - l_ <= 25 + 10 for l_, h in zip(lo, hi))
    # an interval bigger than a segment is a segment of its own
    seg, lo, hi = merge_segments(np.array([0, 5, 1000]), np.array([5, 1000, 1005]), gap=10, size=100)
    assert seg.tolist() == [0, 0, 1] and hi.tolist() == [1000, 1005]


def test_no_intervals_no_segments() -> None:
    seg, lo, hi = merge_segments(np.zeros(0, np.int64), np.zeros(0, np.int64), gap=1, size=1)
    assert len(seg) == len(lo) == len(hi) == 0


def fake_rows(order: EpochOrder, seed: int) -> dict[int, SimpleNamespace]:
    """Per shard: samples of random sizes, back to back after 512-byte tar headers."""
    rng = np.random.default_rng(seed)
    out = {}
    for shard, n in enumerate(order.shard_sizes.tolist()):
        size = rng.integers(1, 5_000, n)
        offset = np.cumsum(size + 512) - size
        out[shard] = SimpleNamespace(offset=offset, size=size)
    return out


@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=10), shuffle=st.booleans(),
       block=st.integers(1, 4), world=st.integers(1, 4), workers=st.integers(1, 3), chunk=st.integers(1, 7),
       drop_last=st.booleans(), seed=st.integers(0, 2**32), gap=st.sampled_from([0, 600, 20_000]),
       size=st.sampled_from([1, 4_000, 50_000]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_split_runs_keep_the_order_and_each_lies_in_one_segment(sizes: list[int], shuffle: bool, block: int,
                                                                  world: int, workers: int, chunk: int,
                                                                  drop_last: bool, seed: int, gap: int,
                                                                  size: int) -> None:
    order = EpochOrder(sizes, epoch=1, seed=seed, shuffle=shuffle, block_shards=block)
    rows = fake_rows(order, seed)
    for rank in range(world):
        for worker in range(workers):
            ranges = worker_ranges(rank_ranges([(0, len(order))], rank, world, drop_last), worker, workers, chunk)
            with mock.patch.object(segments, "GAP_BYTES", gap), mock.patch.object(segments, "SEGMENT_BYTES", size):
                planner = SegmentPlanner(order, ranges, rows.__getitem__)
                split = list(planner.split(worker_schedule(order, ranges)))
            whole = list(worker_schedule(order, ranges))
            # the same samples in the same order
            flat = [(s, int(p)) for s, ps in split for p in ps]
            assert flat == [(s, int(p)) for s, ps in whole for p in ps]
            per_shard: dict[int, set[int]] = defaultdict(set)
            for shard, positions in split:
                plan = planner.plan(shard)
                seg = plan.of(positions)
                assert len(set(seg.tolist())) == 1, "a run crosses a segment boundary"
                lo, hi = plan.bounds(int(seg[0]))
                r = rows[shard]
                assert (r.offset[positions] >= lo).all() and (r.offset[positions] + r.size[positions] <= hi).all()
                per_shard[shard].update(positions.tolist())
            for shard, got in per_shard.items():
                plan = planner.plan(shard)
                assert planner.needed(shard).tolist() == sorted(got)  # nothing planned that is not read
                # no byte is read twice by one reader: segments do not overlap
                assert (plan.lo[1:] >= plan.hi[:-1]).all()
                # a segment is about its size: at most one sample past it
                assert (plan.hi - plan.lo < size + int(rows[shard].size.max())).all()
            assert planner.segments_of(split) == [(s, int(planner.plan(s).of(p)[0])) for s, p in split]


def test_a_run_the_plan_does_not_hold_is_refused() -> None:
    order = EpochOrder([10, 10], shuffle=False)
    rows = fake_rows(order, 0)
    planner = SegmentPlanner(order, [(0, 5)], rows.__getitem__)
    with pytest.raises(AssertionError, match="segment plan"):
        planner.plan(0).of(np.array([7]))


def test_a_reader_fetching_much_more_than_its_samples_is_told_once(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    # Worker 0 of 2 in a shuffled order: a random half of each shard's small samples, the
    # gaps between them cheaper to read than more requests, so it reads most of each shard.
    order = EpochOrder([400, 400], seed=5, shuffle=True, block_shards=1)
    rows = fake_rows(order, 0)
    monkeypatch.setattr(segments, "_warned", False)
    with caplog.at_level("WARNING", logger="shardkit"):
        contiguous = SegmentPlanner(order, worker_ranges([(0, 800)], 0, 1, 16), rows.__getitem__)
        contiguous.plan(0), contiguous.plan(1)
        assert not caplog.text  # every sample of each shard: nothing wasted
        half = SegmentPlanner(order, worker_ranges([(0, 800)], 0, 2, 16), rows.__getitem__)
        half.plan(0), half.plan(1)
    assert caplog.text.count("reading without a cache, this reader fetches") == 1
    assert "cache_dir" in caplog.text


def test_a_reader_another_has_spoken_for_stays_quiet(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    # Each DataLoader worker of a rank wastes about as much: the rank says so once, so a worker
    # whose may_warn says a sibling has already spoken prints nothing (and is asked only once).
    order = EpochOrder([400, 400], seed=5, shuffle=True, block_shards=1)
    rows = fake_rows(order, 0)
    asked: list[int] = []
    for spoken, expected in ((True, 0), (False, 1)):
        monkeypatch.setattr(segments, "_warned", False)
        caplog.clear()
        with caplog.at_level("WARNING", logger="shardkit"):
            planner = SegmentPlanner(order, worker_ranges([(0, 800)], 1, 2, 16), rows.__getitem__,
                                     lambda s=spoken: asked.append(1) or not s)
            planner.plan(0), planner.plan(1)
        assert caplog.text.count("reading without a cache") == expected
    assert len(asked) == 2


def test_workers_in_order_overfetch_only_with_batches_under_the_gap(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    # Unshuffled too, worker 0 of 2 needs every other batch of a shard: small batches leave
    # gaps cheaper to read through (and the warning says so, not "a shuffled order"); batches
    # over GAP_BYTES are read alone.
    order = EpochOrder([800, 800], shuffle=False)
    rows = fake_rows(order, 1)  # ~3 KB per sample with its header
    span = {s: int(rows[s].offset[-1] + rows[s].size[-1] - rows[s].offset[0]) for s in (0, 1)}
    for chunk, warned in ((16, 1), (400, 0)):  # ~48 KB and ~1.2 MB batches
        monkeypatch.setattr(segments, "_warned", False)
        caplog.clear()
        with caplog.at_level("WARNING", logger="shardkit"):
            planner = SegmentPlanner(order, worker_ranges([(0, 1600)], 0, 2, chunk), rows.__getitem__)
            read = [int(np.sum(p.hi - p.lo)) for p in (planner.plan(0), planner.plan(1))]
        assert caplog.text.count("reading without a cache") == warned
        if warned:
            assert "batches under 1 MiB" in caplog.text and read[0] > 0.95 * span[0]  # most of the shard
        else:
            assert read[0] < 0.6 * span[0] and read[1] < 0.6 * span[1]  # its own half of each
