"""Format v1 manifest: the Arrow schemas, the bytes of shards.parquet and dataset.json (samples
fragments are built in :mod:`shardkit.format.fragments`; :mod:`shardkit.packing.manifest_writer`
stores them).

Layout under a dataset root::

    dataset.json                 commit marker, written last (create-only)
    shards/shard-NNNNNN.tar      WebDataset shards
    manifest/shards.parquet      one row per shard
    manifest/samples-NNNNN.parquet  one row per sample, one file per pack task (for an iterable,
                                    one per ~1M samples), one row group per shard

``shards.parquet`` carries two columns beyond the v1 minimum, ``samples_file`` and
``samples_row_group``, so a reader fetches exactly the row group of the shard it opens
instead of scanning every fragment footer.

Sample rows carry one optional column beyond the v1 minimum, right after ``checksum``:
``block_checksums`` list<uint64>, the xxh3-64 of each block of ``BLOCK_BYTES`` (recorded in
the fragment's schema metadata as ``shardkit.block_bytes``) of the sample's bytes
``[offset, offset+size)``, null for samples of one block or less. It lets a partial read of
a huge sample check only the blocks it fetched (:mod:`shardkit.format.checksums`). Manifests
without it (written before it existed) stay readable.

A fragment's schema metadata also records ``shardkit.shard_checksums``: a JSON object of
shard number -> the shard's xxh3-128 (as in ``shards.parquet``) for the shards it holds rows
of. Readers check it against the ``shards.parquet`` they opened; fragments without it (older
packs) are read as before.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardkit import __version__
from shardkit.format.checksums import BLOCK_BYTES, BLOCK_BYTES_KEY
from shardkit.errors import ManifestError, first_line
from shardkit.format.rows import SampleRows, ShardRecord

__all__ = ["DATASET_JSON", "FIELD_TYPE", "FORMAT", "SAMPLE_COLUMNS", "SHARDS_PARQUET", "SHARD_CHECKSUMS_KEY",
           "SHARD_SCHEMA", "VERSION", "dataset_info", "dataset_json_bytes", "fragment_name", "meta_array",
           "parquet_file", "row_groups_of", "sample_batch", "sample_table", "shards_table", "shards_table_bytes"]

FORMAT = "shardkit"
VERSION = 1
DATASET_JSON = "dataset.json"
SHARDS_PARQUET = "manifest/shards.parquet"
# A fragment's schema metadata: the xxh3-128 of each shard it describes, as shards.parquet
# has it. Ties the rows to that pack: a reader that opened another pack at the same URL
# (re-packed since) refuses the fragment instead of reading the new shards with new rows.
SHARD_CHECKSUMS_KEY = b"shardkit.shard_checksums"

FIELD_TYPE = pa.struct([("name", pa.string()), ("offset", pa.int64()), ("size", pa.int64())])

SAMPLE_COLUMNS = pa.schema([
    ("key", pa.string()),
    ("shard", pa.int32()),
    ("offset", pa.int64()),
    ("size", pa.int64()),
    ("fields", pa.list_(FIELD_TYPE)),
    ("checksum", pa.uint64()),
    ("block_checksums", pa.list_(pa.uint64())),
])

SHARD_SCHEMA = pa.schema([
    ("shard", pa.int32()),
    ("path", pa.string()),
    ("num_samples", pa.int64()),
    ("bytes", pa.int64()),
    ("first_sample", pa.int64()),
    ("checksum", pa.string()),
    ("samples_file", pa.string()),
    ("samples_row_group", pa.int32()),
])


def parquet_file(data: bytes, name: str = "manifest") -> pq.ParquetFile:
    """A ParquetFile over bytes in memory.

    Always through ``pa.BufferReader``, and callers read with ``use_threads=False``: pyarrow
    26 sometimes aborts the interpreter at exit ("terminate called without an active
    exception") once its thread pools ran (reading through a Python file object made it
    happen now and then). Manifest row groups are small: threads buy nothing there.

    Args:
        data: the Parquet file's bytes.
        name: the file, for the error.

    Returns:
        The ParquetFile.

    Raises:
        ManifestError: the bytes are no readable Parquet file.
    """
    try:
        return pq.ParquetFile(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"{name} is not a readable Parquet file ({first_line(exc)})") from exc


def fragment_name(task: int) -> str:
    """The path of pack task ``task``'s samples fragment.

    Args:
        task: the task (or, for an iterable, the fragment) number.

    Returns:
        ``manifest/samples-NNNNN.parquet``.
    """
    return f"manifest/samples-{task:05d}.parquet"


def sample_table(rows: SampleRows) -> pa.Table:
    """Arrow table of sample rows: the v1 columns, then user metadata columns (sorted by name,
    each typed by pyarrow's inference over the whole column).

    Args:
        rows: the rows.

    Returns:
        The table, its schema recording ``shardkit.block_bytes``.

    Raises:
        ManifestError: a metadata column clashes with a manifest column or mixes types.
    """
    base = pa.Table.from_batches([sample_batch(rows)]).replace_schema_metadata({BLOCK_BYTES_KEY: str(BLOCK_BYTES).encode()})
    for name in sorted({k for m in rows.meta for k in m}):
        base = base.append_column(name, meta_array(name, [m.get(name) for m in rows.meta]))
    return base


def sample_batch(rows: SampleRows) -> pa.RecordBatch:
    """The v1 columns of ``rows``.

    Args:
        rows: the rows.

    Returns:
        A record batch of :data:`SAMPLE_COLUMNS`.
    """
    return pa.RecordBatch.from_arrays([
        pa.array(rows.key, pa.string()),
        pa.array(rows.shard, pa.int32()),
        pa.array(rows.offset, pa.int64()),
        pa.array(rows.size, pa.int64()),
        pa.array(rows.fields, pa.list_(FIELD_TYPE)),
        pa.array(rows.checksum, pa.uint64()),
        pa.array(rows.blocks, pa.list_(pa.uint64())),
    ], schema=SAMPLE_COLUMNS)


def meta_array(name: str, values: list[Any]) -> pa.Array:
    """One user metadata column, typed by pyarrow's inference over all its values.

    Args:
        name: the column.
        values: its values, one per row (None where a row lacks it).

    Returns:
        The Arrow array.

    Raises:
        ManifestError: the name is a manifest column's, or the values mix incompatible types.
    """
    if name in SAMPLE_COLUMNS.names:
        raise ManifestError(f"metadata column {name!r} clashes with a manifest column")
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ManifestError(f"metadata column {name!r} mixes incompatible types: {exc}") from exc


def row_groups_of(data: bytes, shards: Sequence[ShardRecord]) -> list[int]:
    """The row group of each shard in a samples fragment (empty shards have none).

    Args:
        data: the fragment's bytes.
        shards: the shards it holds rows of, in order.

    Returns:
        Each shard's row-group index, -1 for an empty shard.

    Raises:
        ManifestError: a row group lacks the shard column's statistics.
    """
    md = parquet_file(data).metadata
    by_shard: dict[int, int] = {}
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        if rg.num_rows:
            stats = rg.column(1).statistics
            if stats is None or not stats.has_min_max:
                raise ManifestError("fragment row group without shard statistics")
            by_shard[int(stats.min)] = g
    return [by_shard.get(s.shard, -1) for s in shards]


def shards_table(records: Sequence[ShardRecord], samples_files: Sequence[str], row_groups: Sequence[int]) -> pa.Table:
    """manifest/shards.parquet rows in shard order, with the global ``first_sample`` filled in.

    Args:
        records: the shards, in any order.
        samples_files: each record's samples fragment.
        row_groups: each record's row group in its fragment.

    Returns:
        The table, in :data:`SHARD_SCHEMA`.

    Raises:
        ManifestError: the shard numbers are not 0..n-1.
    """
    order = sorted(range(len(records)), key=lambda i: records[i].shard)
    first = 0
    cols: dict[str, list[Any]] = {name: [] for name in SHARD_SCHEMA.names}
    for expected, i in enumerate(order):
        rec = records[i]
        if rec.shard != expected:
            raise ManifestError(f"shard numbers are not 0..n-1: expected {expected}, found {rec.shard}")
        cols["shard"].append(rec.shard)
        cols["path"].append(rec.path)
        cols["num_samples"].append(rec.num_samples)
        cols["bytes"].append(rec.bytes)
        cols["first_sample"].append(first)
        cols["checksum"].append(rec.checksum)
        cols["samples_file"].append(samples_files[i])
        cols["samples_row_group"].append(row_groups[i])
        first += rec.num_samples
    return pa.table(cols, schema=SHARD_SCHEMA)


def shards_table_bytes(table: pa.Table) -> bytes:
    """The bytes of ``manifest/shards.parquet`` holding ``table`` (zstd-compressed Parquet).

    Args:
        table: rows from :func:`shards_table`.

    Returns:
        The Parquet file's bytes, ready to store as :data:`SHARDS_PARQUET`.
    """
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def dataset_info(shards: pa.Table, fields: Sequence[str], source: dict[str, Any],
                 labels: dict[str, int] | None, skipped: Sequence[dict[str, str]],
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The content of ``dataset.json`` for a dataset of these shards.

    Args:
        shards: the shards.parquet table.
        fields: the field names the samples have.
        source: the source's description.
        labels: class name -> index, if the source has classes.
        skipped: the inputs left out, as ``{"ref", "key", "reason"}``.
        extra: more top-level entries (``pack`` or ``index`` settings).

    Returns:
        The JSON-able description, stamped with the time and shardkit's version.
    """
    info: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "num_samples": int(pc.sum(shards.column("num_samples")).as_py() or 0),
        "num_shards": shards.num_rows,
        "total_bytes": int(pc.sum(shards.column("bytes")).as_py() or 0),
        "fields": sorted(fields),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "shardkit_version": __version__,
        "source": source,
        "labels": labels or {},
        "skipped": list(skipped),
    }
    info.update(extra or {})
    return info


def dataset_json_bytes(info: dict[str, Any]) -> bytes:
    """The bytes of ``dataset.json`` for ``info`` (sorted keys, indented: stable and readable).

    Args:
        info: the dataset's description, from :func:`dataset_info`.

    Returns:
        UTF-8 JSON, ready to store (create-only) as :data:`DATASET_JSON`.
    """
    return json.dumps(info, indent=2, sort_keys=True).encode()


