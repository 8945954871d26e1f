"""Format v1 manifest: the Arrow schemas, writing fragments, committing dataset.json.

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
a huge sample check only the blocks it fetched (:mod:`shardkit.blockhash`). Manifests
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
from typing import Any, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import __version__
from . import writer as _writer
from .blockhash import BLOCK_BYTES, BLOCK_BYTES_KEY
from .errors import ManifestError, first_line
from .storage import Store
from .writer import SampleRows, ShardRecord

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
    exception") once its thread pools ran (reading through a Python file object did so ~1 run
    in 10 here). Manifest row groups are small: threads buy nothing there.
    """
    try:
        return pq.ParquetFile(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"{name} is not a readable Parquet file ({first_line(exc)})") from exc


def fragment_name(task: int) -> str:
    return f"manifest/samples-{task:05d}.parquet"


def sample_table(rows: SampleRows) -> pa.Table:
    """Arrow table of sample rows: the v1 columns, then user metadata columns (sorted by name,
    each typed by pyarrow's inference over the whole column)."""
    base = pa.Table.from_batches([_batch(rows)]).replace_schema_metadata({BLOCK_BYTES_KEY: str(BLOCK_BYTES).encode()})
    for name in sorted({k for m in rows.meta for k in m}):
        base = base.append_column(name, _meta_array(name, [m.get(name) for m in rows.meta]))
    return base


def _batch(rows: SampleRows) -> pa.RecordBatch:
    """The v1 columns of ``rows``."""
    return pa.RecordBatch.from_arrays([
        pa.array(rows.key, pa.string()),
        pa.array(rows.shard, pa.int32()),
        pa.array(rows.offset, pa.int64()),
        pa.array(rows.size, pa.int64()),
        pa.array(rows.fields, pa.list_(FIELD_TYPE)),
        pa.array(rows.checksum, pa.uint64()),
        pa.array(rows.blocks, pa.list_(pa.uint64())),
    ], schema=SAMPLE_COLUMNS)


def _meta_array(name: str, values: list[Any]) -> pa.Array:
    if name in SAMPLE_COLUMNS.names:
        raise ManifestError(f"metadata column {name!r} clashes with a manifest column")
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ManifestError(f"metadata column {name!r} mixes incompatible types: {exc}") from exc


# Rows, once Arrow, wait for the fragment as zstd-compressed IPC streams.
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")


