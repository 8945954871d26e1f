"""Planning a pack while its source is still being listed.

A bucket of 20 M objects takes minutes to list even many prefixes at once; a pack that planned
only from the whole listing started no task before it ended, and held every item on the driver
meanwhile. :class:`TaskStream` lists the source on a thread of the driver and feeds the items to
a :class:`~shardkit.packing.plan.Planner`, handing each task to the engine as soon as it is
planned, at most :data:`TASKS_AHEAD` tasks ahead of the engine (the listing waits beyond that).
The driver then holds the items of the tasks planned and not yet handed out, plus what the
source keeps per item to refuse duplicate keys (see
:func:`~shardkit.packing.sources.keys.unique_keys`); figures in benchmarks/RESULTS.md.

The tasks are the plan's whatever the timing: a rerun after a kill lists the same items, plans
the same tasks with the same fingerprints and reuses those already stored.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Union

from shardkit.packing.plan import PackPlan, PlannedTask, Planner
from shardkit.packing.sources.base import SourceItem

__all__ = ["TASKS_AHEAD", "Feed", "TaskStream"]

log = logging.getLogger(__name__)

#: Planned tasks the listing may run ahead of the engine (each holds its items).
TASKS_AHEAD = 4
# How often a blocked producer or consumer looks whether the other side stopped.
_POLL_SECONDS = 0.5
# How long close() waits for the listing thread to stop (a list call in flight finishes first).
_CLOSE_SECONDS = 60.0



@dataclass(frozen=True)
class _Ended:
    """The listing's end, with the plan's totals."""

    num_items: int
    total_bytes: int
    num_tasks: int
    plan_id: str


class TaskStream:
    """A pack's tasks, planned on a thread as the source's items are listed.

    Iterate it (once) for :class:`~shardkit.packing.plan.PlannedTask` in plan order; a listing
    error is raised from the iteration at the point it happened. Once the iteration ended,
    :attr:`num_items`, :attr:`total_bytes`, :attr:`num_tasks` and :attr:`plan_id` are known
    (None before). Always :meth:`close` it (or use it as a context manager).

    Args:
        items: the source's items, in listing order (a generator: it runs on the thread).
        planner: the planner, fresh.
        ahead: planned tasks held at most beyond the one being handed out.
    """

    def __init__(self, items: Iterable[SourceItem], planner: Planner, ahead: int = TASKS_AHEAD) -> None:
        self.planner = planner
        self.num_items: int | None = None
        self.total_bytes: int | None = None
        self.num_tasks: int | None = None
        self.plan_id: str | None = None
        self._queue: queue.Queue[Any] = queue.Queue(max(1, ahead))
        self._stop = threading.Event()
        self._first: list[Any] = []
        self._iterated = False
        self._thread = threading.Thread(target=self._produce, args=(items,), name="shardkit-plan", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the listing thread

    def _put(self, value: Any) -> bool:
        """Queue ``value`` for the consumer; False once the stream was closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(value, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, items: Iterable[SourceItem]) -> None:
        it = iter(items)
        try:
            for item in it:
                for task in self.planner.add(item):
                    if not self._put(task):
                        return
            for task in self.planner.finish():
                if not self._put(task):
                    return
            self._put(_Ended(self.planner.num_items, self.planner.total_bytes, self.planner.num_tasks,
                             self.planner.plan_id))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(exc)
        finally:
            close = getattr(it, "close", None)
            if callable(close):
                close()  # a walk's own threads stop here (a generator closes in its thread)

    # ---------------------------------------------------------------- the consumer

    def _get(self) -> Any:
        while True:
            try:
                return self._queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the listing thread ended without a word") from None

    def _take(self) -> PlannedTask | None:
        """The next task, None at the end; raises the listing's error."""
        got = self._first.pop() if self._first else self._get()
        if isinstance(got, BaseException):
            raise got
        if isinstance(got, _Ended):
            self._ended(got)
            return None
        return got  # type: ignore[no-any-return]

    def _ended(self, end: _Ended) -> None:
        self.num_items, self.total_bytes, self.num_tasks, self.plan_id = (end.num_items, end.total_bytes,
                                                                          end.num_tasks, end.plan_id)

    def prime(self) -> None:
        """Wait until the first task is planned or the listing ended, so that a source that
        does not exist, is empty or fails early raises here (before the pack claims anything).

        Raises:
            SourceError: the listing failed (or any error the source raised).
        """
        if not self._first:
            got = self._get()
            if isinstance(got, BaseException):
                raise got
            self._first.append(got)
            if isinstance(got, _Ended):
                self._ended(got)

    @property
    def done(self) -> bool:
        """Whether the listing ended (the totals and plan id are known)."""
        return self.plan_id is not None

    def __iter__(self) -> Iterator[PlannedTask]:
        """The tasks in plan order, each as soon as it is planned.

        Raises:
            RuntimeError: iterated twice.
            SourceError: the listing failed.
        """
        if self._iterated:
            raise RuntimeError("a TaskStream is iterated once")
        self._iterated = True
        while (task := self._take()) is not None:
            yield task

    def close(self) -> None:
        """Stop the listing (if it still runs) and wait, bounded, for its thread."""
        self._stop.set()
        self._thread.join(_CLOSE_SECONDS)
        if self._thread.is_alive():
            log.warning("the listing thread did not stop within %.0fs (a list call still in flight); left to "
                        "end by itself", _CLOSE_SECONDS)

    def __enter__(self) -> "TaskStream":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


#: What an engine runs: a plan made from a whole listing, or one made as the listing arrives.
#: Both iterate as :class:`~shardkit.packing.plan.PlannedTask` and have ``num_items``,
#: ``total_bytes``, ``num_tasks`` and ``plan_id`` (None on a stream until its listing ended).
Feed = Union[PackPlan, TaskStream]
