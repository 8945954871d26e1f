"""Planning as the listing arrives: tasks handed out before the listing ends, the same tasks and
fingerprints as a plan of the whole listing, bounded driver memory per listed item, and a pack
whose first task runs while its source is still being listed."""

from __future__ import annotations

import gc
import json
import threading
import tracemalloc
from typing import Any, Iterator

import pytest

import shardkit
from shardkit.errors import SourceError
from shardkit.packing import plan as planning
from shardkit.packing.plan import Planner, make_plan
from shardkit.packing.plan_stream import TaskStream
from shardkit.packing.sample import PackSample
from shardkit.packing.sources.base import SourceItem
from shardkit.packing.sources.keys import unique_keys


def _items(n: int, start: int = 0, size: int = 1536) -> list[SourceItem]:
    # Uneven sizes, so that shards and tasks close at varied places.
    return [SourceItem(f"r{i:07d}", size + (i * 37) % 1024, f"k{i:07d}") for i in range(start, start + n)]


def _planner(**kw: Any) -> Planner:
    args: dict[str, Any] = {"shard_bytes": 64 * 1024, "shard_samples": None, "task_bytes": 10**9,
                            "options": {"on_error": "raise"}}
    return Planner(**{**args, **kw})


def _reference(items: list[SourceItem], shard_bytes: int, task_bytes: int) -> list[list[tuple[int, int]]]:
    """The plan of a whole listing as shardkit made it before plans streamed: greedy shards,
    tasks grouped to min(task_bytes, max(shard_bytes, total // 64)) bytes."""
    budget = shard_bytes - 1024
    spans: list[tuple[int, int, int]] = []
    start, size = 0, 0
    for i, it in enumerate(items):
        if i > start and size + it.nbytes > budget:
            spans.append((start, i, size))
            start, size = i, 0
        size += it.nbytes
    spans.append((start, len(items), size))
    target = min(task_bytes, max(shard_bytes, sum(it.nbytes for it in items) // 64))
    tasks: list[list[tuple[int, int]]] = [[]]
    total = 0
    for a, b, n in spans:
        if tasks[-1] and total + n > target:
            tasks.append([])
            total = 0
        tasks[-1].append((a, b))
        total += n
    return tasks


def test_a_source_within_the_window_gets_the_plan_of_its_whole_listing():
    """At most PLAN_WINDOW items: the tasks of the whole-listing plan (a resume across versions
    finds the same tasks), whether fed at once or item by item."""
    items = _items(3000)
    plan = make_plan(items, shard_bytes=64 * 1024, shard_samples=None, task_bytes=10**9, options={})
    got = [[(s.start, s.stop) for s in t.shards] for t in plan.tasks]
    assert got == _reference(items, 64 * 1024, 10**9)
    assert len(plan.tasks) > 40 and [s.shard for t in plan.tasks for s in t.shards] == list(range(plan.num_shards))


def test_tasks_are_handed_out_while_the_listing_goes_on_and_match_the_whole_plan(monkeypatch):
    """Past the window, each task comes as soon as the shard after it closed: the first one
    long before the listing ends. The tasks and their fingerprints are those of make_plan."""
    monkeypatch.setattr(planning, "PLAN_WINDOW", 500)
    items = _items(20_000)
    planner = _planner()
    first_at = None
    streamed = []
    for i, it in enumerate(items):
        out = planner.add(it)
        if out and first_at is None:
            first_at = i
        streamed += out
    streamed += planner.finish()
    assert first_at is not None and first_at < 1000, first_at
    plan = make_plan(items, shard_bytes=64 * 1024, shard_samples=None, task_bytes=10**9,
                     options={"on_error": "raise"})
    assert [p.task for p in streamed] == plan.tasks
    assert planner.plan_id == plan.plan_id
    for p in streamed:
        assert p.items == items[p.task.start:p.task.stop]
    # The target comes from the window: 64 tasks of its bytes, so the whole listing gets more.
    window_bytes = sum(it.nbytes for it in items[:500])
    assert planner.target == max(64 * 1024, window_bytes // 64)
    assert len(plan.tasks) > 64 * 10
    assert len({t.fingerprint for t in plan.tasks}) == len(plan.tasks)


def test_a_task_fingerprint_names_the_listing_up_to_its_end(monkeypatch):
    """A task keeps its fingerprint when only later items change (a rerun reuses it), and a
    change before its end, or in the options, changes it."""
    monkeypatch.setattr(planning, "PLAN_WINDOW", 500)
    base = _items(5000)
    grown = base + _items(700, start=5000)
    changed = base[:3000] + [SourceItem("other", 2000, "k9999999")] + base[3001:]

    def tasks(items: list[SourceItem], **kw: Any) -> list[Any]:
        opts = {"on_error": "raise", **kw}
        return make_plan(items, shard_bytes=64 * 1024, shard_samples=None, task_bytes=10**9, options=opts).tasks

    a, b, c = tasks(base), tasks(grown), tasks(changed)
    kept = [t for t in a if t.stop <= 4500]
    assert kept and [t.fingerprint for t in kept] == [t.fingerprint for t in b[:len(kept)]]
    before = [t for t in a if t.stop <= 3000]
    assert [t.fingerprint for t in before] == [t.fingerprint for t in c[:len(before)]]
    assert a[len(before)].fingerprint != c[len(before)].fingerprint
    assert all(x.fingerprint != y.fingerprint for x, y in zip(a, tasks(base, on_error="skip")))


def test_streamed_planning_holds_bounded_bytes_per_item():
    """Keys checked and tasks planned as 100,000 items stream by: the driver's Python heap
    peaks at a few tasks' items plus a key digest per item, far under holding the listing."""
    n = 100_000

    def listing() -> Iterator[SourceItem]:
        for i in range(n):
            yield SourceItem(f"class{i % 100:03d}/img{i:08d}.jpg", 110_000, f"class{i % 100:03d}_img{i:08d}")

    def relist() -> Iterator[SourceItem]:
        return listing()

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        planner = Planner(shard_bytes=32 * 10**6, shard_samples=None, task_bytes=10**9, options={})
        with TaskStream(unique_keys(listing(), "src", relist), planner) as stream:
            count = sum(len(p.items) for p in stream)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert count == n and stream.num_items == n and stream.plan_id
    # A listed SourceItem with its ref and key takes ~200 bytes, a set of the keys ~100 more, a
    # set of 64-bit digests ~65: what stays is 8 bytes of digest per item, plus a few tasks' items.
    assert peak / n < 60, f"{peak / n:.0f} bytes per item at the peak"


def test_digest_set_flags_exactly_the_repeats():
    """Batches of digests with repeats within and across batches: the mask is a set's answer."""
    import numpy as np

    from shardkit.packing.sources.keys import DigestSet

    rng = np.random.default_rng(1)
    pool = rng.integers(0, 2**63, 5000, dtype=np.uint64)
    digests = DigestSet()
    reference: set[int] = set()
    for size in [1, 7, 300, 1000, 1000, 64, 2500, 0, 4000]:
        batch = rng.choice(pool, size).astype(np.uint64)
        expected = []
        for d in batch.tolist():
            expected.append(d in reference)
            reference.add(d)
        assert digests.add(batch).tolist() == expected
    assert len(digests) == len(reference)


def test_duplicate_keys_in_a_stream_are_named_with_both_inputs():
    items = [SourceItem("a/x.jpg", 10, "a_x"), SourceItem("b.jpg", 10, "b"), SourceItem("a_x.jpg", 10, "a_x")]
    with pytest.raises(SourceError, match=r"duplicate key 'a_x' in src: a/x.jpg and a_x.jpg"):
        list(unique_keys(items, "src", lambda: items))


class _HeldListing:
    """A source that lists ``n`` items, but past ``hold_at`` only once item ``wait_for`` was
    loaded: a packer that waited for the whole listing before its first task would wait for
    ever (the listing gives up after a minute, failing the pack). With ``fail``, the listing
    fails there once that item was loaded."""

    def __init__(self, n: int, hold_at: int = -1, wait_for: int = 0, fail: bool = False) -> None:
        self.n, self.hold_at, self.fail = n, hold_at, fail
        self.wait_key = f"s{wait_for:05d}"
        self.loaded = threading.Event()
        self.listed_at_first_load: int | None = None
        self.listed = 0

    def _item(self, i: int) -> SourceItem:
        return SourceItem(f"s{i:05d}", 2048, f"s{i:05d}")

    def iter_items(self) -> Iterator[SourceItem]:
        for i in range(self.n):
            if i == self.hold_at:
                if not self.loaded.wait(60):
                    raise SourceError(f"listing held at item {i}: {self.wait_key} was not loaded meanwhile")
                if self.fail:
                    raise SourceError(f"listing failed at item {i}")
            self.listed = i + 1
            yield self._item(i)

    def list_items(self) -> list[SourceItem]:
        return [self._item(i) for i in range(self.n)]

    def load(self, item: SourceItem) -> PackSample:
        if self.listed_at_first_load is None:
            self.listed_at_first_load = self.listed
        if item.key == self.wait_key:
            self.loaded.set()
        return PackSample(item.key, {"bin": item.key.encode() * 3}, {})

    def describe(self) -> dict[str, Any]:
        return {"type": "held", "n": self.n}

    def labels(self) -> None:
        return None


class _WholeListing:
    """The same source without ``iter_items``: planned from its whole listing."""

    def __init__(self, inner: _HeldListing) -> None:
        self.inner = inner

    def list_items(self) -> list[SourceItem]:
        return self.inner.list_items()

    def load(self, item: SourceItem) -> PackSample:
        return self.inner.load(item)

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()

    def labels(self) -> None:
        return None


def _shards(root: Any) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / "shards").iterdir())}