class FragmentBuilder:
    """A samples fragment built shard by shard, holding no Python object per sample.

    Rows become Arrow as they come (:meth:`add_rows` while a shard is written, :meth:`add`
    with its record when it is done) and wait as zstd-compressed Arrow IPC streams: tens of
    bytes a sample, where rows as Python lists and dicts take about a kilobyte. Rows of shards
    too small for a piece of their own (``writer.PIECE_ROWS``) gather first and become one
    piece together (a piece's IPC framing costs ~2 KB). :meth:`write` stores the fragment,
    one row group per shard, byte for byte what :func:`sample_table` over all the rows at once
    would give.

    Metadata columns are typed per piece first. The fragment's type of a column is the one
    every piece agrees on (pieces where it is missing or all None take it as nulls); where
    pieces disagree (ints in one, floats in another) the column's values are read back and
    typed as a whole, as :func:`sample_table` does.
    """

    def __init__(self) -> None:
        self.shards: list[ShardRecord] = []
        self.num_rows = 0
        self.nbytes = 0  # compressed bytes held
        self._pieces: list[pa.Buffer] = []
        self._names: list[dict[str, int]] = []  # each piece's columns
        self._meta_types: dict[str, set[pa.DataType]] = {}  # metadata column -> its types in pieces
        # Where each shard that has rows lies: (piece, first row, rows) spans, in order.
        self._spans: list[list[tuple[int, int, int]]] = []
        self._current = _ShardPieces()  # pieces of the shard being written (dropped if it is abandoned)
        self._staged = SampleRows()  # rows of finished shards, not yet a piece
        self._staged_shards: list[int] = []  # shards (in _spans) whose last span is in _staged

    def add_rows(self, rows: SampleRows) -> None:
        """Rows of the shard being written, in order (more may follow)."""
        self._current.add(rows)

    def drop_rows(self) -> None:
        """Forget the rows given for a shard that was abandoned (rewritten without a sample)."""
        self._current = _ShardPieces()

    def add(self, record: ShardRecord, rows: SampleRows | None = None) -> None:
        """Finish a shard: its record, and its last rows (after any given to :meth:`add_rows`)."""
        current, self._current = self._current, _ShardPieces()
        rows = rows if rows is not None and len(rows) else None
        if current.num_rows + (len(rows) if rows else 0) != record.num_samples \
                or current.shard not in (None, record.shard) \
                or (rows and (rows.shard[0] != record.shard or rows.shard[-1] != record.shard)):
            raise ManifestError(f"rows out of shard order at shard {record.shard}")
        self.shards.append(record)
        if not record.num_samples:
            return  # an empty shard (every input skipped) has no row group
        if current.pieces and self._staged.key:
            self._stage_done()  # pieces in row order
        spans = [(self._keep(piece), 0, piece.rows) for piece in current.pieces]
        if rows:
            spans.append((-1, len(self._staged), len(rows)))  # its piece is made later
            self._staged.extend(rows)
            self._staged_shards.append(len(self._spans))
        self._spans.append(spans)
        self.num_rows += record.num_samples
        if len(self._staged) >= _writer.PIECE_ROWS:
            self._stage_done()

    def _keep(self, piece: _Piece) -> int:
        self._pieces.append(piece.data)
        self._names.append(piece.names)
        self.nbytes += piece.data.size
        for name, kind in piece.meta_types.items():
            self._meta_types.setdefault(name, set()).add(kind)
        return len(self._pieces) - 1

    def _stage_done(self) -> None:
        """Turn the staged rows into one piece."""
        if not self._staged.key:
            return
        index = self._keep(_Piece(self._staged))
        for shard in self._staged_shards:
            _, first, n = self._spans[shard][-1]
            self._spans[shard][-1] = (index, first, n)
        self._staged, self._staged_shards = SampleRows(), []

    def _shard_spans(self) -> list[list[tuple[int, int, int]]]:
        self._stage_done()
        return self._spans

    def _shard_batches(self) -> Iterator[list[pa.RecordBatch]]:
        """Each shard's rows, read back: a batch per span."""
        cached: tuple[int, pa.RecordBatch] | None = None
        for spans in self._shard_spans():
            batches = []
            for index, first, n in spans:
                if cached is None or cached[0] != index:
                    cached = (index, self._read(index))
                batches.append(cached[1].slice(first, n))
            yield batches

    def _columns(self) -> tuple[pa.Schema, dict[str, pa.Array | pa.ChunkedArray]]:
        """The fragment's metadata fields, and the columns typed as a whole (pieces disagreed)."""
        self._stage_done()  # its pieces' metadata types count too
        fields: list[pa.Field] = []
        whole: dict[str, pa.Array | pa.ChunkedArray] = {}
        for name in sorted(self._meta_types):
            types = {t for t in self._meta_types[name] if t != pa.null()}
            if len(types) <= 1:
                fields.append(pa.field(name, types.pop() if types else pa.null()))
                continue
            values: list[Any] = []
            for batches in self._shard_batches():
                for batch in batches:
                    i = batch.schema.get_field_index(name)
                    values.extend(batch.column(i).to_pylist() if i >= 0 else [None] * batch.num_rows)
            column = _meta_array(name, values)
            del values
            fields.append(pa.field(name, column.type))
            whole[name] = column
        return pa.schema(fields), whole

    def _shard_checksums(self) -> bytes:
        return json.dumps({str(r.shard): r.checksum for r in self.shards if r.num_samples}).encode()

    def to_bytes(self, extra_metadata: dict[str, str] | None = None) -> bytes:
        """The fragment's Parquet bytes."""
        meta_fields, whole = self._columns()
        metadata = {BLOCK_BYTES_KEY: str(BLOCK_BYTES).encode(), SHARD_CHECKSUMS_KEY: self._shard_checksums()}
        metadata.update({k.encode(): v.encode() for k, v in (extra_metadata or {}).items()})
        schema = pa.schema([*SAMPLE_COLUMNS, *meta_fields], metadata=metadata)
        buf = io.BytesIO()
        with pq.ParquetWriter(buf, schema, compression="zstd") as pw:
            start = 0
            full: tuple[int, pa.RecordBatch] | None = None  # a piece read whole (small shards share one)
            for spans in self._shard_spans():
                n = sum(rows for _, _, rows in spans)
                if len(spans) == 1 and (full is None or full[0] != spans[0][0]):
                    full = (spans[0][0], self._read(spans[0][0]))
                # A shard in several pieces is read a column at a time: its pieces are never
                # held whole beside the shard's contiguous columns.
                columns = []
                for field in schema:
                    if field.name in whole:
                        columns.append(whole[field.name].slice(start, n))
                        continue
                    parts = []
                    for index, first, rows in spans:
                        i = self._names[index].get(field.name)
                        column = None if i is None else full[1].column(i) if full is not None and full[0] == index \
                            else self._read(index, i).column(0)
                        parts.append(column.slice(first, rows) if column is not None and column.type == field.type
                                     else pa.nulls(rows, field.type))
                    columns.append(_concat(parts))
                # One row group per shard, from contiguous arrays: the bytes of one table's slice.
                pw.write_table(pa.Table.from_arrays(columns, schema=schema), row_group_size=n)
                start += n
        return buf.getvalue()

    def _read(self, index: int, column: int | None = None) -> pa.RecordBatch:
        """Piece ``index`` read back, or only its ``column``."""
        options = None if column is None else pa.ipc.IpcReadOptions(included_fields=[column])
        return pa.ipc.open_stream(self._pieces[index], options=options).read_next_batch()

    def write(self, store: Store, name: str, extra_metadata: dict[str, str] | None = None) -> list[int]:
        """Store the fragment as ``name``; the row-group index of each shard (-1: empty)."""
        data = self.to_bytes(extra_metadata)
        store.put_bytes(name, data)
        return _row_groups_of(data, self.shards)


