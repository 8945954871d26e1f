"""shardkit.util.lru.LRU: the one least-recently-used map (pure; no processes, no I/O)."""

from __future__ import annotations

import pytest

from shardkit.util.lru import LRU


def test_a_count_limit_drops_the_least_recently_used_first() -> None:
    lru: LRU[str, int] = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # now the most recent
    lru.put("c", 3)
    assert list(lru) == ["a", "c"] and "b" not in lru and len(lru) == 2
    assert lru.values() == [1, 3]  # least recently used first
    assert lru.total == 2  # one each without a cost function


def test_peek_reads_without_making_the_entry_recent() -> None:
    lru: LRU[str, int] = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.peek("a") == 1 and lru.peek("zz", -1) == -1
    lru.put("c", 3)
    assert list(lru) == ["b", "c"]
    assert lru.get("a") is None and lru.get("a", 7) == 7


def test_a_cost_bounds_the_summed_weight() -> None:
    lru: LRU[str, bytes] = LRU(10, cost=len)
    lru.put("a", b"x" * 4)
    lru.put("b", b"x" * 4)
    assert lru.total == 8
    lru.put("c", b"x" * 4)  # 12 > 10: the oldest goes
    assert list(lru) == ["b", "c"] and lru.total == 8
    lru.put("b", b"x" * 9)  # replacing a value re-weighs it, and makes it the most recent
    assert list(lru) == ["b"] and lru.total == 9
    lru.put("d", b"x" * 11)  # heavier than the whole limit: kept by nobody
    assert list(lru) == [] and lru.total == 0


def test_on_evict_sees_dropped_values_not_popped_or_cleared_ones() -> None:
    dropped: list[int] = []
    lru: LRU[str, int] = LRU(1, on_evict=dropped.append)
    lru.put("a", 1)
    lru.put("b", 2)
    assert dropped == [1]
    assert lru.pop("b") == 2 and lru.pop("b", -1) == -1 and lru.total == 0
    lru.put("c", 3)
    lru.clear()
    assert dropped == [1] and len(lru) == 0 and lru.total == 0


def test_limit_zero_keeps_nothing_unless_the_newest_is_kept() -> None:
    plain: LRU[str, int] = LRU(0)
    plain.put("a", 1)
    assert len(plain) == 0
    newest: LRU[str, bytes] = LRU(0, cost=len, keep_newest=True)
    newest.put("a", b"xx")
    newest.put("b", b"xxx")
    assert list(newest) == ["b"] and newest.total == 3  # past the limit, alone: it stays


def test_keep_newest_still_drops_the_others_beyond_the_limit() -> None:
    lru: LRU[str, bytes] = LRU(5, cost=len, keep_newest=True)
    lru.put("a", b"xx")
    lru.put("b", b"xx")
    assert list(lru) == ["a", "b"]
    lru.put("c", b"x" * 8)
    assert list(lru) == ["c"]
    lru.put("d", b"x")
    assert list(lru) == ["d"]  # "c" alone was past the limit; beside "d" it goes


def test_a_changed_limit_applies_from_the_next_put() -> None:
    lru: LRU[int, int] = LRU(4)
    for k in range(4):
        lru.put(k, k)
    lru.limit = 2
    assert len(lru) == 4  # nothing dropped until something is put
    lru.put(0, 0)  # an existing key counts as a put too
    assert list(lru) == [3, 0]


def test_iteration_is_a_snapshot_of_the_keys() -> None:
    lru: LRU[int, int] = LRU(3)
    for k in range(3):
        lru.put(k, k)
    for k in lru:  # dropping while iterating is allowed
        lru.pop(k)
    assert len(lru) == 0


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="limit"):
        LRU(-1)
