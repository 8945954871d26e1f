"""A progress bar for long work (tqdm), that callers can turn off.

Shows items, MB/s and tasks done; ETA comes from tqdm when the total is known. Writes to
stderr so ``--json`` output on stdout stays clean.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """A tqdm bar counting samples, with the rate and tasks done after it; a context manager.

    Args:
        total_items: the samples expected (None: unknown, no ETA).
        total_bytes: the bytes expected (unused: the bar counts samples).
        total_tasks: the tasks expected (None: not known yet, see :meth:`set_totals`).
        desc: the bar's label.
        enabled: show it (False: every call does nothing visible).
    """

    def __init__(self, total_items: int | None, total_bytes: int | None, total_tasks: int | None, desc: str,
                 enabled: bool = True) -> None:
        self.total_tasks = total_tasks
        self.tasks_done = 0
        self.bytes = 0
        self.items = 0
        self.started = time.monotonic()
        self._bar = tqdm(total=total_items, desc=desc, unit="sample", file=sys.stderr, dynamic_ncols=True,
                         disable=not enabled or None, mininterval=0.5)
        self._last_postfix = 0.0

    def advance(self, items: int, nbytes: int) -> None:
        """Count ``items`` more samples of ``nbytes`` bytes.

        Args:
            items: samples done.
            nbytes: their bytes.
        """
        self.items += items
        self.bytes += nbytes
        self._bar.update(items)
        now = time.monotonic()
        if now - self._last_postfix > 0.5:
            self._postfix(now)

    def set_totals(self, items: int | None, tasks: int | None) -> None:
        """The totals, once known (a listing that ended while the work ran); None leaves one as it is.

        Args:
            items: the samples expected.
            tasks: the tasks expected.
        """
        if items is not None and self._bar.total != items:
            self._bar.total = items
            self._bar.refresh()
        if tasks is not None:
            self.total_tasks = tasks

    def task_done(self) -> None:
        """Count one more task done."""
        self.tasks_done += 1
        self._postfix(time.monotonic())

    def _postfix(self, now: float) -> None:
        self._last_postfix = now
        rate = self.bytes / max(now - self.started, 1e-9) / 1e6
        of = "?" if self.total_tasks is None else self.total_tasks
        self._bar.set_postfix_str(f"{rate:.1f} MB/s, tasks {self.tasks_done}/{of}", refresh=False)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *_: Any) -> None:
        self._bar.close()