class _Piece:
    """Rows as a compressed Arrow IPC stream, and the types its metadata columns took."""

    def __init__(self, rows: SampleRows) -> None:
        self.rows = len(rows)
        batch = _batch(rows)
        self.meta_types: dict[str, pa.DataType] = {}
        for name in sorted({k for m in rows.meta for k in m}):
            column = _meta_array(name, [m.get(name) for m in rows.meta])
            batch = batch.append_column(name, column)
            self.meta_types[name] = column.type
        self.names = {name: i for i, name in enumerate(batch.schema.names)}
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema, options=_IPC_OPTIONS) as out:
            out.write_batch(batch)
        self.data = sink.getvalue()


class _ShardPieces:
    """The pieces of one shard's rows so far."""

    def __init__(self) -> None:
        self.pieces: list[_Piece] = []
        self.num_rows = 0
        self.shard: int | None = None

    def add(self, rows: SampleRows) -> None:
        if not len(rows):
            return
        shard = rows.shard[0]
        if rows.shard[-1] != shard or self.shard not in (None, shard):
            raise ManifestError(f"rows out of shard order at shard {shard}")
        self.shard = shard
        self.pieces.append(_Piece(rows))
        self.num_rows += len(rows)


def _concat(arrays: list[pa.Array]) -> pa.Array:
    return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)


def write_fragment(store: Store, name: str, rows: SampleRows, shards: Sequence[ShardRecord],
                   extra_metadata: dict[str, str] | None = None) -> list[int]:
    """Write one samples fragment with one row group per shard (in shard order).

    Returns the row-group index of each shard in ``shards``. ``extra_metadata`` lands in the
    Parquet key-value metadata (pack uses it to record the shards a task completed).
    """
    builder = FragmentBuilder()
    start = 0
    for rec in shards:
        stop = start + rec.num_samples
        if stop > len(rows):
            raise ManifestError(f"fragment {name}: rows out of shard order at shard {rec.shard}")
        try:
            builder.add(rec, rows.slice(start, stop))
        except ManifestError as exc:
            raise ManifestError(f"fragment {name}: {exc}") from None
        start = stop
    return builder.write(store, name, extra_metadata)


def _row_groups_of(data: bytes, shards: Sequence[ShardRecord]) -> list[int]:
    # Empty shards write no row group; map each shard to its real row-group index (-1 if empty).
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
    """manifest/shards.parquet rows in shard order, with global first_sample filled in."""
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


def write_shards_table(store: Store, table: pa.Table) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    store.put_bytes(SHARDS_PARQUET, buf.getvalue())


def dataset_info(shards: pa.Table, fields: Sequence[str], source: dict[str, Any],
                 labels: dict[str, int] | None, skipped: Sequence[dict[str, str]],
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
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


def commit(store: Store, info: dict[str, Any]) -> None:
    """Write dataset.json create-only: exactly one of two racing packs commits."""
    store.put_create(DATASET_JSON, json.dumps(info, indent=2, sort_keys=True).encode())


def read_info(store: Store) -> dict[str, Any]:
    from .errors import DatasetNotFoundError

    if not store.exists(DATASET_JSON):
        if store.is_object_store:
            bucket = store.bucket_key("")[0]
            if not store.call(lambda: store.fs.exists(bucket), bucket):
                raise DatasetNotFoundError(f"no shardkit dataset at {store.url}: bucket {bucket!r} does not exist "
                                           f"at {store.where}")
        hint = " (an interrupted or unfinished pack?)" if store.exists(SHARDS_PARQUET) or store.exists("shards") else ""
        raise DatasetNotFoundError(f"no shardkit dataset at {store.url}: dataset.json is missing{hint}")
    raw = store.read_bytes(DATASET_JSON)
    try:
        info = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{store.url_of(DATASET_JSON)} is not valid JSON: {exc}") from exc
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ManifestError(f"{store.url_of(DATASET_JSON)} is not a shardkit dataset.json")
    if info.get("version") != VERSION:
        raise ManifestError(f"{store.url_of(DATASET_JSON)}: unsupported format version {info.get('version')!r} (this shardkit reads {VERSION})")
    return info


def read_shards(store: Store) -> pa.Table:
    data = store.read_bytes(SHARDS_PARQUET)
    try:
        table = parquet_file(data, store.url_of(SHARDS_PARQUET)).read(use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"{store.url_of(SHARDS_PARQUET)} is unreadable ({first_line(exc)})") from exc
    missing = [n for n in ("shard", "path", "num_samples", "bytes", "first_sample", "checksum") if n not in table.column_names]
    if missing:
        raise ManifestError(f"{store.url_of(SHARDS_PARQUET)} lacks columns {missing}")
    return table
