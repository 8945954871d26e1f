"""Pack planning: split listed source items into shards and tasks by bytes.

The plan is a pure function of the item list and the options, so shard and fragment names
are known before any byte is written: a rerun recomputes the same plan and skips the tasks
whose output is already complete. ``plan_id`` fingerprints the plan to tell a resumable pack
from a different one aimed at the same destination.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import xxhash

from shardkit.format.tar import END_OF_ARCHIVE
from shardkit.packing.sources.base import SourceItem

__all__ = ["PackPlan", "ShardSpan", "TaskPlan", "make_plan"]

# The number of tasks a plan aims at, so a cluster has parallel work (see _plan_tasks).
_TARGET_TASKS = 64


@dataclass(frozen=True)
class ShardSpan:
    """Shard ``shard`` packs items ``[start, stop)`` of the plan's item list."""

    shard: int
    start: int
    stop: int


@dataclass(frozen=True)
class TaskPlan:
    """One pack task: consecutive shards, written by one process."""

    task: int
    shards: tuple[ShardSpan, ...]

    @property
    def start(self) -> int:
        """The task's first item in the plan's item list."""
        return self.shards[0].start

    @property
    def stop(self) -> int:
        """The item after the task's last."""
        return self.shards[-1].stop


@dataclass(frozen=True)
class PackPlan:
    """A whole pack, decided before any byte is written.

    Attributes:
        items: every item of the source, in order.
        tasks: the tasks, in order; their shards cover the items.
        plan_id: the plan's fingerprint: items, their sizes and the options.
        total_bytes: the items' bytes in shards.
    """

    items: list[SourceItem]
    tasks: list[TaskPlan]
    plan_id: str
    total_bytes: int

    @property
    def num_shards(self) -> int:
        """The shards of all tasks."""
        return sum(len(t.shards) for t in self.tasks)


def _plan_shards(items: list[SourceItem], shard_bytes: int, shard_samples: int | None) -> list[ShardSpan]:
    """Greedy, in order: a shard closes before an item that would overflow it.

    Items' ``nbytes`` count their tar framing; the shard's end-of-archive blocks are kept free
    too, so a shard of two or more samples never exceeds ``shard_bytes``.

    Args:
        items: the source's items, in order.
        shard_bytes: the target shard size.
        shard_samples: also close a shard at this many items (None: no limit).

    Returns:
        The shards, numbered from 0, covering the items in order.
    """
    budget = shard_bytes - len(END_OF_ARCHIVE)
    spans: list[ShardSpan] = []
    start = 0
    size = 0
    for i, item in enumerate(items):
        count = i - start
        if count and (size + item.nbytes > budget or (shard_samples is not None and count >= shard_samples)):
            spans.append(ShardSpan(len(spans), start, i))
            start, size = i, 0
        size += item.nbytes
    if start < len(items):
        spans.append(ShardSpan(len(spans), start, len(items)))
    return spans


def _plan_tasks(items: list[SourceItem], spans: list[ShardSpan], task_bytes: int, shard_bytes: int) -> list[TaskPlan]:
    """Group consecutive shards into tasks of about a target size.

    The target aims at about _TARGET_TASKS tasks so a cluster has parallel work, but never below
    one shard nor above ``task_bytes``. It depends only on the data and options, never on the
    number of workers, so the local and Ray engines produce the same files.

    Args:
        items: the source's items, in order.
        spans: the shards (:func:`_plan_shards`).
        task_bytes: the most bytes a task packs.
        shard_bytes: the target shard size.

    Returns:
        The tasks, numbered from 0, each a run of consecutive shards.
    """
    total = sum(it.nbytes for it in items)
    target = min(task_bytes, max(shard_bytes, total // _TARGET_TASKS))
    tasks: list[TaskPlan] = []
    current: list[ShardSpan] = []
    size = 0
    for span in spans:
        span_bytes = sum(items[i].nbytes for i in range(span.start, span.stop))
        if current and size + span_bytes > target:
            tasks.append(TaskPlan(len(tasks), tuple(current)))
            current, size = [], 0
        current.append(span)
        size += span_bytes
    if current:
        tasks.append(TaskPlan(len(tasks), tuple(current)))
    return tasks


def make_plan(items: list[SourceItem], *, shard_bytes: int, shard_samples: int | None, task_bytes: int,
              options: dict[str, object]) -> PackPlan:
    """Plan a pack: its shards, its tasks and the plan's fingerprint.

    Args:
        items: the source's items, in order.
        shard_bytes: the target shard size.
        shard_samples: also close a shard at this many items (None: no limit).
        task_bytes: the most bytes a task packs.
        options: the other settings that make two plans differ (on_error, transform, source).

    Returns:
        The plan.
    """
    spans = _plan_shards(items, shard_bytes, shard_samples)
    tasks = _plan_tasks(items, spans, task_bytes, shard_bytes)
    h = xxhash.xxh3_128()
    h.update(json.dumps({"shard_bytes": shard_bytes, "shard_samples": shard_samples, "task_bytes": task_bytes,
                         **options}, sort_keys=True, default=str).encode())
    for it in items:
        h.update(f"{it.key}\0{it.ref}\0{it.nbytes}\n".encode("utf-8", "surrogateescape"))
    return PackPlan(items, tasks, h.hexdigest()[:16], sum(it.nbytes for it in items))
