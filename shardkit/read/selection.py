"""Subsets without re-packing: a :class:`Selection` of a dataset's samples (from ``where=`` or
``indices=``) and the epoch order over it (:class:`SelectedOrder`).

A selection turns the dataset into a *view*: per shard, the selected samples. The epoch order
runs over the selected counts per shard (a shard with none has size 0 and is never scheduled,
so never fetched), and :meth:`SelectedOrder.shard_of` maps a view index back to the sample's
real position in its shard, which is all the partition, segment planner and shard source ever
ask for. Partitioning and resume therefore work unchanged, in view coordinates, and stay exact.

A ``where=`` selection is evaluated once per node and job: the first process takes a lock
beside the node's manifest copies, runs the query (:mod:`shardkit.read.where`) and renames the
result into place as ``selection-<hash>.npy`` (the hash of the dataset's identity and the
query text); every other rank and DataLoader worker on the node waits for the lock and maps
that file (its pages shared through the page cache). A node without a private copies
directory evaluates it in each process.
"""

from __future__ import annotations

import fcntl
import logging
import os
from typing import Any

import numpy as np
import xxhash
from numpy.typing import ArrayLike, NDArray

from shardkit.cache.files import FileLock
from shardkit.errors import ConfigError
from shardkit.read.annotations import annotation_listing
from shardkit.read.dataset import Dataset
from shardkit.read.epoch_order import DEFAULT_BLOCK_SHARDS, EpochOrder

__all__ = ["SELECTION_GAPS", "SelectedOrder", "Selection", "check_indices", "select"]

log = logging.getLogger(__name__)

IntArray = NDArray[np.int64]

# Why a reader without a cache fetches more than its selected samples, for the segment
# planner's warning (shardkit.read.segments).
SELECTION_GAPS = ("the unselected samples between its selected ones are gaps under 1 MiB, read through (cheaper "
                  "than a request each); a selection of contiguous runs, or larger samples, avoids it")


def check_indices(indices: ArrayLike, num_samples: int) -> IntArray:
    """``indices=`` as a sorted array, checked: integers, each in ``[0, num_samples)``, none twice.

    Args:
        indices: global sample indices, in any order.
        num_samples: the dataset's sample count.

    Returns:
        The indices, ascending, int64 (a new array).

    Raises:
        ConfigError: in one line naming the first bad entry.
    """
    arr = np.asarray(indices)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ConfigError(f"indices= must be a 1-D sequence of integers, got {arr.dtype} of shape {arr.shape}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= num_samples))
    if bad.size:
        k = int(bad[0])
        raise ConfigError(f"indices[{k}]={int(arr[k])} is out of range [0, {num_samples}) of the dataset's samples")
    out = np.sort(arr, kind="stable")
    dup = np.flatnonzero(out[1:] == out[:-1])
    if dup.size:
        value = int(out[dup[0]])
        where = np.flatnonzero(arr == value)[:2].tolist()
        raise ConfigError(f"indices= lists sample {value} twice (at positions {where[0]} and {where[1]}); "
                          "each sample at most once")
    return out


class Selection:
    """The selected samples of a dataset.

    Args:
        indices: selected global sample indices, ascending, unique (an array or a memmap).
        first_samples: each shard's first global index (the dataset's ``first_samples``).
        num_samples: the dataset's sample count.
        digest: what names the selection in a resume state.
        label: how messages name it (``where='...'`` or ``indices=[N]``).
        computed: whether this process evaluated the query (False: loaded a node's result).
    """

    def __init__(self, indices: IntArray, first_samples: np.ndarray, num_samples: int, digest: str, label: str,
                 computed: bool = False) -> None:
        self.indices = indices
        self.first_samples = np.asarray(first_samples, np.int64)
        self.digest, self.label, self.computed = digest, label, computed
        edges = np.append(self.first_samples, num_samples)
        # Selected per shard: how many indices fall between each shard's first and the next's.
        self.counts = np.diff(np.searchsorted(indices, edges)).astype(np.int64)

    def __len__(self) -> int:
        return int(self.indices.size)

    def __getstate__(self) -> dict[str, Any]:
        # A node's stored result travels as its path (workers map the same file), not its bytes.
        state = dict(self.__dict__)
        path = getattr(self.indices, "filename", None)
        if path and _load(str(path)) is not None:
            state["indices"], state["_path"] = None, str(path)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        path = state.pop("_path", None)
        self.__dict__.update(state)
        if path is not None:
            loaded = _load(path)
            if loaded is None:
                raise ConfigError(f"the selection file {path} of {self.label} is gone; make the stream again")
            self.indices = loaded

    def __repr__(self) -> str:
        return f"Selection({self.label}, samples={len(self)}, shards={int(np.count_nonzero(self.counts))})"

    def order(self, epoch: int, seed: int, shuffle: bool, block_shards: int = DEFAULT_BLOCK_SHARDS) -> SelectedOrder:
        """The epoch order over the selected samples.

        Args:
            epoch: the epoch.
            seed: the shuffle seed.
            shuffle: whether to shuffle.
            block_shards: shards per shuffle block.

        Returns:
            The order; its ``shard_of`` gives real positions in shards.
        """
        return SelectedOrder(self.counts, self.indices, self.first_samples, epoch, seed, shuffle, block_shards)

    def global_index(self, i: int) -> int:
        """The global sample index of the selection's ``i``-th sample.

        Args:
            i: a position in the selection (negative counts from the end).

        Returns:
            The global sample index.

        Raises:
            IndexError: ``i`` is out of range.
        """
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"sample index {i} out of range for the {n} samples selected by {self.label}")
        return int(self.indices[j])


