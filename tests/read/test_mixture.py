"""Properties of shardkit.read.mixture over many (weights, sizes, world, workers, epochs): pure, no I/O."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.errors import ConfigError
from shardkit.read.mixture import (MixtureOrder, Share, Stage, allocate, consumed_ranges, mixture_counts,
                                   positions_of, rest_counts)
from shardkit.read.partition import consumed_remaining, rank_ranges, worker_ranges

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shard_lists = st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(lambda s: sum(s) > 0)
mixtures = st.lists(shard_lists, min_size=1, max_size=4)
weights_st = st.floats(0.05, 10.0, allow_nan=False)
orders = st.fixed_dictionaries({"epoch": st.integers(0, 5), "seed": st.integers(0, 2**64 - 1),
                                "shuffle": st.booleans(), "block_shards": st.integers(1, 3)})


def pairs(m: MixtureOrder, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (stream, sample) pairs at the positions of ``ranges``, in order."""
    out: list[tuple[int, int]] = []
    for pos in positions_of(ranges, piece=7):  # a small piece: the chunked paths are walked too
        s, x = m.take(pos)
        out.extend(zip(s.tolist(), x.tolist()))
    return out


def everything(m: MixtureOrder) -> list[tuple[int, int]]:
    return pairs(m, [(0, len(m))])


@FAST
@given(mixtures, st.lists(weights_st, min_size=4, max_size=4), st.none() | st.integers(0, 80), orders)
def test_each_stream_gets_its_weight_within_one_sample(sizes, ws, epoch_size, opts):
    ws = ws[:len(sizes)]
    n = [sum(s) for s in sizes]
    counts = mixture_counts(n, [Share(weight=w) for w in ws], epoch_size)
    total = sum(n) if epoch_size is None else epoch_size
    assert sum(counts) == total
    for c, w in zip(counts, ws):
        exact = Fraction(total) * Fraction(w) / sum(Fraction(x) for x in ws)
        assert abs(c - exact) < 1
    m = MixtureOrder(sizes, counts, **opts)
    got = Counter(s for s, _ in everything(m))
    assert [got[i] for i in range(len(sizes))] == counts
    # Fine grain: every prefix holds each stream's share within (streams + 1) samples, so the
    # streams interleave instead of following each other.
    streams = np.array([s for s, _ in everything(m)], np.int64)
    for i, c in enumerate(counts):
        prefix = np.cumsum(streams == i)
        ideal = np.arange(1, len(streams) + 1) * c / max(1, len(streams))
        assert np.all(np.abs(prefix - ideal) < len(sizes) + 1)


@FAST
@given(mixtures, st.lists(st.one_of(st.floats(0, 3.5), st.none()), min_size=4, max_size=4), orders)
def test_repeat_gives_each_sample_floor_or_ceil_times(sizes, repeats, opts):
    n = [sum(s) for s in sizes]
    shares = [Share(repeat=r) for r in repeats[:len(sizes)]]
    counts = mixture_counts(n, shares)
    m = MixtureOrder(sizes, counts, **opts)
    seen = Counter(everything(m))
    for i, (share, size) in enumerate(zip(shares, n)):
        r = 1.0 if share.repeat is None else share.repeat
        assert counts[i] == int(np.floor(r * size + 0.5))
        times = [seen[(i, x)] for x in range(size)]
        lo, hi = counts[i] // size, -(-counts[i] // size)
        assert all(lo <= t <= hi for t in times), (r, size, times)
        assert sum(times) == counts[i]


@FAST
@given(mixtures, st.lists(st.integers(0, 30), min_size=4, max_size=4), orders)
def test_choose_gives_exact_counts(sizes, chooses, opts):
    n = [sum(s) for s in sizes]
    counts = mixture_counts(n, [Share(choose=c) for c in chooses[:len(sizes)]])
    assert counts == chooses[:len(sizes)]
    m = MixtureOrder(sizes, counts, **opts)
    assert Counter(s for s, _ in everything(m)) == Counter({i: c for i, c in enumerate(counts) if c})


