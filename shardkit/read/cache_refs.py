"""How the read side names things in the node cache: a dataset's namespace, a shard's reference."""

from __future__ import annotations

import xxhash

from shardkit.cache.progress import SampleTable
from shardkit.cache.shard_cache import ShardRef
from shardkit.read.dataset import Dataset
from shardkit.read.rows import ShardInfo, ShardRows

__all__ = ["cache_namespace", "shard_ref"]


def cache_namespace(ds: Dataset) -> str:
    """A stable id of one pack: the same for every version appended to it (so a job on version
    2 finds version 1's shards already on the node), a new one for a re-pack at the same URL
    (so no file of the old pack is ever read for the new one).

    Sharing is safe because an append never writes a name of an earlier version again: its
    shards and samples fragments are numbered on from the latest version's, and what differs
    per version (a stored ``where=`` result) is keyed by :attr:`Dataset.identity`.

    Args:
        ds: the dataset.

    Returns:
        A hex digest of :attr:`Dataset.pack_identity`: the node cache's namespace for its
        shards, and the name of its manifest copies' directory.
    """
    return xxhash.xxh3_64_hexdigest(ds.pack_identity.encode())


def shard_ref(info: ShardInfo, rows: ShardRows | None = None) -> ShardRef:
    """What the node cache needs to know of a shard.

    Args:
        info: the shard's row of shards.parquet.
        rows: its manifest rows, for a download that readers may read while it lands (each
            sample checked against its xxh3-64 as it lands).

    Returns:
        Its path in the dataset, size and xxh3-128, as the cache checks a download against
        them, and with ``rows`` its samples.
    """
    table = SampleTable(rows.offset, rows.size, rows.checksum) if rows is not None else None
    return ShardRef(info.path, info.bytes, info.checksum, table)
