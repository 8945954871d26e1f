"""Properties of shardkit.read.partition over many topologies (pure; no processes, no I/O)."""

from __future__ import annotations

import pickle
import tracemalloc
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardkit.errors import ConfigError
from shardkit.read.epoch_order import EpochOrder
from shardkit.read.partition import (
    consumed_remaining,
    rank_ranges,
    samples_per_rank,
    schedule_shards,
    worker_ranges,
    worker_schedule,
)
from shardkit.read.topology import FromParent, Topology, current

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

sizes_st = st.lists(st.integers(0, 12), min_size=1, max_size=12)
orders = st.builds(
    EpochOrder,
    sizes_st,
    epoch=st.integers(0, 3),
    seed=st.integers(0, 2**64 - 1),
    shuffle=st.booleans(),
    block_shards=st.integers(1, 5),
)
worlds = st.integers(1, 8)


@st.composite
def remaining_lists(draw: st.DrawFn) -> list[tuple[int, int]]:
    """Ascending, disjoint ranges, some empty, some touching."""
    out, pos = [], 0
    for gap, length in draw(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 9)),
                                      max_size=6)):
        pos += gap
        out.append((pos, pos + length))
        pos += length
    return out


def expand(ranges: list[tuple[int, int]]) -> np.ndarray:
    """All positions of a list of ranges, in order."""
    parts = [np.arange(a, b, dtype=np.int64) for a, b in ranges]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def per_rank(total: int, world: int, drop_last: bool) -> int:
    return total // world if drop_last else -(-total // world)


def rank_reference(virtual: np.ndarray, rank: int, world: int, drop_last: bool) -> np.ndarray:
    """The spec, literally: slice of the virtual sequence repeated from its start."""
    n = per_rank(virtual.size, world, drop_last)
    return np.array([virtual[i % virtual.size] for i in range(rank * n, (rank + 1) * n)],
                    dtype=np.int64)


def interleave(streams: list[np.ndarray], chunk: int) -> np.ndarray:
    """What a DataLoader yields: one chunk from each worker in turn, skipping finished ones."""
    cursors = [0] * len(streams)
    out: list[np.ndarray] = []
    while any(c < s.size for c, s in zip(cursors, streams)):
        for w, s in enumerate(streams):
            out.append(s[cursors[w]:cursors[w] + chunk])
            cursors[w] += chunk
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def schedule_samples(order: EpochOrder, ranges: list[tuple[int, int]], **kw: int) -> np.ndarray:
    """Global sample indices a worker reads, from its run schedule."""
    parts = [order.first_sample[s] + pos for s, pos in worker_schedule(order, ranges, **kw)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


# --- the epoch sequence G ---------------------------------------------------------------


@FAST
@given(orders)
def test_order_is_a_permutation_that_keeps_blocks_in_their_shards(order: EpochOrder) -> None:
    n = len(order)
    full = order.indices(0, n)
    assert full.dtype == np.int64
    assert np.array_equal(np.sort(full), np.arange(n))
    assert sorted(order.shard_order.tolist()) == list(range(order.num_shards))
    if not order.shuffle:
        assert np.array_equal(full, np.arange(n))
    offsets = order.block_offsets
    for b in range(offsets.size - 1):
        block = full[offsets[b]:offsets[b + 1]]
        expected = np.concatenate([np.arange(order.first_sample[s],
                                             order.first_sample[s] + order.shard_sizes[s])
                                   for s in order.block(b)])
        assert np.array_equal(np.sort(block), np.sort(expected))


@FAST
@given(orders, st.data())
def test_indices_and_take_agree_with_the_materialised_sequence(order: EpochOrder,
                                                              data: st.DataObject) -> None:
    n = len(order)
    full = order.indices(0, n)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    assert np.array_equal(order.indices(start, stop), full[start:stop])
    if n:
        positions = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=30)), np.int64)
        assert np.array_equal(order.take(positions), full[positions])
        shard, pos = order.shard_of(full)
        assert np.array_equal(order.first_sample[shard] + pos, full)
        assert np.all((pos >= 0) & (pos < order.shard_sizes[shard]))


