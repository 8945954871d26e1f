"""Sample keys to global indices for ``ShardDataset.index_of``, without a Python object per key.

The keys are sorted once with Arrow and kept in Arrow and numpy buffers beside their global
indices; a lookup is a binary search over the sorted array.
"""

from __future__ import annotations

import bisect

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardkit.errors import ManifestError
from shardkit.format.manifest import parquet_file
from shardkit.read.dataset import Dataset, ShardInfo

__all__ = ["KeyIndex", "build_key_index"]


class KeyIndex:
    """Keys sorted once with Arrow plus their global indices; lookups binary-search the array.

    Memory is the key bytes + 4 (string offsets) + 8 (index) bytes per sample, with no Python
    object per key (a dict of str -> int would cost several times that). A lookup reads about
    log2(n) Arrow scalars.

    Args:
        keys: the sample keys, in any order.
        index: the global sample index of each key (same length as ``keys``).
    """

    def __init__(self, keys: pa.Array, index: np.ndarray) -> None:
        order = pc.sort_indices(keys).to_numpy()
        self.keys = keys.take(pa.array(order))
        self.index = index[order]

    def find(self, key: str) -> int | None:
        """The global index of ``key``.

        Args:
            key: a sample key.

        Returns:
            Its global sample index, or None when no sample has that key.
        """
        keys = self.keys
        lo = bisect.bisect_left(range(len(keys)), key, key=lambda k: keys[k].as_py())
        if lo < len(keys) and keys[lo].as_py() == key:
            return int(self.index[lo])
        return None


def build_key_index(ds: Dataset) -> KeyIndex:
    """The key index of ``ds``, read from the manifest's ``key`` column only.

    Each samples file is read once, for the row groups of the shards it holds; a manifest
    whose shards do not name their row groups (older packs) is read through ``ds.samples``.

    Args:
        ds: the dataset.

    Returns:
        The index of every sample's key.

    Raises:
        ManifestError: a samples file holds another number of keys than the shard table says,
            or (older packs) the sample rows are not in shard order.
    """
    store = ds.store
    by_file: dict[str, list[ShardInfo]] = {}
    for info in ds.shard_list:
        if info.num_samples:
            if not info.samples_file or info.samples_row_group < 0:
                return _from_samples(ds)
            by_file.setdefault(info.samples_file, []).append(info)
    keys: list[pa.Array] = []
    index: list[np.ndarray] = []
    for name, infos in by_file.items():
        groups = [s.samples_row_group for s in infos]
        table = parquet_file(store.read_checked(name)).read_row_groups(groups, columns=["key"], use_threads=False)
        if table.num_rows != sum(s.num_samples for s in infos):
            raise ManifestError(f"{ds.url}: {name} holds {table.num_rows} keys, shards.parquet says "
                                f"{sum(s.num_samples for s in infos)}")
        keys.extend(table.column("key").chunks)
        index.extend(np.arange(s.first_sample, s.first_sample + s.num_samples, dtype=np.int64) for s in infos)
    if not keys:
        return KeyIndex(pa.array([], pa.string()), np.empty(0, np.int64))
    return KeyIndex(pa.chunked_array(keys).combine_chunks(), np.concatenate(index))


def _from_samples(ds: Dataset) -> KeyIndex:
    table = ds.samples.select(["key", "shard"])
    if table.num_rows and not bool(pc.all(pc.greater_equal(
            pc.pairwise_diff(table.column("shard").combine_chunks()).fill_null(0), 0)).as_py()):
        raise ManifestError(f"{ds.url}: sample rows are not in shard order")
    return KeyIndex(table.column("key").combine_chunks(), np.arange(table.num_rows, dtype=np.int64))