@FAST
@given(mixtures, st.lists(weights_st, min_size=4, max_size=4), orders, st.integers(1, 6), st.integers(1, 3),
       st.integers(1, 4), st.booleans())
def test_ranks_and_workers_split_m_exactly(sizes, ws, opts, world, workers, chunk, drop_last):
    counts = mixture_counts([sum(s) for s in sizes], [Share(weight=w) for w in ws[:len(sizes)]])
    m = MixtureOrder(sizes, counts, **opts)
    per_rank = []
    union: list[tuple[int, int]] = []
    for r in range(world):
        mine = rank_ranges([(0, len(m))], r, world, drop_last)
        got = []
        for w in range(workers):
            got.extend(pairs(m, worker_ranges(mine, w, workers, chunk)))
        per_rank.append(len(got))
        assert Counter(got) == Counter(pairs(m, mine))
        union.extend(got)
    assert len(set(per_rank)) == 1  # equal counts per rank
    if drop_last:  # no padding: no overlap, and everything but the tail
        assert len(union) == len(m) // world * world
        assert Counter(union) <= Counter(everything(m))
    else:
        assert Counter(everything(m)) <= Counter(union)


@FAST
@given(mixtures, st.lists(weights_st, min_size=4, max_size=4), orders)
def test_deterministic_from_seed_and_epoch(sizes, ws, opts):
    counts = mixture_counts([sum(s) for s in sizes], [Share(weight=w) for w in ws[:len(sizes)]])
    a = everything(MixtureOrder(sizes, counts, **opts))
    b = everything(MixtureOrder(sizes, counts, **opts))
    assert a == b
    whole = MixtureOrder(sizes, counts, **opts)
    s, x = whole.take(np.arange(len(whole))[::-1])  # any access order gives the same items
    assert list(zip(s.tolist(), x.tolist())) == a[::-1]


def test_epochs_and_seeds_change_the_order():
    sizes = [[50, 50], [40, 30], [20]]
    counts = mixture_counts([100, 70, 20], [Share(weight=1), Share(weight=1), Share(weight=1)])
    base = everything(MixtureOrder(sizes, counts, epoch=0, seed=1))
    assert everything(MixtureOrder(sizes, counts, epoch=1, seed=1)) != base
    assert everything(MixtureOrder(sizes, counts, epoch=0, seed=2)) != base
    assert Counter(everything(MixtureOrder(sizes, counts, epoch=1, seed=1))) != Counter()


@FAST
@given(mixtures, st.lists(weights_st, min_size=4, max_size=4), orders, st.integers(1, 6), st.integers(1, 6),
       st.integers(1, 3), st.data())