def test_pack_runs_its_first_task_while_the_source_is_still_listed(tmp_path, monkeypatch):
    """The source's listing stops halfway until a sample is loaded: the pack only completes if
    its first task ran before the listing ended. The dataset equals the pack of the same items
    planned from the whole listing, and a rerun finds it up to date."""
    monkeypatch.setattr(planning, "PLAN_WINDOW", 100)
    kw: dict[str, Any] = {"shard_samples": 10, "task_bytes": "1", "progress": False}
    src = _HeldListing(n=600, hold_at=400, wait_for=0)
    info = shardkit.pack(src, str(tmp_path / "streamed"), **kw)
    assert info["num_samples"] == 600 and info["tasks"] == 60
    assert src.listed_at_first_load is not None and src.listed_at_first_load <= 400
    whole = shardkit.pack(_WholeListing(_HeldListing(n=600)), str(tmp_path / "whole"), **kw)
    assert _shards(tmp_path / "streamed") == _shards(tmp_path / "whole")
    assert info["pack"]["fingerprint"] == whole["pack"]["fingerprint"]
    again = shardkit.pack(_HeldListing(n=600), str(tmp_path / "streamed"), **kw)
    assert again.get("up_to_date") is True


def test_a_listing_that_fails_midway_fails_the_pack_and_a_rerun_resumes(tmp_path, monkeypatch):
    """A listing error after tasks ran: the pack fails naming it, commits nothing, and the rerun
    (the listing fixed) reuses the tasks done and ends as an uninterrupted pack."""
    monkeypatch.setattr(planning, "PLAN_WINDOW", 100)
    kw: dict[str, Any] = {"shard_samples": 10, "task_bytes": "1", "progress": False}
    dest = tmp_path / "ds"
    with pytest.raises(SourceError, match="listing failed at item 450"):
        shardkit.pack(_HeldListing(n=600, hold_at=450, wait_for=300, fail=True), str(dest), **kw)
    assert not (dest / "dataset.json").exists() and (dest / "manifest").exists()
    info = shardkit.pack(_HeldListing(n=600), str(dest), **kw)
    assert 30 <= info["reused_tasks"] < info["tasks"] == 60
    clean = shardkit.pack(_HeldListing(n=600), str(tmp_path / "clean"), **kw)
    assert _shards(dest) == _shards(tmp_path / "clean")
    assert info["pack"] == clean["pack"]
