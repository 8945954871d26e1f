"""Refusing duplicate keys in a listing of millions of items, in 8 bytes per key.

A source's items must have unique keys (two samples of one key would overwrite each other in a
reader). Holding every key as a Python string in a set costs ~100 bytes a key, and a set of
64-bit digests ~65: 1.3 GB of a driver's memory for 20 M objects. :func:`unique_keys` keeps
the 64-bit digests in sorted NumPy runs instead (8 bytes a key; merged like a binary counter,
so each digest is sorted O(log n) times), checking the listing a batch at a time.
"""

from __future__ import annotations

from itertools import islice
from typing import Callable, Iterable, Iterator

import numpy as np
import xxhash

from shardkit.errors import SourceError
from shardkit.packing.sources.base import SourceItem

__all__ = ["CHECK_BATCH", "DigestSet", "unique_keys"]

#: Items checked (and held back) at a time.
CHECK_BATCH = 4096


class DigestSet:
    """A set of 64-bit digests in sorted runs of NumPy ``uint64``: 8 bytes each."""

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(r) for r in self._runs)

    def add(self, batch: np.ndarray) -> np.ndarray:
        """Add ``batch``; which of its digests were there already.

        Args:
            batch: digests (``uint64``), in listing order.

        Returns:
            A boolean mask over ``batch``: True where the digest was added before, by an earlier
            batch or earlier in this one.
        """
        seen = np.zeros(len(batch), dtype=bool)
        if not len(batch):
            return seen
        for run in self._runs:
            at = np.minimum(np.searchsorted(run, batch), len(run) - 1)
            seen |= run[at] == batch
        order = np.argsort(batch, kind="stable")
        ordered = batch[order]
        seen[order[1:][ordered[1:] == ordered[:-1]]] = True  # the later of two equal ones
        run = np.sort(batch[~seen])  # new digests only: each is held once
        while self._runs and len(self._runs[-1]) <= len(run):
            run = np.union1d(self._runs.pop(), run)
        self._runs.append(run)
        return seen


def _digest(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogateescape"))


def unique_keys(items: Iterable[SourceItem], where: str,
                relist: Callable[[], Iterable[SourceItem]]) -> Iterator[SourceItem]:
    """``items`` as they come (up to :data:`CHECK_BATCH` behind), refusing a key met before.

    A digest met twice makes ``relist()`` list the source again to name both inputs; when the
    keys only share their digest (about once in 10^5 listings of 20 M keys), the listing goes on.

    Args:
        items: a source's listing, in order.
        where: the source, for the error.
        relist: lists the source again, in the same order.

    Yields:
        Each item.

    Raises:
        SourceError: naming the key and both inputs.
    """
    seen = DigestSet()
    listing = iter(items)
    try:
        while batch := list(islice(listing, CHECK_BATCH)):
            digests = np.fromiter((_digest(it.key) for it in batch), dtype=np.uint64, count=len(batch))
            for i in np.flatnonzero(seen.add(digests)):
                key = batch[i].key
                refs = list(islice((other.ref for other in relist() if other.key == key), 2))
                if len(refs) == 2:
                    raise SourceError(f"duplicate key {key!r} in {where}: {refs[0]} and {refs[1]}; each sample "
                                      "needs a key of its own: rename or leave out one of them")
            yield from batch
    finally:
        close = getattr(listing, "close", None)
        if close is not None:
            close()  # a walk of objects stops its listing threads
