"""Storing a dataset's manifest: samples fragments, ``shards.parquet`` and ``dataset.json``.

:mod:`shardkit.format` builds the bytes; this module writes them. ``dataset.json`` goes last
and create-only (:func:`put_dataset_json`), so a dataset is visible only once complete, and of
two packs racing to commit at one destination exactly one succeeds.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from shardkit.format.fragments import FragmentBuilder
from shardkit.format.manifest import DATASET_JSON, SHARDS_PARQUET, dataset_json_bytes, row_groups_of, shards_table_bytes
from shardkit.packing.create_once import create_once
from shardkit.storage.store import Store

__all__ = ["put_dataset_json", "put_fragment", "put_shards_table"]


def put_fragment(store: Store, name: str, builder: FragmentBuilder,
                 extra_metadata: dict[str, str] | None = None) -> list[int]:
    """Store the samples fragment ``builder`` holds as ``name``.

    Args:
        store: the dataset root.
        name: the fragment's path under the root (``manifest/samples-NNNNN.parquet``).
        builder: the fragment's shards and rows.
        extra_metadata: Parquet key-value metadata to add (a pack records there the shards
            its task completed).

    Returns:
        The row-group index of each of the builder's shards (-1 for an empty shard).

    Raises:
        StorageError: the write failed.
    """
    data = builder.to_bytes(extra_metadata)
    store.put_bytes(name, data)
    return row_groups_of(data, builder.shards)


def put_shards_table(store: Store, table: pa.Table) -> None:
    """Store ``manifest/shards.parquet``.

    Args:
        store: the dataset root.
        table: its rows (:func:`~shardkit.format.manifest.shards_table`).

    Raises:
        StorageError: the write failed.
    """
    store.put_bytes(SHARDS_PARQUET, shards_table_bytes(table))


def put_dataset_json(store: Store, info: dict[str, Any]) -> None:
    """Commit: write ``dataset.json`` create-only, so exactly one of two racing packs commits.

    A retried write that finds its own earlier try's ``dataset.json`` there has committed
    (:func:`~shardkit.packing.create_once.create_once`).

    Args:
        store: the dataset root.
        info: the dataset's description (:func:`~shardkit.format.manifest.dataset_info`).

    Raises:
        DatasetExistsError: ``dataset.json`` exists already (another pack committed first).
        StorageError: the write failed.
    """
    create_once(store, DATASET_JSON, dataset_json_bytes(info))