def test_elastic_resume_covers_the_epoch_exactly(sizes, ws, opts, world1, world2, workers, data):
    counts = mixture_counts([sum(s) for s in sizes], [Share(weight=w) for w in ws[:len(sizes)]])
    m = MixtureOrder(sizes, counts, **opts)
    full = [(0, len(m))]
    share = -(-len(m) // world1)
    k = data.draw(st.integers(0, share))
    # Consumed: the first k of each rank's share; a padding repeat (virtual position past the
    # epoch) is no reading of its sample, which stays remaining work.
    consumed = {v for r in range(world1) for v in range(r * share, r * share + k) if v < len(m)}
    left = consumed_remaining(full, world1, False, k)
    rest = [p for r in range(world2) for w in range(workers)
            for a, b in worker_ranges(rank_ranges(left, r, world2), w, workers) for p in range(a, b)]
    assert consumed.isdisjoint(p for a, b in left for p in range(a, b))
    assert consumed | set(rest) == set(range(len(m)))
    # Without padding (drop_last on the resumed world, whole shares) each position once.
    dropped = [p for r in range(world2) for a, b in rank_ranges(left, r, world2, True) for p in range(a, b)]
    assert len(dropped) == len(set(dropped))


@FAST
@given(mixtures, st.lists(weights_st, min_size=4, max_size=4), st.lists(weights_st, min_size=4, max_size=4),
       orders, st.integers(1, 5), st.integers(1, 5), st.data())
def test_resume_with_changed_weights_never_repeats_a_seen_sample(sizes, ws1, ws2, opts, world1, world2, data):
    n = [sum(s) for s in sizes]
    old = [Share(weight=w) for w in ws1[:len(sizes)]]
    new = [Share(weight=w) for w in ws2[:len(sizes)]]
    m0 = MixtureOrder(sizes, mixture_counts(n, old), **opts)
    k = data.draw(st.integers(0, len(m0) // world1))
    left0 = consumed_remaining([(0, len(m0))], world1, True, k)
    seen0 = set(pairs(m0, consumed_ranges(left0, len(m0))))
    history = [Stage(tuple(m0.counts), tuple(left0))]
    given_ = m0.given(consumed_ranges(left0, len(m0)))
    unseen = [size - sum(1 for s, _ in seen0 if s == i) for i, size in enumerate(n)]
    counts1 = rest_counts(n, new, None, given_, unseen)
    m1 = MixtureOrder(sizes, counts1, history=history, **opts)
    rest = everything(m1)
    assert seen0.isdisjoint(rest)
    assert len(rest) == len(set(rest))  # never a repeat within the epoch
    assert sum(counts1) == min(len(m0) - sum(given_), sum(unseen))
    # The new weights hold for the rest as far as unseen samples allow: a stream below its
    # exact share (by more than the rounding) has given all its unseen samples.
    total = sum(counts1)
    wsum = sum(Fraction(w.weight) for w in new)  # type: ignore[arg-type]
    for i, c in enumerate(counts1):
        exact = total * Fraction(new[i].weight) / wsum  # type: ignore[arg-type]
        assert c > exact - 1 or c == unseen[i]
    # A second change, resumed with another world: still nothing seen comes back.
    k1 = data.draw(st.integers(0, len(m1) // world2))
    left1 = consumed_remaining([(0, len(m1))], world2, True, k1)
    seen1 = seen0 | set(pairs(m1, consumed_ranges(left1, len(m1))))
    given2 = [a + b for a, b in zip(given_, m1.given(consumed_ranges(left1, len(m1))))]
    unseen2 = [size - sum(1 for s, _ in seen1 if s == i) for i, size in enumerate(n)]
    counts2 = rest_counts(n, old, None, given2, unseen2)
    m2 = MixtureOrder(sizes, counts2, history=history + [Stage(tuple(counts1), tuple(left1))], **opts)
    rest2 = everything(m2)
    assert seen1.isdisjoint(rest2) and len(rest2) == len(set(rest2))
    assert [sum(m2.seen_before()[i]) for i in range(len(n))] == [n[i] - unseen2[i] for i in range(len(n))]


def test_allocate_caps_redistribute_by_weight():
    assert allocate(10, [1, 1, 2], caps=[100, 1, 100]) == [3, 1, 6]
    assert allocate(10, [1, 1], caps=[2, 3]) == [2, 3]
    assert allocate(7, [1, 1, 1]) == [3, 2, 2]


def test_bad_options_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="at most one of weight, repeat, choose"):
        Share(weight=1, repeat=2)
    with pytest.raises(ConfigError, match="every stream a weight, or none"):
        mixture_counts([3, 4], [Share(weight=1), Share(repeat=2)])
    with pytest.raises(ConfigError, match="repeat must be a finite number"):
        Share(repeat=-1)
    with pytest.raises(ConfigError, match="positive sum"):
        mixture_counts([3, 4], [Share(weight=0), Share(weight=0)])
    with pytest.raises(ConfigError, match="Stream 1 has no samples"):
        mixture_counts([3, 0], [Share(), Share(choose=2)])


def test_a_large_mixture_is_generated_in_pieces():
    sizes = [np.full(200, 5000), np.full(50, 2000), np.full(10, 1000)]
    counts = mixture_counts([10**6, 10**5, 10**4], [Share(weight=0.6), Share(weight=0.3), Share(weight=0.1)])
    m = MixtureOrder(sizes, counts, seed=7)
    s, x = m.take(np.arange(500_000, 500_010))
    assert len(m) == sum(counts) and s.size == 10
    assert set(s.tolist()) <= {0, 1, 2}
