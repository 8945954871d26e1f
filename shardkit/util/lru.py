"""A bounded least-recently-used map: the one LRU the package uses for its small caches."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Iterator, TypeVar

__all__ = ["LRU"]

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A map that keeps at most ``limit`` entries, dropping the least recently used first.

    ``get`` and ``put`` make an entry the most recent. A cost function bounds the entries by
    weight (bytes, rows) instead of count; ``on_evict`` sees each value dropped, so a caller can
    close a file or a map. Not thread-safe: callers that share one hold their own lock.

    Args:
        limit: the most entries (or the most total cost) kept; ``0`` keeps nothing.
        cost: the weight of a value (default 1 each).
        on_evict: called with each value the map drops (not with values a caller pops).
        keep_newest: the entry put last always stays, even alone past the limit: for a cache
            whose newest entry is the one in use.

    Raises:
        ValueError: ``limit`` is negative.
    """

    def __init__(self, limit: int, cost: Callable[[V], int] | None = None,
                 on_evict: Callable[[V], None] | None = None, *, keep_newest: bool = False) -> None:
        if limit < 0:
            raise ValueError(f"LRU limit must be >= 0, got {limit}")
        self.limit = limit
        self._cost = cost
        self._on_evict = on_evict
        self._floor = 1 if keep_newest else 0  # entries never dropped to make room
        self._items: OrderedDict[K, V] = OrderedDict()
        self._total = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(list(self._items))

    @property
    def total(self) -> int:
        """The summed cost of the entries kept."""
        return self._total

    def get(self, key: K, default: V | None = None) -> V | None:
        """Look ``key`` up and make it the most recent.

        Args:
            key: the key.
            default: what to return when ``key`` is not kept.

        Returns:
            The value kept under ``key``, or ``default``.
        """
        try:
            value = self._items[key]
        except KeyError:
            return default
        self._items.move_to_end(key)
        return value

    def peek(self, key: K, default: V | None = None) -> V | None:
        """Look ``key`` up without making it more recent.

        Args:
            key: the key.
            default: what to return when ``key`` is not kept.

        Returns:
            The value kept under ``key``, or ``default``.
        """
        return self._items.get(key, default)

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` under ``key`` as the most recent, dropping the oldest beyond the limit.

        ``limit`` is read here, so a caller may change it between puts.

        Args:
            key: the key (an entry already under it is replaced).
            value: the value; ``on_evict`` sees it if it is dropped later.
        """
        old = self._items.pop(key, None)
        if old is not None:
            self._total -= self._weigh(old)
        self._items[key] = value
        self._total += self._weigh(value)
        while len(self._items) > self._floor and (self._total > self.limit if self._cost else len(self._items) > self.limit):
            _, dropped = self._items.popitem(last=False)
            self._total -= self._weigh(dropped)
            if self._on_evict is not None:
                self._on_evict(dropped)

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove ``key`` (``on_evict`` is not called: the caller owns the value now).

        Args:
            key: the key.
            default: what to return when ``key`` is not kept.

        Returns:
            The value that was kept under ``key``, or ``default``.
        """
        value = self._items.pop(key, None)
        if value is None:
            return default
        self._total -= self._weigh(value)
        return value

    def values(self) -> list[V]:
        """All values kept.

        Returns:
            The values, least recently used first.
        """
        return list(self._items.values())

    def clear(self) -> None:
        """Drop every entry without calling ``on_evict``."""
        self._items.clear()
        self._total = 0

    def _weigh(self, value: V) -> int:
        return self._cost(value) if self._cost else 1
