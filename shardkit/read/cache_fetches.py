"""The node-cache side of a reader's :class:`~shardkit.read.shard_source.ShardSource`: the prefetch
plan it keeps moving as the reader goes, and the references its downloads are made from.

A streaming source (``stream``: samples are read as their shard lands, see
:mod:`shardkit.cache.streamed`) fetches only its first shard until its first samples are out
(the reader asks for the next ones): the bytes of a first batch then have the link, and the
cores, to themselves.
"""

from __future__ import annotations

from typing import Any, Sequence

from shardkit.cache.shard_cache import ShardCache, ShardRef
from shardkit.read.cache_refs import shard_ref
from shardkit.read.dataset import Dataset
from shardkit.read.rows import ShardRows
from shardkit.storage import ranged
from shardkit.storage.store import Store

__all__ = ["CacheFetches"]


class CacheFetches:
    """Cache downloads of a ShardSource (a base class: the source sets the attributes below)."""

    ds: Dataset
    store: Store
    cache: ShardCache | None
    prefetch: int
    landing: bool
    at_once: int
    stream: bool
    _held: dict[Any, Any]
    _head_start: bool
    _first_in: bool
    _upcoming: Sequence[int]

    def rows(self, shard: int) -> ShardRows:  # pragma: no cover - ShardSource defines it
        """The manifest rows of ``shard``.

        Args:
            shard: the shard id.

        Returns:
            Its rows.
        """
        raise NotImplementedError

    def fetch(self, ref: ShardRef) -> ranged.RangeReader:  # pragma: no cover - ShardSource defines it
        """The reader the cache downloads ``ref`` with.

        Args:
            ref: the shard.

        Returns:
            A new reader of the shard's object.
        """
        raise NotImplementedError

    def plan(self, shards: Sequence[int]) -> None:
        """Tell the cache the future order, and start fetching the first shards (no-op
        without a cache). A streaming source fetches only the first until the reader's first
        samples are out (see :meth:`started`).

        Args:
            shards: the shard ids this reader needs, in need order.
        """
        if self.cache is None:
            return
        infos = self.ds.shard_list
        self.cache.set_schedule([infos[s].path for s in shards], [infos[s].bytes for s in shards])
        self._head_start = self.stream
        self._prefetch(shards, 1 if self._head_start else self.prefetch)
        self._upcoming = shards

    def advance(self, upcoming: Sequence[int]) -> None:
        """Keep prefetching the next shards (in need order) as the reader moves on.

        Args:
            upcoming: the shard ids needed next, in need order; the first ``prefetch`` of
                them not held already are fetched into the cache in the background (once the
                reader's first samples are out, for a streaming source).
        """
        self._upcoming = upcoming
        if not self._head_start:
            self._prefetch(upcoming, self.prefetch)

    def _prefetch(self, upcoming: Sequence[int], ahead: int) -> None:
        """Fetch the first ``ahead`` shards of ``upcoming`` not held, in the background."""
        if not self.prefetch or not upcoming or self.cache is None:
            return
        todo = [self._ref(s) for s in [s for s in upcoming if s not in self._held][:ahead]]
        if todo:
            self.cache.prefetch(todo, self.fetch, max_ahead=self.prefetch, landing=self.landing, at_once=self.at_once)

    def started(self) -> None:
        """The reader's first samples are out: fetch ahead as planned (see :meth:`plan`).
        ShardSource calls it when the reader asks for more after its first samples."""
        if self._head_start:
            self._head_start = False
            self.advance(self._upcoming)

    def _ref(self, shard: int) -> ShardRef:
        """The cache's reference of ``shard``, with its samples when the source streams."""
        info = self.ds.shard_list[shard]
        return shard_ref(info, self.rows(shard) if self.stream else None)