class SelectedOrder(EpochOrder):
    """:class:`EpochOrder` over a selection's per-shard counts; :meth:`shard_of` maps view indices
    to real in-shard positions.

    Args:
        counts: selected samples per shard.
        indices: the selected global indices, ascending.
        first_samples: each shard's first global index in the dataset.
        epoch: the epoch.
        seed: the shuffle seed.
        shuffle: whether to shuffle.
        block_shards: shards per shuffle block.

    Raises:
        ConfigError: as :class:`EpochOrder`.
    """

    __slots__ = ("_real_first", "_selected")

    def __init__(self, counts: ArrayLike, indices: IntArray, first_samples: np.ndarray, epoch: int = 0,
                 seed: int = 0, shuffle: bool = True, block_shards: int = DEFAULT_BLOCK_SHARDS) -> None:
        super().__init__(counts, epoch, seed, shuffle, block_shards)
        self._selected = indices
        self._real_first = np.asarray(first_samples, np.int64)

    def __reduce__(self) -> tuple[Any, tuple[object, ...]]:  # type: ignore[override]
        return (SelectedOrder, (self._sizes, self._selected, self._real_first, self.epoch, self.seed, self.shuffle,
                                self.block_shards))

    def shard_of(self, global_indices: ArrayLike) -> tuple[IntArray, IntArray]:
        """Map view indices (positions in the selection) to ``(shards, real positions in shard)``.

        Args:
            global_indices: view indices, in ``[0, len(self))``.

        Returns:
            (the shard of each, the sample's position in that shard, in the dataset).

        Raises:
            ConfigError: an index is no integer or out of range.
        """
        shard, _ = super().shard_of(global_indices)
        g = np.asarray(self._selected[self._check_indices("global_indices", global_indices)], np.int64)
        return shard, g - self._real_first[shard]


def _digest(kind: str, text: bytes) -> str:
    # What a resume state records: the query or the indices, not where the data lives (a
    # state resumes on a copy of the data in another bucket; the data is checked apart).
    return kind + ":" + xxhash.xxh3_64_hexdigest(text)


def _load(path: str) -> IntArray | None:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # damaged: evaluated again
        log.warning("selection file %s is unreadable (%s); evaluating the query again", path, exc)
        return None


def _node_result(ds: Dataset, key: str, compute: Any) -> tuple[IntArray, bool]:
    """The node's stored result for ``key``, computed (by ``compute()``) by the first process
    to take its lock; (result, whether this process computed it)."""
    copies = ds.manifest_cache
    if copies is None:
        return compute(), True
    os.makedirs(copies, exist_ok=True)
    # Keyed by the committed dataset too: a re-pack at the URL must not reuse a result.
    name = xxhash.xxh3_64_hexdigest(f"{ds.identity}\0{key}".encode())
    path = os.path.join(copies, f"selection-{name}.npy")
    found = _load(path)
    if found is not None:
        return found, False
    lock = FileLock.take(path + ".lock", fcntl.LOCK_EX)  # the other processes of the node wait here
    try:
        found = _load(path)  # another process finished while this one waited
        if found is not None:
            return found, False
        result = compute()
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, result, allow_pickle=False)
        os.replace(tmp, path)  # readers see the whole result or none
    finally:
        lock.release()
    loaded = _load(path)
    return (loaded if loaded is not None else result), True


def select(ds: Dataset, *, where: str | None = None, indices: ArrayLike | None = None) -> Selection | None:
    """The selection ``where=`` or ``indices=`` makes of ``ds`` (None when neither is given).

    Args:
        ds: the dataset (with ``manifest_cache`` set, a ``where`` result is shared on the node).
        where: a SQL condition over the manifest's columns (see :mod:`shardkit.read.where`).
        indices: global sample indices (in any order; each at most once).

    Returns:
        The selection, or None.

    Raises:
        ConfigError: both are given, ``indices`` is bad, ``where`` is bad (one line naming the
            column or SQL error and listing the columns), or it selects no sample.
        ManifestError: a manifest fragment is unreadable or of another pack.
        StorageError: the manifest could not be read.
    """
    if where is None and indices is None:
        return None
    if where is not None and indices is not None:
        raise ConfigError("give where= or indices=, not both")
    if indices is not None:
        arr = check_indices(indices, ds.num_samples)
        digest = _digest("indices", arr.tobytes())
        sel = Selection(arr, ds.first_samples, ds.num_samples, digest, f"indices=[{arr.size} samples]", True)
    else:
        if not isinstance(where, str) or not where.strip():
            raise ConfigError(f"where= must be a non-empty SQL condition, got {where!r}")
        from shardkit.read.where import where_indices  # duckdb only when a query is given

        # The side columns as they are now (names and sizes, not where they live) are part of
        # what the query means: one added or replaced since makes another selection, both for
        # the node's stored result and for a resume state.
        stamp = repr(annotation_listing(ds))
        digest = _digest("where", f"{where}\0{stamp}".encode())
        arr, computed = _node_result(ds, digest, lambda: where_indices(ds, where))
        sel = Selection(arr, ds.first_samples, ds.num_samples, digest, f"where={where!r}", computed)
    if not len(sel):
        raise ConfigError(f"{sel.label} selects no sample of {ds.url}")
    return sel
