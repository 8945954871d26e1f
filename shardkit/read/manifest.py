"""Reading a committed dataset's manifest from storage (``dataset.json``, ``shards.parquet``),
and the checks that its parts agree with each other and with the samples fragments read later.

The layout and schemas are :mod:`shardkit.format.manifest`'s; this module is the reading side.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardkit.errors import DatasetNotFoundError, ManifestError, first_line
from shardkit.format.manifest import DATASET_JSON, FORMAT, SHARD_CHECKSUMS_KEY, SHARDS_PARQUET, VERSION, parquet_file
from shardkit.read.rows import ShardInfo
from shardkit.storage.store import Store

__all__ = ["check_same_pack", "count_faults", "manifest_faults", "read_info", "read_shards", "shard_infos"]

# The shards.parquet columns of format v1; samples_file and samples_row_group came later.
_SHARD_COLUMNS = ("shard", "path", "num_samples", "bytes", "first_sample", "checksum")


def read_info(store: Store, rel: str = DATASET_JSON) -> dict[str, Any]:
    """The dataset's ``dataset.json`` (its commit marker), or a version's marker.

    Args:
        store: the dataset root.
        rel: the file to read: ``dataset.json``, or a version's marker
            (:mod:`shardkit.read.versions`).

    Returns:
        The parsed object.

    Raises:
        DatasetNotFoundError: there is no dataset.json (naming a missing bucket, or a pack that
            seems unfinished).
        ManifestError: it is not valid JSON, not a shardkit dataset.json, or of another version.
    """
    if rel != DATASET_JSON:
        if not store.exists(rel):
            raise DatasetNotFoundError(f"no shardkit dataset version at {store.url_of(rel)}: the file is missing")
    elif not store.exists(DATASET_JSON):
        if store.is_object_store:
            bucket = store.bucket_key("")[0]
            if not store.call(lambda: store.fs.exists(bucket), bucket):
                raise DatasetNotFoundError(f"no shardkit dataset at {store.url}: bucket {bucket!r} does not exist "
                                           f"at {store.where}")
        hint = " (an interrupted or unfinished pack?)" if store.exists(SHARDS_PARQUET) or store.exists("shards") else ""
        raise DatasetNotFoundError(f"no shardkit dataset at {store.url}: dataset.json is missing{hint}")
    raw = store.read_checked(rel)
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser goes
        raise ManifestError(f"{store.url_of(rel)} is not valid JSON: {first_line(exc)}") from exc
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ManifestError(f"{store.url_of(rel)} is not a shardkit dataset.json")
    if info.get("version") != VERSION:
        raise ManifestError(f"{store.url_of(rel)}: unsupported format version {info.get('version')!r} (this shardkit reads {VERSION})")
    bad = _bad_entry(info)
    if bad:
        raise ManifestError(f"{store.url_of(rel)}: {bad}; re-pack, or restore the file the pack wrote")
    return info


def _bad_entry(info: dict[str, Any]) -> str | None:
    """What is wrong with the entries readers use, if anything: a manifest is never trusted,
    and a wrong type would otherwise surface as a TypeError deep in a reader."""
    for name in ("num_samples", "num_shards"):
        value = info.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{name} must be a whole number >= 0, got {value!r}"
    if "total_bytes" in info and (isinstance(info["total_bytes"], bool) or not isinstance(info["total_bytes"], int)
                                  or info["total_bytes"] < 0):
        return f"total_bytes must be a whole number >= 0, got {info['total_bytes']!r}"
    fields = info.get("fields", [])
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        return f"fields must be a list of field names, got {fields!r}"[:200]
    labels = info.get("labels")
    if labels is not None and not (isinstance(labels, dict) and all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in labels.items())):
        return f"labels must map class names to integers, got {labels!r}"[:200]
    return None


def read_shards(store: Store, rel: str = SHARDS_PARQUET) -> pa.Table:
    """The dataset's ``manifest/shards.parquet`` (or a version's copy), one row per shard.

    Args:
        store: the dataset root.
        rel: the file to read (a version's shard table: :mod:`shardkit.read.versions`).

    Returns:
        The table, with at least the format v1 columns.

    Raises:
        ManifestError: it is unreadable or lacks a v1 column.
    """
    data = store.read_checked(rel)
    try:
        table = parquet_file(data, store.url_of(rel)).read(use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"{store.url_of(rel)} is unreadable ({first_line(exc)})") from exc
    missing = [n for n in _SHARD_COLUMNS if n not in table.column_names]
    if missing:
        raise ManifestError(f"{store.url_of(rel)} lacks columns {missing}")
    return table


def shard_infos(shards: pa.Table) -> list[ShardInfo]:
    """The rows of shards.parquet as :class:`ShardInfo` objects, in shard order.

    Args:
        shards: shards.parquet, as :func:`read_shards` returns it.

    Returns:
        One :class:`ShardInfo` per row, in the table's order; a manifest without the
        row-group columns gets ``samples_file=""`` and ``samples_row_group=-1``.
    """
    cols = shards.to_pydict()
    n = shards.num_rows
    files = cols.get("samples_file") or [None] * n
    groups = cols.get("samples_row_group") or [None] * n
    return [ShardInfo(cols["shard"][i], cols["path"][i], cols["num_samples"][i], cols["bytes"][i],
                      cols["first_sample"][i], cols["checksum"][i], files[i] or "",
                      groups[i] if groups[i] is not None else -1)
            for i in range(n)]


def count_faults(info: dict[str, Any], shards: pa.Table) -> list[str]:
    """Where dataset.json's counts and shards.parquet disagree: a reader would otherwise index
    samples that are not there.

    Args:
        info: dataset.json.
        shards: shards.parquet.

    Returns:
        One line per fault; empty when they agree.
    """
    faults = []
    if shards.num_rows != info.get("num_shards"):
        faults.append(f"dataset.json says {info.get('num_shards')} shards, shards.parquet has {shards.num_rows}")
    sizes = shards.column("num_samples").to_numpy()
    if int(sizes.sum()) != info.get("num_samples"):
        faults.append(f"dataset.json says {info.get('num_samples')} samples, shards.parquet's shards hold "
                      f"{int(sizes.sum())}")
    first = shards.column("first_sample").to_numpy()
    wrong = np.flatnonzero(first != np.cumsum(sizes) - sizes)  # each shard's first: the samples before it
    if len(wrong):
        faults.append(f"shards.parquet: first_sample of shard {int(wrong[0])} is {int(first[wrong[0]])}, the "
                      "shards before it hold a different number of samples")
    return faults


def manifest_faults(info: dict[str, Any], shards: pa.Table) -> list[str]:
    """:func:`count_faults`, and what else of dataset.json shards.parquet contradicts.

    Args:
        info: dataset.json.
        shards: shards.parquet.

    Returns:
        One line per fault; empty when they agree.
    """
    faults = count_faults(info, shards)
    total = int(pc.sum(shards.column("bytes")).as_py() or 0)
    if total != info.get("total_bytes"):
        faults.append(f"dataset.json says {info.get('total_bytes')} total_bytes, shards.parquet's shards hold {total}")
    return faults


def check_same_pack(fragment: pq.ParquetFile, where: str, url: str, shards: Sequence[ShardInfo]) -> None:
    """Refuse a samples fragment that describes other shards than the shards.parquet a reader
    opened: the dataset was re-packed at this URL since, and reading the new shards with the
    new rows would pass every per-sample check while the reader (and its saved state) still
    stands for the old pack. A fragment packed before fragments recorded the shards'
    checksums passes.

    Args:
        fragment: the open fragment.
        where: the fragment's URL (for the message).
        url: the dataset's URL (for the message).
        shards: the shards of the shards.parquet the reader opened.

    Raises:
        ManifestError: the fragment is of another pack, or its record of shards is unreadable.
    """
    raw = (fragment.schema_arrow.metadata or {}).get(SHARD_CHECKSUMS_KEY)
    if raw is None:
        return
    try:
        listed = {int(k): str(v) for k, v in json.loads(raw).items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise ManifestError(f"{where}: unreadable {SHARD_CHECKSUMS_KEY.decode()} ({exc})") from exc
    for shard, checksum in sorted(listed.items()):
        mine = shards[shard].checksum if 0 <= shard < len(shards) else None
        if mine is None or mine.lower() != checksum.lower():
            raise ManifestError(f"{where} describes shard {shard} of another pack than the {url} this reader "
                                f"opened (xxh3 {checksum}, not {mine}): it was re-packed since; open it again "
                                "(a state saved on the old pack does not resume on it)")
