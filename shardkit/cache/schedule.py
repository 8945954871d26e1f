"""One process's future need order of shards: what eviction keeps longest and a prefetch leaves room for."""

from __future__ import annotations

import bisect
import threading
from typing import Iterable, Sequence

__all__ = ["Schedule"]


class Schedule:
    """The order in which this process will need cached files (repeats allowed), and a cursor.

    Positions before the cursor are past; the one at it is the file last opened, still in use
    (a reader opens its shard again at every batch when the cache is tight). Thread-safe.
    """

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._positions: dict[str, list[int]] = {}  # file -> its positions in the schedule
        self._files: list[str] = []  # the schedule in order
        self._sizes: dict[str, int] = {}
        self._cursor = 0

    def set(self, files: Sequence[str], sizes: Sequence[int] | None = None) -> None:
        """Replace the schedule; the cursor goes back to 0.

        Args:
            files: file names in need order, repeats allowed.
            sizes: their sizes, if known.
        """
        positions: dict[str, list[int]] = {}
        for i, file in enumerate(files):
            positions.setdefault(file, []).append(i)
        with self._mu:
            self._positions, self._cursor, self._files = positions, 0, list(files)
            self._sizes = {} if sizes is None else dict(zip(files, sizes))

    def opened(self, file: str) -> None:
        """Move the cursor to the next position of a file being opened (if it is scheduled).

        Args:
            file: the file name.
        """
        with self._mu:
            nxt = self._next_use(file)
            if nxt is not None:
                self._cursor = nxt

    def next_uses(self, files: Iterable[str], file: str) -> tuple[dict[str, int | None], int | None]:
        """Next positions, all read at one instant.

        Args:
            files: file names.
            file: one more.

        Returns:
            The next position of each of ``files``, and of ``file`` (None: not needed again).
        """
        with self._mu:
            return {f: self._next_use(f) for f in files}, self._next_use(file)

    def before(self, file: str) -> list[tuple[str, int]]:
        """The files needed before a file.

        Args:
            file: the file name.

        Returns:
            The files from the cursor up to ``file``'s next use, in order, with their sizes (0
            when unknown); none when ``file`` is not scheduled.
        """
        with self._mu:
            mine = self._next_use(file)
            if mine is None:
                return []
            return [(f, self._sizes.get(f, 0)) for f in self._files[self._cursor:mine]]

    def _next_use(self, file: str) -> int | None:
        positions = self._positions.get(file, [])
        k = bisect.bisect_left(positions, self._cursor)
        return positions[k] if k < len(positions) else None