@FAST
@given(sizes_st, st.integers(0, 3), st.integers(0, 2**32), st.booleans(), st.integers(1, 5))
def test_order_is_deterministic_and_changes_per_epoch(sizes: list[int], epoch: int, seed: int,
                                                      shuffle: bool, block: int) -> None:
    a = EpochOrder(sizes, epoch, seed, shuffle, block)
    b = EpochOrder(list(sizes), epoch, seed, shuffle, block)
    n = len(a)
    assert np.array_equal(a.indices(0, n), b.indices(0, n))
    assert np.array_equal(pickle.loads(pickle.dumps(a)).indices(0, n), a.indices(0, n))
    if shuffle and n >= 20:
        nxt = EpochOrder(sizes, epoch + 1, seed, shuffle, block)
        other_seed = EpochOrder(sizes, epoch, seed + 1, shuffle, block)
        assert not np.array_equal(nxt.indices(0, n), a.indices(0, n))
        assert not np.array_equal(other_seed.indices(0, n), a.indices(0, n))


def test_order_is_pinned() -> None:
    # G must not change between releases (or numpy versions): a checkpoint stores ranges of
    # G, so a different G after an upgrade would resume onto the wrong samples.
    order = EpochOrder([3, 0, 5, 2, 0, 7], epoch=1, seed=3, shuffle=True, block_shards=2)
    assert order.indices(0, len(order)).tolist() == [
        9, 8, 15, 12, 10, 14, 13, 11, 16, 4, 7, 6, 1, 3, 2, 5, 0]


def test_empty_shards_and_empty_dataset() -> None:
    order = EpochOrder([0, 0, 0], shuffle=True)
    assert len(order) == 0
    assert order.indices(0, 0).size == 0
    assert rank_ranges([(0, 0)], 2, 4) == []
    assert list(worker_schedule(order, [])) == []
    assert schedule_shards(order, []) == []
    assert consumed_remaining([(0, 0)], 4, False, 0) == []
    assert len(EpochOrder([], shuffle=True)) == 0


# --- rank and worker split ----------------------------------------------------------------


@FAST
@given(remaining_lists(), worlds, st.booleans())
def test_rank_ranges_follow_the_spec(remaining: list[tuple[int, int]], world: int,
                                     drop_last: bool) -> None:
    virtual = expand(remaining)
    n = samples_per_rank(remaining, world, drop_last)
    assert n == per_rank(virtual.size, world, drop_last)
    assigned = []
    for rank in range(world):
        got = expand(rank_ranges(remaining, rank, world, drop_last))
        assert got.size == n  # equal counts per rank
        assert np.array_equal(got, rank_reference(virtual, rank, world, drop_last))
        assigned.append(got)
    counts = Counter(np.concatenate(assigned).tolist())
    pad = n * world - virtual.size if not drop_last else 0
    # Ranks never overlap apart from padding, and without drop_last nobody is missed.
    assert sum(c - 1 for c in counts.values()) == max(pad, 0)
    if not drop_last:
        assert set(counts) == set(virtual.tolist())


def test_fewer_samples_than_ranks_pads_every_rank() -> None:
    assert [rank_ranges([(7, 8)], r, 4) for r in range(4)] == [[(7, 8)]] * 4
    assert [rank_ranges([(7, 8)], r, 4, drop_last=True) for r in range(4)] == [[]] * 4
    assert rank_ranges([(0, 10)], 3, 4) == [(9, 10), (0, 2)]


@FAST
@given(remaining_lists(), worlds, st.booleans(), st.integers(1, 4), st.integers(1, 5))
def test_workers_interleave_back_into_the_rank_sequence(remaining: list[tuple[int, int]],
                                                        world: int, drop_last: bool,
                                                        workers: int, chunk: int) -> None:
    for rank in range(world):
        mine = rank_ranges(remaining, rank, world, drop_last)
        streams = [expand(worker_ranges(mine, w, workers, chunk)) for w in range(workers)]
        assert sum(s.size for s in streams) == expand(mine).size
        assert np.array_equal(interleave(streams, chunk), expand(mine))


@FAST
@given(orders, worlds, st.integers(1, 4), st.integers(1, 5), st.booleans())
def test_epoch_coverage_end_to_end(order: EpochOrder, world: int, workers: int, chunk: int,
                                   drop_last: bool) -> None:
    n_total = len(order)
    full = order.indices(0, n_total)
    remaining = [(0, n_total)]
    n = samples_per_rank(remaining, world, drop_last)
    seen = []
    for rank in range(world):
        mine = rank_ranges(remaining, rank, world, drop_last)
        streams = []
        for w in range(workers):
            ranges = worker_ranges(mine, w, workers, chunk)
            samples = schedule_samples(order, ranges)
            runs = list(worker_schedule(order, ranges))
            # Runs are maximal: a shard's next run only starts after another shard's.
            assert all(a[0] != b[0] for a, b in zip(runs, runs[1:]))
            first_need = list(dict.fromkeys(s for s, _ in runs))
            assert schedule_shards(order, ranges) == first_need
            streams.append(samples)
        rank_samples = interleave(streams, chunk)
        assert np.array_equal(rank_samples, order.take(expand(mine)))
        assert rank_samples.size == n
        seen.append(rank_samples)
    everything = np.concatenate(seen)
    if drop_last or n_total % world == 0:
        # Exactly once: the ranks together read G's first n*W samples.
        assert np.array_equal(np.sort(everything), np.sort(full[:n * world]))
        assert len(set(everything.tolist())) == everything.size
    else:
        assert set(everything.tolist()) == set(range(n_total))
        assert everything.size - n_total == n * world - n_total  # only the pad repeats


