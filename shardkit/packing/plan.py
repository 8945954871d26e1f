"""Pack planning: split listed source items into shards and tasks by bytes, as they are listed.

The plan is a pure function of the item list and the options, so shard and fragment names
are known before any byte is written: a rerun recomputes the same plan and skips the tasks
whose output is already complete. It is made online by :class:`Planner`: shards close greedily
in listing order, and tasks group consecutive shards up to a target size that depends only on
the first :data:`PLAN_WINDOW` items, so the first tasks can run while a listing of millions of
objects goes on (:mod:`shardkit.packing.plan_stream`). A source of at most that many items gets
the plan it would get from its whole listing.

Each task carries a fingerprint of the plan up to its last item (the options, every item from
the first to its last, the task size target): a task an earlier run finished is found by it
(:func:`~shardkit.packing.task.completed_task`) without the rest of the listing. ``plan_id``
fingerprints the whole plan to tell a pack that committed from a different one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

import xxhash

from shardkit.format.tar import END_OF_ARCHIVE
from shardkit.packing.sources.base import SourceItem

__all__ = ["PLAN_WINDOW", "PackPlan", "PlannedTask", "Planner", "ShardSpan", "TaskPlan", "make_plan"]

# The number of tasks a plan aims at, so a cluster has parallel work (see Planner).
_TARGET_TASKS = 64
#: Tasks are sized from the first this many items of a listing (all of a smaller one).
PLAN_WINDOW = 10_000


@dataclass(frozen=True)
class ShardSpan:
    """Shard ``shard`` packs items ``[start, stop)`` of the plan's item list."""

    shard: int
    start: int
    stop: int


@dataclass(frozen=True)
class TaskPlan:
    """One pack task: consecutive shards, written by one process.

    Attributes:
        task: its number.
        shards: its shards, in order.
        fingerprint: the plan up to its last item (options, items, task size): recorded in its
            fragment, so a rerun knows the task finished as planned.
    """

    task: int
    shards: tuple[ShardSpan, ...]
    fingerprint: str = ""

    @property
    def start(self) -> int:
        """The task's first item in the plan's item list."""
        return self.shards[0].start

    @property
    def stop(self) -> int:
        """The item after the task's last."""
        return self.shards[-1].stop


@dataclass(frozen=True)
class PlannedTask:
    """A task and its items (``task.start`` to ``task.stop`` of the listing), as engines run it."""

    task: TaskPlan
    items: list[SourceItem]


