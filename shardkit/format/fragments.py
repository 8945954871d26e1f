"""Samples fragments (``manifest/samples-NNNNN.parquet``) built as a pack writes its shards.

A pack task's manifest rows become compressed Arrow as they come, so packing holds a few bytes
per sample rather than Python objects per row (see benchmarks/RESULTS.md for the pack's
memory); the fragment is byte for byte what :func:`shardkit.format.manifest.sample_table` over
all the rows would give. This module builds the bytes; :mod:`shardkit.packing.manifest_writer`
stores them.
"""

from __future__ import annotations

import io
import json
from typing import Any, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from shardkit.errors import ManifestError
from shardkit.format.checksums import BLOCK_BYTES, BLOCK_BYTES_KEY
from shardkit.format.manifest import SAMPLE_COLUMNS, SHARD_CHECKSUMS_KEY, meta_array, sample_batch
from shardkit.format.rows import PIECE_ROWS, SampleRows, ShardRecord

__all__ = ["FragmentBuilder", "build_fragment"]


# Rows, once Arrow, wait for the fragment as zstd-compressed IPC streams.
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")


class FragmentBuilder:
    """A samples fragment built shard by shard, holding no Python object per sample.

    Rows become Arrow as they come (:meth:`add_rows` while a shard is written, :meth:`add`
    with its record when it is done) and wait as zstd-compressed Arrow IPC streams, far smaller
    than rows as Python lists and dicts. Rows of shards too small for a piece of their own
    (``rows.PIECE_ROWS``) gather first and become one piece together (each piece costs its IPC
    framing). :meth:`to_bytes` gives the fragment, one row group per shard, byte for byte what
    :func:`~shardkit.format.manifest.sample_table` over all the rows at once would give.

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
        """Take rows of the shard being written, in order (more may follow).

        Args:
            rows: the next rows, all of one shard.

        Raises:
            ManifestError: the rows are of another shard than earlier ones.
        """
        self._current.add(rows)

    def drop_rows(self) -> None:
        """Forget the rows given for a shard that was abandoned (rewritten without a sample)."""
        self._current = _ShardPieces()

    def add(self, record: ShardRecord, rows: SampleRows | None = None) -> None:
        """Finish a shard: its record, and its last rows (after any given to :meth:`add_rows`).

        Args:
            record: the shard's record.
            rows: its rows not given to :meth:`add_rows` yet.

        Raises:
            ManifestError: the rows are not the shard's (another shard, or not
                ``record.num_samples`` of them in all).
        """
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
        if len(self._staged) >= PIECE_ROWS:
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
            column = meta_array(name, values)
            del values
            fields.append(pa.field(name, column.type))
            whole[name] = column
        return pa.schema(fields), whole

    def _shard_checksums(self) -> bytes:
        return json.dumps({str(r.shard): r.checksum for r in self.shards if r.num_samples}).encode()

    def to_bytes(self, extra_metadata: dict[str, str] | None = None) -> bytes:
        """The fragment's Parquet bytes: one row group per shard that has rows.

        Args:
            extra_metadata: more Parquet key-value metadata (a pack records there the shards
                its task completed).

        Returns:
            The bytes.

        Raises:
            ManifestError: a metadata column's values mix incompatible types.
        """
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


class _Piece:
    """Rows as a compressed Arrow IPC stream, and the types its metadata columns took."""

    def __init__(self, rows: SampleRows) -> None:
        self.rows = len(rows)
        batch = sample_batch(rows)
        self.meta_types: dict[str, pa.DataType] = {}
        for name in sorted({k for m in rows.meta for k in m}):
            column = meta_array(name, [m.get(name) for m in rows.meta])
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
        """Take the next rows of the shard (as a compressed piece)."""
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


def build_fragment(name: str, rows: SampleRows, shards: Sequence[ShardRecord]) -> FragmentBuilder:
    """A fragment of ``rows`` with one row group per shard (in shard order), ready to write.

    Args:
        name: the fragment's name, for error messages.
        rows: every shard's rows, in shard order.
        shards: the shards the rows belong to, in order; ``num_samples`` rows each.

    Returns:
        The builder: :meth:`FragmentBuilder.to_bytes` gives the fragment (with any extra
        Parquet key-value metadata), :func:`~shardkit.format.manifest.row_groups_of` its row groups.

    Raises:
        ManifestError: naming the fragment, when the rows do not follow the shards.
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
    return builder