@FAST
@given(orders, st.data())
def test_schedule_is_independent_of_piece_size(order: EpochOrder, data: st.DataObject) -> None:
    n = len(order)
    ranges = [(min(a, n), min(b, n)) for a, b in data.draw(remaining_lists())]
    piece = data.draw(st.integers(1, 7))
    max_run = data.draw(st.integers(1, 6))
    expected = order.take(expand(ranges)) if ranges else np.zeros(0, np.int64)
    assert np.array_equal(schedule_samples(order, ranges, piece=piece), expected)
    runs = list(worker_schedule(order, ranges, piece=piece, max_run=max_run))
    assert np.array_equal(schedule_samples(order, ranges, piece=piece, max_run=max_run),
                          expected)
    assert all(0 < p.size <= max_run for _, p in runs)
    # Same shard twice in a row only where a run was cut at max_run.
    assert all(a[1].size == max_run for a, b in zip(runs, runs[1:]) if a[0] == b[0])
    assert schedule_shards(order, ranges, piece=piece) == schedule_shards(order, ranges)


# --- resume ---------------------------------------------------------------------------------

stages = st.lists(st.tuples(worlds, st.floats(0, 1), st.booleans()), min_size=1, max_size=3)


@FAST
@given(orders, stages, worlds, st.integers(1, 4), st.integers(1, 5))
def test_elastic_resume_reads_every_sample_once(order: EpochOrder,
                                                plan: list[tuple[int, float, bool]],
                                                final_world: int, workers: int,
                                                chunk: int) -> None:
    n_total = len(order)
    remaining = [(0, n_total)]
    consumed: list[int] = []  # G positions read as real (not padding) work
    padded = False
    for world, fraction, drop_last in plan:
        before = expand(remaining)
        n = samples_per_rank(remaining, world, drop_last)
        k = int(fraction * n)
        stage = np.concatenate([expand(rank_ranges(remaining, r, world, drop_last))[:k]
                                for r in range(world)])
        # Virtual positions at or past R are padding: read, but never remaining work (and
        # never taken away from the rank that owns the original position either).
        virtual = [r * n + i for r in range(world) for i in range(k)]
        real = before[[v for v in virtual if v < before.size]]
        assert np.array_equal(np.sort(stage), np.sort(before[np.array(virtual, int) %
                                                             max(before.size, 1)]))
        pad = 0 if drop_last else n * world - before.size
        padded |= pad > 0
        assert stage.size - len(set(stage.tolist())) <= pad
        remaining = consumed_remaining(remaining, world, drop_last, k)
        after = expand(remaining)
        # "G minus consumed", in G order, merged.
        assert np.array_equal(after, np.array(sorted(set(before.tolist()) -
                                                     set(real.tolist())), np.int64))
        assert all(b < c for (_, b), (c, _) in zip(remaining, remaining[1:]))
        consumed.extend(real.tolist())
    # Finish with another topology (the full pipeline: ranks, workers, run schedules).
    rest = []
    for rank in range(final_world):
        mine = rank_ranges(remaining, rank, final_world)
        streams = [schedule_samples(order, worker_ranges(mine, w, workers, chunk))
                   for w in range(workers)]
        rest.append(interleave(streams, chunk))
    samples = np.concatenate([order.take(np.array(consumed, np.int64))] + rest)
    assert set(samples.tolist()) == set(range(n_total))
    if not padded and expand(remaining).size % final_world == 0:
        assert np.array_equal(np.sort(samples), np.arange(n_total))


@FAST
@given(remaining_lists(), worlds, st.booleans(), st.floats(0, 1))
def test_same_world_resume_continues_exactly(remaining: list[tuple[int, int]], world: int,
                                             drop_last: bool, fraction: float) -> None:
    total = expand(remaining).size
    assume(drop_last or total % world == 0)
    n = samples_per_rank(remaining, world, drop_last)
    k = int(fraction * n)
    after = consumed_remaining(remaining, world, drop_last, k)
    for rank in range(world):
        resumed = expand(rank_ranges(after, rank, world, drop_last))
        assert np.array_equal(resumed, expand(rank_ranges(remaining, rank, world,
                                                          drop_last))[k:])