@dataclass(frozen=True)
class PackPlan:
    """A whole pack, planned from a complete listing.

    Iterating it gives each task with its items, as :class:`~shardkit.packing.plan_stream.TaskStream`
    does while a listing goes on; engines take either.

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

    @property
    def num_items(self) -> int:
        """The items planned."""
        return len(self.items)

    @property
    def num_tasks(self) -> int:
        """The tasks planned."""
        return len(self.tasks)

    def __iter__(self) -> Iterator[PlannedTask]:
        """Each task with its items, in order."""
        return (PlannedTask(t, self.items[t.start:t.stop]) for t in self.tasks)


class Planner:
    """Plans shards and tasks as items are listed: :meth:`add` each item in order, then :meth:`finish`.

    Shards close greedily, in order, before an item that would overflow them (an item's
    ``nbytes`` counts its tar framing, and the shard's end-of-archive blocks are kept free, so a
    shard of two or more samples never exceeds ``shard_bytes``). Tasks group consecutive shards
    up to a target of ``min(task_bytes, max(shard_bytes, window // 64))`` bytes, ``window`` being
    the bytes of the first :data:`PLAN_WINDOW` items: about 64 tasks for a source of at most that
    many items, and at least 64 for a larger one, never fewer bytes than a shard nor more than
    ``task_bytes``. The target depends only on the data and options, never on the number of
    workers, so the local and Ray engines produce the same files. Until it is known (the window
    is listed, or its bytes alone reach 64 tasks of ``task_bytes``), closed shards wait; then a
    task is handed out as soon as the shard after it closes.

    Holds the items of the open task and shard (and, until the target is known, the window's).

    Args:
        shard_bytes: the target shard size.
        shard_samples: also close a shard at this many items (None: no limit).
        task_bytes: the most bytes a task packs.
        options: the other settings that make two plans differ (on_error, transform, source).
        window: the items the task size is decided from (default :data:`PLAN_WINDOW`).
    """

    def __init__(self, *, shard_bytes: int, shard_samples: int | None, task_bytes: int, options: dict[str, Any],
                 window: int | None = None) -> None:
        self.shard_bytes, self.shard_samples, self.task_bytes = shard_bytes, shard_samples, task_bytes
        self.window = window or PLAN_WINDOW
        text = json.dumps({"shard_bytes": shard_bytes, "shard_samples": shard_samples, "task_bytes": task_bytes,
                           **options}, sort_keys=True, default=str).encode()
        self._hash = xxhash.xxh3_128(text)
        #: Fingerprint of the options alone: known before any item (the claim of a streamed pack).
        self.settings_id = xxhash.xxh3_128(b"stream\0" + text).hexdigest()[:16]
        self.num_items = 0
        self.total_bytes = 0
        self.num_tasks = 0
        self._budget = shard_bytes - len(END_OF_ARCHIVE)
        self._target: int | None = None
        self._shard: list[SourceItem] = []
        self._shard_bytes = 0
        self._num_shards = 0
        # Closed shards not yet in a task: (span, items, bytes, plan digest through its last item).
        self._closed: list[tuple[ShardSpan, list[SourceItem], int, str]] = []
        self._task: list[tuple[ShardSpan, list[SourceItem], int, str]] = []
        self._task_bytes = 0
        self._finished = False

    @property
    def target(self) -> int | None:
        """The task size target, once known."""
        return self._target

    @property
    def plan_id(self) -> str:
        """The whole plan's fingerprint (options, every item), once :meth:`finish` ran.

        Raises:
            RuntimeError: the listing is not finished.
        """
        if not self._finished:
            raise RuntimeError("plan_id: the plan is not finished")
        return self._hash.hexdigest()[:16]

    def add(self, item: SourceItem) -> list[PlannedTask]:
        """Plan one more item.

        Args:
            item: the next item of the listing.

        Returns:
            The tasks this completed (often none), in order.
        """
        count = len(self._shard)
        if count and (self._shard_bytes + item.nbytes > self._budget
                      or (self.shard_samples is not None and count >= self.shard_samples)):
            self._close_shard()
        self._shard.append(item)
        self._shard_bytes += item.nbytes
        self.num_items += 1
        self.total_bytes += item.nbytes
        self._hash.update(f"{item.key}\0{item.ref}\0{item.nbytes}\n".encode("utf-8", "surrogateescape"))
        if self._target is None and (self.num_items >= self.window
                                     or self.total_bytes >= self.task_bytes * _TARGET_TASKS):
            self._set_target()
        return self._group() if self._target is not None else []

    def finish(self) -> list[PlannedTask]:
        """End the listing: close the last shard and task.

        Returns:
            The tasks not handed out yet, in order.
        """
        if self._shard:
            self._close_shard()
        if self._target is None:
            self._set_target()
        out = self._group()
        if self._task:
            out.append(self._emit())
        self._finished = True
        return out

    def _set_target(self) -> None:
        self._target = min(self.task_bytes, max(self.shard_bytes, self.total_bytes // _TARGET_TASKS))

    def _close_shard(self) -> None:
        start = self.num_items - len(self._shard)
        span = ShardSpan(self._num_shards, start, self.num_items)
        self._closed.append((span, self._shard, self._shard_bytes, self._hash.hexdigest()))
        self._num_shards += 1
        self._shard, self._shard_bytes = [], 0

    def _group(self) -> list[PlannedTask]:
        """Put the closed shards into tasks; the tasks that closed."""
        out = []
        target = self._target
        assert target is not None
        for shard in self._closed:
            if self._task and self._task_bytes + shard[2] > target:
                out.append(self._emit())
            self._task.append(shard)
            self._task_bytes += shard[2]
        self._closed = []
        return out

    def _emit(self) -> PlannedTask:
        digest = self._task[-1][3]
        fingerprint = xxhash.xxh3_128(f"{digest}\0{self._target}".encode()).hexdigest()[:16]
        task = TaskPlan(self.num_tasks, tuple(s[0] for s in self._task), fingerprint)
        items = [it for s in self._task for it in s[1]]
        self.num_tasks += 1
        self._task, self._task_bytes = [], 0
        return PlannedTask(task, items)


def make_plan(items: list[SourceItem], *, shard_bytes: int, shard_samples: int | None, task_bytes: int,
              options: dict[str, object]) -> PackPlan:
    """Plan a pack from its whole listing: its shards, its tasks and the plan's fingerprint.

    Args:
        items: the source's items, in order.
        shard_bytes: the target shard size.
        shard_samples: also close a shard at this many items (None: no limit).
        task_bytes: the most bytes a task packs.
        options: the other settings that make two plans differ (on_error, transform, source).

    Returns:
        The plan (the same tasks a :class:`Planner` hands out as the items are listed).
    """
    planner = Planner(shard_bytes=shard_bytes, shard_samples=shard_samples, task_bytes=task_bytes,
                      options=dict(options))
    tasks = [p.task for it in items for p in planner.add(it)]
    tasks += [p.task for p in planner.finish()]
    return PackPlan(items, tasks, planner.plan_id, planner.total_bytes)
