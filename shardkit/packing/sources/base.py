"""The source protocol: how the pack planner sees any input.

A source lists its items cheaply on the driver (paths and estimated byte sizes, no data
read), and loads one item into a :class:`~shardkit.packing.sample.PackSample` inside a pack task.
Sources are pickled into Ray tasks, so they hold only URLs, paths and plain options.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, runtime_checkable

from shardkit.errors import SourceError
from shardkit.format.tar import member_bytes
from shardkit.packing.sample import PackSample

__all__ = ["ListingSkips", "Source", "SourceItem", "check_unique_keys", "item_bytes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)  # slots: a pack of 20 M files lists 20 M of these
class SourceItem:
    """One future sample as the planner sees it.

    Attributes:
        ref: what ``Source.load`` needs to find the data (a path, ``file.h5::/name``, ...);
            also what errors and the ``skipped`` list name.
        nbytes: bytes the sample takes in a shard, tar headers and padding included (see
            :func:`item_bytes`), used to plan shards and tasks by bytes.
        key: the tar-safe key this item will get (deterministic, unique in the source).
    """

    ref: str
    nbytes: int
    key: str


def item_bytes(key: str, fields: Iterable[tuple[str, int]]) -> int:
    """A :attr:`SourceItem.nbytes` for a sample of these (field name, body size) members: the
    bytes the writer puts in a shard for it, tar headers and padding included. Counting bodies
    alone let shards of small samples (an HDF5 row of 8 bytes takes 1,024) grow several times
    past ``shard_bytes``.

    Args:
        key: the sample's key.
        fields: (field name, body size) of each member.

    Returns:
        The bytes the sample takes in a shard.
    """
    return sum(member_bytes(f"{key}.{name}", size) for name, size in fields)


def check_unique_keys(items: Iterable[SourceItem]) -> None:
    """Refuse a listing in which two items share a key (their samples would overwrite each other).

    Args:
        items: the listed items.

    Raises:
        SourceError: two items share a key (names both).
    """
    seen: dict[str, str] = {}
    for it in items:
        if it.key in seen:
            raise SourceError(f"{it.ref}: key {it.key!r} collides with {seen[it.key]}: each sample needs a key of "
                              "its own; rename or leave out one of them")
        seen[it.key] = it.ref


@runtime_checkable
class Source(Protocol):
    """An input that can be packed.

    A source may also define ``task_done()``, which the packer calls in the task's process
    after each pack task's last ``load``: a source that keeps inputs open between loads (an
    HDF5 file read row by row) closes them there; a later ``load`` must reopen them. It is
    not part of the protocol, so sources without it still match. Likewise ``task_items(items)``,
    called first with the task's items in order: a source over object storage starts reading
    them ahead there.
    """

    def list_items(self) -> list[SourceItem]:
        """List the items to pack, reading no sample data (runs on the driver).

        Returns:
            The items, in a deterministic order (the same input lists the same way).

        Raises:
            SourceNotFoundError: the input does not exist.
            SourceError: it is empty or unusable, or two items share a key.
        """
        ...

    def load(self, item: SourceItem) -> PackSample:
        """Read one item (in a pack task); raises SourceError naming ``item.ref`` on bad input.

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample.
        """
        ...

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json's ``source``.

        Returns:
            A JSON-able dict with a ``type`` and the paths or URLs read (no secrets).
        """
        ...

    def labels(self) -> dict[str, int] | None:
        """The source's class map, recorded in dataset.json.

        Returns:
            Class name -> index where the source has named classes, else None.
        """
        ...


@dataclass
class ListingSkips:
    """Bad entries a source meets while listing (a file named ``README`` in a folder of
    ``<key>.<field>`` files, a file list's row naming a missing file): with
    ``on_error="skip"`` they are left out and listed in dataset.json's ``skipped`` like bad
    samples, else the first one raises.

    Attributes:
        skip: leave bad entries out (``on_error="skip"``) rather than raise.
        skipped: the entries left out, as dataset.json lists them.
    """

    skip: bool = False
    skipped: list[dict[str, str]] = field(default_factory=list)

    def bad(self, ref: str, reason: str) -> None:
        """A bad entry: left out and listed, or raised.

        Args:
            ref: the entry (a path, a row).
            reason: what is wrong with it.

        Raises:
            SourceError: ``reason``, unless :attr:`skip`.
        """
        if not self.skip:
            raise SourceError(reason)
        log.warning("skipped %s", reason if ref in reason else f"{ref}: {reason}")
        self.skipped.append({"ref": ref, "key": "", "reason": reason})