def test_resume_keeps_the_drop_last_tail_and_drops_padding() -> None:
    assert consumed_remaining([(0, 10)], 4, True, 1) == [(1, 2), (3, 4), (5, 6), (7, 10)]
    # Rank 3 read 9 then the pad repeat of 0; nothing of the padding comes back.
    assert consumed_remaining([(0, 10)], 4, False, 2) == [(2, 3), (5, 6), (8, 9)]
    assert consumed_remaining([(0, 10)], 4, False, 3) == []
    assert consumed_remaining([(0, 4), (6, 9)], 2, False, 0) == [(0, 4), (6, 9)]


def test_consuming_more_than_a_share_is_refused() -> None:
    with pytest.raises(ValueError, match="consumed_per_rank"):
        consumed_remaining([(0, 10)], 4, False, 4)


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: rank_ranges([(0, 4)], 4, 4), "rank"),
        (lambda: rank_ranges([(0, 4)], -1, 4), "rank"),
        (lambda: rank_ranges([(0, 4)], 0, 0), "world_size"),
        (lambda: rank_ranges([(3, 4), (0, 2)], 0, 1), "remaining"),
        (lambda: rank_ranges([(4, 3)], 0, 1), "remaining"),
        (lambda: rank_ranges([(0, 1.5)], 0, 1), "remaining"),
        (lambda: rank_ranges([(0, 1, 2)], 0, 1), "remaining"),
        (lambda: samples_per_rank([(0, 4)], 0), "world_size"),
        (lambda: worker_ranges([(0, 4)], 0, 0), "num_workers"),
        (lambda: worker_ranges([(0, 4)], 2, 2), "worker"),
        (lambda: worker_ranges([(0, 4)], 0, 1, chunk=0), "chunk"),
        (lambda: consumed_remaining([(0, 4)], 0, False, 0), "world_size"),
        (lambda: consumed_remaining([(0, 4)], 1, False, -1), "consumed_per_rank"),
        (lambda: EpochOrder([1, -2, 3]), r"shard_sizes\[1\]"),
        (lambda: EpochOrder([1.5]), "shard_sizes"),
        (lambda: EpochOrder([1], block_shards=0), "block_shards"),
        (lambda: EpochOrder([1], seed=-1), "seed"),
        (lambda: EpochOrder([1], epoch=True), "epoch"),
        (lambda: EpochOrder([5]).indices(2, 6), "stop"),
        (lambda: EpochOrder([5]).shard_of([5]), "global_indices"),
        (lambda: list(worker_schedule(EpochOrder([5]), [(0, 6)])), "ranges"),
    ],
)
def test_bad_arguments_raise_config_error(call, name: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=name) as info:
        call()
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)


# --- scale ----------------------------------------------------------------------------------


def test_twenty_million_samples_without_materialising_them() -> None:
    tracemalloc.start()
    try:
        order = EpochOrder(np.full(20_000, 1_000), epoch=3, seed=11, shuffle=True)
        assert len(order) == 20_000_000
        for k in (0, 3_999_500, 12_345_678, 19_999_000):
            got = order.indices(k, k + 1_000)
            assert got.size == 1_000
            assert np.array_equal(got, order.take(np.arange(k, k + 1_000)))
        # One worker's whole epoch share on a 64-rank job, read through its run schedule.
        mine = rank_ranges([(0, len(order))], 5, 64)
        ranges = worker_ranges(mine, 2, 4, chunk=300)
        read = sum(pos.size for _, pos in worker_schedule(order, ranges))
        assert read == sum(b - a for a, b in ranges) == 78_000  # 260 of the 1,042 chunks
        assert len(schedule_shards(order, ranges)) > 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_topology_in_a_worker_comes_from_the_process_that_pickled_the_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import torch.utils.data

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    carried = pickle.loads(pickle.dumps(FromParent()))  # what a spawned worker unpickles
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert current(parent=carried) == Topology(0, 1, 0, 1)  # not a worker: its own environment
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(id=1, num_workers=2))
    assert current(parent=carried) == Topology(1, 2, 1, 2)
    assert current(0, 4, parent=carried) == Topology(0, 4, 1, 2)  # explicit arguments win
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert current(parent=carried) == Topology(1, 2, 1, 2)  # the rank's main process beats the environment
    carried.pid = -1  # held by a forked worker: not this process's to use
    assert current(parent=carried) == Topology(0, 3, 1, 2)
    assert current(parent=FromParent()) == Topology(0, 3, 1, 2)
