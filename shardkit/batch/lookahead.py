"""The run stream one reader consumes, with a window of upcoming runs.

A *run* is ``(shard, positions)``: samples of one shard that a reader takes in order. The
window tells the shard source which shards come next, so it keeps prefetching them and keeps
open (pinned) the shards a batch still needs.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Sequence

from shardkit.read.shard_source import Run, ShardSource

__all__ = ["LOOKAHEAD", "Later", "Lookahead"]

LOOKAHEAD = 256  # runs looked ahead: which shards to keep open, what to read ahead


class Lookahead:
    """The run stream with a window of upcoming runs (``buf``), telling the source which
    shards come next in need order so it keeps prefetching.

    Args:
        runs: the reader's runs, in order.
        size: runs kept in the window.
        source: the shard source the runs are read from.
        sched: the reader's shards in the order it first needs them.
    """

    def __init__(self, runs: Iterator[Run], size: int, source: ShardSource, sched: Sequence[int]) -> None:
        self.runs, self.size, self.source = runs, size, source
        self.buf: deque[Run] = deque()
        self.sched, self.cursor, self.seen = sched, 0, set[int]()

    def pop(self) -> Run | None:
        """The next run (None at the end), moving the source's prefetch plan on at each new shard.

        Returns:
            The next run, or None when the stream is exhausted.
        """
        buf = self.buf
        while len(buf) < self.size:
            nxt = next(self.runs, None)
            if nxt is None:
                break
            buf.append(nxt)
        if not buf:
            return None
        run = buf.popleft()
        if run[0] not in self.seen:  # first need of a shard: move the prefetch plan on
            self.seen.add(run[0])
            while self.cursor < len(self.sched) and self.sched[self.cursor] in self.seen:
                self.cursor += 1
            self.source.advance(self.sched[self.cursor:self.cursor + self.source.prefetch + self.source.max_open])
        return run

    def fewer_than(self, k: int) -> bool:
        """Whether the runs not popped yet hold fewer than ``k`` samples.

        Reads ahead in the run stream (pure partition arithmetic) only as far as that takes;
        opens nothing.

        Args:
            k: a sample count.

        Returns:
            True when fewer than ``k`` samples remain.
        """
        have = 0
        for _, p in self.buf:
            have += len(p)
            if have >= k:
                return False
        while have < k and (nxt := next(self.runs, None)) is not None:
            self.buf.append(nxt)
            have += len(nxt[1])
        return have < k


class Later(Sequence[Run]):
    """The runs after piece ``i`` of a batch, built only if the source asks.

    Args:
        pieces: the batch's runs.
        i: the first piece still to come.
        carry: the rest of the batch's last run, if any.
        runs: the stream the batch was cut from (its window follows).
    """

    def __init__(self, pieces: list[Run], i: int, carry: Run | None, runs: Lookahead) -> None:
        self.args = (pieces, i, carry, runs)
        self._list: list[Run] | None = None

    def _get(self) -> list[Run]:
        if self._list is None:
            pieces, i, carry, runs = self.args
            self._list = pieces[i:] + ([carry] if carry is not None else []) + list(runs.buf)
        return self._list

    def __len__(self) -> int:
        return len(self._get())

    def __getitem__(self, i: Any) -> Any:
        """A run, or a list of runs for a slice."""
        return self._get()[i]

    def __iter__(self) -> Iterator[Run]:
        """The runs in order."""
        return iter(self._get())
