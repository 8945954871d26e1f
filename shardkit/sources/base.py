"""The source protocol: how the pack planner sees any input.

A source lists its items cheaply on the driver (paths and estimated byte sizes, no data
read), and loads one item into a :class:`~shardkit.sample.PackSample` inside a pack task.
Sources are pickled into Ray tasks, so they hold only URLs, paths and plain options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..sample import PackSample


@dataclass(frozen=True)
class SourceItem:
    """One future sample as the planner sees it.

    Attributes:
        ref: what ``Source.load`` needs to find the data (a path, ``file.h5::/name``, ...);
            also what errors and the ``skipped`` list name.
        nbytes: estimated packed size in bytes, used to plan shards and tasks by bytes.
        key: the tar-safe key this item will get (deterministic, unique in the source).
    """

    ref: str
    nbytes: int
    key: str


@runtime_checkable
class Source(Protocol):
    """An input that can be packed."""

    def list_items(self) -> list[SourceItem]:
        """All items in a deterministic order; raises SourceError if missing or empty."""
        ...

    def load(self, item: SourceItem) -> PackSample:
        """Read one item; raises SourceError naming ``item.ref`` on bad input."""
        ...

    def describe(self) -> dict[str, Any]:
        """A JSON-able description for dataset.json's ``source`` (no secrets)."""
        ...

    def labels(self) -> dict[str, int] | None:
        """Class name -> index where the source has classes, else None."""
        ...
