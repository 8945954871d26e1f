"""Tokenized documents as a source, for LLM pre-training (read back by ``shardkit.TokenStream``).

Inputs (a directory searched recursively, one file, or a list of files):

* ``.npy``: a 1-D integer array, one document per file; or many documents when a sidecar
  ``<name>.docs.npy`` beside it holds the boundaries: ``n_docs + 1`` ascending offsets from 0
  to the array's length (document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``, as a CSR
  ``indptr``).
* ``.bin``: raw little-endian tokens of ``token_dtype`` (``uint16`` or ``uint32``), as nanoGPT's
  ``prepare.py`` and Megatron's ``.bin`` write them; one document, or many with a
  ``<name>.docs.npy`` sidecar as above.
* ``.parquet``/``.pq``: one document per row, its tokens a list of integers in ``token_column``.

Each document becomes one sample with one field, ``tokens.npy``: a 1-D little-endian ``.npy``
array. A ``.npy`` member and not a raw field with the dtype in dataset.json, because each
sample then says its own dtype and length, any WebDataset reader decodes it (``np.load``), and
ranged reads of a few rows work through ``ShardDataset.read_array``; the header costs 128
bytes per document. The manifest gets a ``num_tokens`` column (the document's length), from
which readers build the cumulative token index without touching the shards.

The dtype stored is ``token_dtype`` when given (values are range-checked), else the ``.npy``
file's own integer dtype, or ``uint32`` for Parquet. Keys are the file's path relative to the
directory without extension (:func:`safe_key`), with ``-NNNNNNNNN`` (document or row number)
for files holding several documents. Listing reads ``.npy`` headers, sidecars and the token
column's list lengths one row group at a time, never a whole file's tokens at once.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import numpy as np

from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.format.npy import parse_npy_header
from shardkit.format.streams import CHUNK_BYTES
from shardkit.packing.sample import FieldValue, PackSample, StreamedField, safe_key
from shardkit.packing.sources.base import SourceItem, item_bytes
from shardkit.packing.sources.npy import npy_header

PathLike = Union[str, os.PathLike]

__all__ = ["DOCS_SUFFIX", "TOKEN_DTYPES", "TOKEN_FIELD", "TokenSource"]

TOKEN_FIELD = "tokens.npy"
TOKEN_DTYPES = ("uint16", "uint32")
DOCS_SUFFIX = ".docs.npy"
_ARRAYS = (".npy", ".bin")
_TABLES = (".parquet", ".pq")


def _stem(rel: str) -> str:
    return rel[:-len(DOCS_SUFFIX)] if rel.endswith(DOCS_SUFFIX) else rel.rsplit(".", 1)[0]


def _key(stem: str, doc: int | None) -> str:
    return safe_key(stem if doc is None else f"{stem}-{doc:09d}")


def _converted(values: np.ndarray, out: np.dtype, what: str) -> np.ndarray:
    """``values`` as ``out`` (little-endian), refusing values ``out`` cannot hold."""
    if values.dtype == out:
        return values
    if values.size and out.kind == "u" and values.dtype.kind in "iu":
        lo, hi = int(values.min()), int(values.max())
        top = int(np.iinfo(out).max)
        if lo < 0 or hi > top:
            bad = lo if lo < 0 else hi
            raise SourceError(f"{what}: token {bad} does not fit {out.name} (0..{top}); pass a wider token_dtype")
    return values.astype(out)


class TokenSource:
    """Tokenized documents: ``.npy``/``.bin`` token arrays and Parquet token lists.

    Args:
        paths_or_dir: a directory (searched recursively), one file, or a list of files.
        token_dtype: ``"uint16"`` or ``"uint32"``: the dtype of ``.bin`` files (needed for
            them) and the dtype stored for every document (default: a ``.npy`` file's own,
            ``uint32`` for Parquet).
        token_column: the Parquet column holding each row's token list (needed for Parquet).

    Raises:
        SourceError: no paths, or an unknown ``token_dtype``.
    """

    def __init__(self, paths_or_dir: PathLike | Sequence[PathLike], token_dtype: str | None = None,
                 token_column: str | None = None) -> None:
        if isinstance(paths_or_dir, (str, os.PathLike)):
            self.paths: list[str] = [os.fspath(paths_or_dir)]
        else:
            self.paths = [os.fspath(p) for p in paths_or_dir]
        if not self.paths:
            raise SourceError("TokenSource: no paths given")
        if token_dtype is not None and token_dtype not in TOKEN_DTYPES:
            raise SourceError(f"token_dtype: expected one of {', '.join(TOKEN_DTYPES)}, got {token_dtype!r}")
        self.token_dtype = token_dtype
        self.token_column = token_column

    def __repr__(self) -> str:
        return f"TokenSource({self.paths if len(self.paths) != 1 else self.paths[0]!r})"

    # -- listing ---------------------------------------------------------------------------

    def _root(self) -> str:
        if len(self.paths) == 1 and os.path.isdir(self.paths[0]):
            return self.paths[0]
        return os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in self.paths])

    def _files(self) -> list[tuple[str, str]]:
        """(path, relative path) of every input file (sidecars aside), sorted by relative path."""
        if len(self.paths) == 1 and os.path.isdir(self.paths[0]):
            root = Path(self.paths[0])
            files = [f for f in root.rglob("*") if f.is_file() and not f.name.startswith(".")
                     and f.name.lower().endswith(_ARRAYS + _TABLES) and not f.name.endswith(DOCS_SUFFIX)]
            out = [(str(f), f.relative_to(root).as_posix()) for f in files]
            if not out:
                raise SourceError(f"{root}: no .npy, .bin or .parquet token files found")
        else:
            for p in self.paths:
                if not os.path.exists(p):
                    raise SourceNotFoundError(f"{p}: no such file")
                if not p.lower().endswith(_ARRAYS + _TABLES) or not os.path.isfile(p):
                    raise SourceError(f"{p}: not a .npy, .bin or .parquet token file")
            base = self._root()
            out = [(os.path.abspath(p), Path(os.path.relpath(os.path.abspath(p), base)).as_posix())
                   for p in self.paths]
        return sorted(out, key=lambda t: t[1])

    def list_items(self) -> list[SourceItem]:
        """One item per document; reads headers, sidecars and Parquet list lengths only.

        Returns:
            The items, by file (sorted by relative path) then document; ``ref`` is
            ``<path>#<first token>:<end token>`` for arrays, ``<path>#row<N>`` for Parquet.

        Raises:
            SourceNotFoundError: a path does not exist.
            SourceError: a file is unusable (names it: an odd byte count for the dtype, a
                non-integer or multi-dimensional array, bad boundaries, a token column of
                another type or a null row), or two documents share a key.
        """
        if len(self.paths) == 1 and not os.path.exists(self.paths[0]):
            raise SourceNotFoundError(f"{self.paths[0]}: no such file or directory")
        items: list[SourceItem] = []
        seen: dict[str, str] = {}
        for path, rel in self._files():
            stem = _stem(rel)
            for ref, key, n, out in self._documents(path, rel, stem):
                if key in seen:
                    raise SourceError(f"{rel}: key {key!r} collides with {seen[key]}")
                seen[key] = rel
                size = len(npy_header(out, (n,))) + n * out.itemsize
                items.append(SourceItem(ref=ref, nbytes=item_bytes(key, [(TOKEN_FIELD, size)]), key=key))
        return items

    def _documents(self, path: str, rel: str, stem: str) -> Iterator[tuple[str, str, int, np.dtype]]:
        """(ref, key, tokens, stored dtype) of each document of one file."""
        if path.lower().endswith(_TABLES):
            out = np.dtype(self.token_dtype or "uint32").newbyteorder("<")
            for row, n in enumerate(self._row_lengths(path, rel)):
                yield f"{path}#row{row}", _key(stem, row), n, out
            return
        src, _, total = self._array(path, rel)
        out = np.dtype(self.token_dtype).newbyteorder("<") if self.token_dtype else src.newbyteorder("<")
        bounds = self._bounds(path, rel, total)
        if bounds is None:
            yield f"{path}#0:{total}", _key(stem, None), total, out
            return
        for doc in range(len(bounds) - 1):
            a, b = int(bounds[doc]), int(bounds[doc + 1])
            yield f"{path}#{a}:{b}", _key(stem, doc), b - a, out

    def _array(self, path: str, rel: str) -> tuple[np.dtype, int, int]:
        """(source dtype, byte offset of the first token, tokens) of a ``.npy`` or ``.bin`` file."""
        size = os.path.getsize(path)
        if path.lower().endswith(".bin"):
            if self.token_dtype is None:
                raise SourceError(f"{rel}: a raw .bin token file needs token_dtype (--token-dtype uint16|uint32)")
            dt = np.dtype(self.token_dtype).newbyteorder("<")
            if size % dt.itemsize:
                raise SourceError(f"{rel}: {size} bytes is not a whole number of {self.token_dtype} tokens "
                                  f"({dt.itemsize} bytes each); wrong --token-dtype, or a truncated file")
            return dt, 0, size // dt.itemsize
        with open(path, "rb") as f:
            dtype, shape, _, header_len = parse_npy_header(f, name=rel)
        if dtype.kind not in "iu" or len(shape) != 1:
            raise SourceError(f"{rel}: a token array must be 1-D integers, got dtype {dtype} shape {shape}")
        expected = header_len + shape[0] * dtype.itemsize
        if size != expected:
            raise SourceError(f"{rel}: file is {size} bytes but its .npy header implies {expected}")
        return dtype, header_len, shape[0]

    @staticmethod
    def _bounds(path: str, rel: str, total: int) -> np.ndarray | None:
        """The document offsets of ``<stem>.docs.npy`` beside ``path``, checked, or None."""
        side = path.rsplit(".", 1)[0] + DOCS_SUFFIX
        if not os.path.isfile(side):
            return None
        name = _stem(rel) + DOCS_SUFFIX
        try:
            bounds = np.load(side, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise SourceError(f"{name}: not a readable .npy array of document offsets: {exc}") from exc
        if bounds.ndim != 1 or bounds.dtype.kind not in "iu" or bounds.size < 1:
            raise SourceError(f"{name}: document offsets must be a non-empty 1-D integer array, got dtype "
                              f"{bounds.dtype} shape {bounds.shape}")
        bounds = bounds.astype(np.int64)
        if bounds[0] != 0 or bounds[-1] != total or (np.diff(bounds) < 0).any():
            raise SourceError(f"{name}: document offsets must ascend from 0 to {total} (the tokens of {rel}); "
                              f"got {bounds.size} offsets from {bounds[0]} to {bounds[-1]}")
        return bounds

    def _row_lengths(self, path: str, rel: str) -> Iterator[int]:
        """Each row's token count, one row group at a time, the column's type checked first."""
        import pyarrow as pa
        import pyarrow.compute as pc

        pf = _parquet(path, rel)
        column = self.token_column
        if column is None:
            raise SourceError(f"{rel}: a Parquet token file needs token_column (--token-column NAME)")
        if column not in pf.schema_arrow.names:
            raise SourceError(f"{rel}: no column {column!r} (columns: {', '.join(pf.schema_arrow.names)})")
        kind = pf.schema_arrow.field(column).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
            raise SourceError(f"{rel}: column {column!r} is {kind}, expected a list of integers (token ids)")
        row = 0
        for g in range(pf.num_row_groups):
            col = pf.read_row_group(g, columns=[column]).column(column)
            lengths = pc.list_value_length(col)
            if lengths.null_count:
                bad = row + int(np.flatnonzero(lengths.is_null().to_numpy(zero_copy_only=False))[0])
                raise SourceError(f"{rel} row {bad}: {column!r} is null, expected a list of token ids")
            values = pc.list_flatten(col)
            if values.null_count:  # a null token id: found here, where the row can be named
                at = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
                bad = row + int(pc.list_parent_indices(col).to_numpy()[at])
                raise SourceError(f"{rel} row {bad}: {column!r} holds a null token id")
            for n in lengths.to_numpy().tolist():
                yield int(n)
            row += len(lengths)

    # -- loading ---------------------------------------------------------------------------

    def load(self, item: SourceItem) -> PackSample:
        """Read one document.

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample: field ``tokens.npy`` (a StreamedField past CHUNK_BYTES), meta ``source``
            (the file's relative path) and ``num_tokens``.

        Raises:
            SourceNotFoundError: the file is gone.
            SourceError: the file changed, or a token does not fit the stored dtype.
        """
        path, _, where = item.ref.rpartition("#")
        rel = Path(os.path.relpath(path, self._root())).as_posix()
        if not os.path.exists(path):
            raise SourceNotFoundError(f"{rel}: no such file")
        if where.startswith("row"):
            row = int(where[3:])
            what = f"{rel} row {row}"
            values = _parquet_row(path, rel, self.token_column or "", row)
            out = np.dtype(self.token_dtype or "uint32").newbyteorder("<")
            data = npy_header(out, (len(values),)) + _converted(values, out, what).tobytes()
            return PackSample(key=item.key, fields={TOKEN_FIELD: data},
                              meta={"source": rel, "num_tokens": len(values)})
        a, b = (int(x) for x in where.split(":"))
        src, offset, total = self._array(path, rel)
        if b > total:
            raise SourceError(f"{rel}: shrank while packing ({total} tokens, document ends at {b})")
        out = np.dtype(self.token_dtype).newbyteorder("<") if self.token_dtype else src.newbyteorder("<")
        what = f"{rel} tokens {a}:{b}"
        header = npy_header(out, (b - a,))
        size = len(header) + (b - a) * out.itemsize
        chunks = functools.partial(_array_chunks, path, offset, src, out, a, b, header, what)
        value: FieldValue = b"".join(chunks()) if size <= CHUNK_BYTES else StreamedField(size=size, chunks=chunks)
        return PackSample(key=item.key, fields={TOKEN_FIELD: value}, meta={"source": rel, "num_tokens": b - a})

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json.

        Returns:
            ``{"type": "tokens", "paths": ..., "token_dtype": ..., "token_column": ..., "field": "tokens.npy"}``.
        """
        return {"type": "tokens", "paths": list(self.paths), "token_dtype": self.token_dtype,
                "token_column": self.token_column, "field": TOKEN_FIELD}

    def labels(self) -> dict[str, int] | None:
        """Token documents have no classes.

        Returns:
            None.
        """
        return None


def _array_chunks(path: str, offset: int, src: np.dtype, out: np.dtype, a: int, b: int, header: bytes,
                  what: str) -> Iterator[bytes]:
    """The ``.npy`` bytes of tokens ``a:b`` of an array file, in pieces of at most CHUNK_BYTES."""
    yield header
    per = max(1, CHUNK_BYTES // max(src.itemsize, out.itemsize))
    with open(path, "rb") as f:
        f.seek(offset + a * src.itemsize)
        for start in range(a, b, per):
            n = min(per, b - start)
            raw = f.read(n * src.itemsize)
            if len(raw) != n * src.itemsize:
                raise SourceError(f"{what}: shrank while packing")
            yield _converted(np.frombuffer(raw, dtype=src), out, what).tobytes()


@functools.lru_cache(maxsize=4)
def _parquet_file(path: str, mtime: float) -> Any:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path)


def _parquet(path: str, rel: str) -> Any:
    try:
        return _parquet_file(path, os.path.getmtime(path))
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors are many; the file is named either way
        raise SourceError(f"{rel}: not a readable Parquet file: {exc}") from exc


@functools.lru_cache(maxsize=2)  # loads come in row order: one row group is read once per task
def _row_group(path: str, mtime: float, column: str, group: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(flat token values, row offsets, first row) of one row group's token column."""
    import pyarrow as pa

    pf = _parquet_file(path, mtime)
    first = sum(pf.metadata.row_group(g).num_rows for g in range(group))
    col = pf.read_row_group(group, columns=[column]).column(column).combine_chunks()
    if isinstance(col, pa.ChunkedArray):  # an empty row group
        col = col.chunk(0) if col.num_chunks else pa.array([], col.type)
    values = col.flatten()
    if values.null_count:
        raise SourceError("null token")
    offsets = col.offsets.to_numpy() - col.offsets[0].as_py()
    return values.to_numpy(), offsets.astype(np.int64), first


def _parquet_row(path: str, rel: str, column: str, row: int) -> np.ndarray:
    """The token ids of Parquet row ``row``."""
    pf = _parquet(path, rel)
    mtime = os.path.getmtime(path)
    start = 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row < start + n:
            try:
                values, offsets, first = _row_group(path, mtime, column, g)
            except SourceError:
                raise SourceError(f"{rel}: row group {g} holds a null token id in {column!r}") from None
            i = row - first
            return values[offsets[i]:offsets[i + 1]]
        start += n
    raise SourceError(f"{rel} row {row}: the file has only {start} rows now (changed while packing)")
