"""Background threads that run a plan of downloads in order, a few at a time, until replaced or closed."""

from __future__ import annotations

import sys
import threading
from typing import Callable, Sequence

__all__ = ["Prefetcher", "MAX_AT_ONCE"]

MAX_AT_ONCE = 8  # downloads one process's prefetch runs at once, at most


class Prefetcher:
    """Runs the jobs of the latest plan in order on daemon threads named ``name``.

    Each job catches its own errors: a job that raises ends its thread's loop.

    Args:
        name: the threads' name.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition()
        self._plan: list[Callable[[], None]] = []
        self._threads: list[threading.Thread] = []
        self._closed = False

    def replace(self, jobs: Sequence[Callable[[], None]], at_once: int) -> None:
        """Drop the jobs of the plan not started yet and plan ``jobs`` instead.

        Args:
            jobs: what to run, in order.
            at_once: threads to run them on (1 to :data:`MAX_AT_ONCE`, and no more than jobs).
        """
        with self._cv:
            if self._closed:
                return
            self._plan = list(jobs)
            self._threads = [t for t in self._threads if t.is_alive()]
            while len(self._threads) < min(max(1, at_once), MAX_AT_ONCE, len(jobs)):
                t = threading.Thread(target=self._loop, name=self._name, daemon=True)
                t.start()
                self._threads.append(t)
            self._cv.notify_all()

    def close(self) -> None:
        """Drop the plan and wait for the jobs running to finish; later plans are ignored."""
        if sys.is_finalizing():
            # An iterator closed at interpreter exit: the daemon threads are frozen by now, maybe
            # holding the condition's lock; taking it or joining them would hang the exit.
            self._closed, self._plan = True, []
            return
        with self._cv:
            self._closed, self._plan = True, []
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._plan and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._plan.pop(0)
            job()
