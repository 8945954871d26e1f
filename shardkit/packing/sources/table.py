"""Parquet and Arrow (IPC file / Feather v2, or IPC stream) tables holding the payload itself.

Every row is a sample; how its columns become fields and metadata is the rule of
:mod:`~shardkit.packing.sources.table_rows` (binary columns -> fields, a Hugging Face ``Image``
struct -> its encoded bytes, scalars -> metadata, ``key`` -> the key, else the row number). This
is what Hugging Face ``datasets`` exports (``to_parquet``, ``save_to_disk``'s ``.arrow`` files).

Not to be confused with a file *list* (:class:`~shardkit.packing.sources.filelist.FileListSource`,
a ``path`` column naming files): :func:`~shardkit.packing.sources.resolve.resolve_source` tells
them apart by the columns.

Memory stays bounded for a file of any size: listing reads the file's metadata (row group
sizes) and the ``key`` column only; a task holds one row group (Parquet) or record batch (Arrow)
at a time. Keys come from a ``key`` column if there is one, else they are the row number (9
digits), prefixed by ``<file>-`` when there are several files. Metadata ``source`` is
``<file>:<row>``, the file relative to the folder given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.packing.sample import PackSample, safe_key
from shardkit.packing.sources.base import SourceItem, item_bytes
from shardkit.packing.sources.table_rows import RowPlan, parse_payload_columns, plan_columns
from shardkit.storage.urls import refuse_url_credentials

__all__ = ["TABLE_SUFFIXES", "TableSource", "payload_columns_of"]

PathLike = Union[str, os.PathLike]
TABLE_SUFFIXES = (".parquet", ".pq", ".arrow", ".feather")
_PARQUET = (".parquet", ".pq")
_BLOCK = 4 << 20  # remote read-ahead: a Parquet footer or column chunk in few requests


def payload_columns_of(schema: pa.Schema) -> list[str]:
    """The columns of ``schema`` that hold payload bytes: binary, or a struct with ``bytes``.

    Args:
        schema: a table's schema.

    Returns:
        Their names.
    """
    out = []
    for f in schema:
        t = f.type
        if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
            out.append(f.name)
        elif pa.types.is_struct(t) and "bytes" in [t.field(i).name for i in range(t.num_fields)]:
            out.append(f.name)
    return out


class _Reader:
    """One table file: its schema, row groups (Parquet) or record batches (Arrow), read one at a time."""

    def __init__(self, path: str, name: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.name = name
        self.storage_options = storage_options
        self.parquet: pq.ParquetFile | None = None
        self.ipc: Any = None
        self.stream = False
        try:
            if path.lower().endswith(_PARQUET):
                self.parquet = pq.ParquetFile(self.open(path), memory_map="://" not in path)
                self.schema = self.parquet.schema_arrow
                meta = self.parquet.metadata
                self.rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
                self.group_bytes = [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]
                return
            with self.open(path) as f:
                self.stream = f.read(6) != b"ARROW1"  # the IPC file magic; else the streaming format
            source = self.open(path)
            self.ipc = pa.ipc.open_stream(source) if self.stream else pa.ipc.open_file(source)
            self.schema = self.ipc.schema
            batches = list(self.ipc) if self.stream else [self.ipc.get_batch(i) for i in range(self.ipc.num_record_batches)]
            self.rows = [b.num_rows for b in batches]
            self.group_bytes = [b.nbytes for b in batches]
            if self.stream:
                self.ipc = None  # a stream is read again from its start for each batch asked for
        except FileNotFoundError as exc:
            raise SourceNotFoundError(f"{name}: no such file") from exc
        except (pa.ArrowException, OSError) as exc:
            raise SourceError(f"{name}: not a readable Parquet or Arrow file: {exc}") from exc

    def open(self, path: str) -> Any:
        """The file to read: memory-mapped if local (zero-copy: batches are views of the
        mapped file), else an fsspec file of ranged reads."""
        if "://" not in path:
            return pa.memory_map(path) if not path.lower().endswith(_PARQUET) else path
        fs, p = fsspec.core.url_to_fs(path, **dict(self.storage_options or {}))
        return fs.open(p, "rb", block_size=_BLOCK)

    def group(self, g: int, path: str) -> pa.Table:
        """Row group (or record batch) ``g`` as a table."""
        try:
            if self.parquet is not None:
                return self.parquet.read_row_group(g)
            if not self.stream:
                return pa.Table.from_batches([self.ipc.get_batch(g)])
            with pa.ipc.open_stream(self.open(path)) as reader:
                for i, batch in enumerate(reader):
                    if i == g:
                        return pa.Table.from_batches([batch])
        except (pa.ArrowException, OSError) as exc:
            raise SourceError(f"{self.name}: cannot read rows of batch {g}: {exc}") from exc
        raise SourceError(f"{self.name}: batch {g} is gone: the file changed since it was listed?")

    def keys(self, column: str, path: str) -> list[Any]:
        """Every value of the key column (only that column is read)."""
        if self.parquet is not None:
            return self.parquet.read(columns=[column]).column(0).to_pylist()
        return [v for g in range(len(self.rows)) for v in self.group(g, path).column(column).to_pylist()]


class TableSource:
    """Parquet / Arrow table files whose rows are the samples (see the module docstring).

    Args:
        paths_or_dir: a file, a folder (its ``.parquet``/``.pq``/``.arrow``/``.feather`` files,
            recursively), or a list of files; local paths or fsspec URLs (``s3://``).
        payload_columns: column -> field for binary columns (``"img:jpg,depth:npy"`` or a dict);
            other binary columns make fields named after themselves.
        storage_options: fsspec options for URLs (never shown in errors or :meth:`describe`).

    Raises:
        SourceError: no paths given, or a bad ``payload_columns``.
    """

    def __init__(self, paths_or_dir: PathLike | Sequence[PathLike],
                 payload_columns: str | Mapping[str, str] | None = None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        given = [paths_or_dir] if isinstance(paths_or_dir, (str, os.PathLike)) else list(paths_or_dir)
        # Local paths made absolute: Ray tasks on a cluster run in another working directory.
        self.paths = [p if "://" in p else os.path.abspath(p) for p in (str(os.fspath(g)) for g in given)]
        self.storage_options = dict(storage_options) if storage_options else None
        if not self.paths:
            raise SourceError("TableSource: no paths given")
        for p in self.paths:
            refuse_url_credentials(p, "source")
        self.payload_columns = parse_payload_columns(payload_columns)
        self._cache: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"TableSource({self.paths if len(self.paths) != 1 else self.paths[0]!r})"

    def __getstate__(self) -> dict[str, Any]:
        """Only the options: readers and row groups are opened again in each task's process."""
        return {"paths": self.paths, "payload_columns": self.payload_columns, "storage_options": self.storage_options,
                "_cache": {}}

    def files(self) -> list[tuple[str, str]]:
        """(path, path relative to the folder given) of every table file, sorted.

        Returns:
            The files.

        Raises:
            SourceNotFoundError: a path does not exist.
            SourceError: a folder holds no table files.
        """
        out: list[tuple[str, str]] = []
        for given in self.paths:
            if "://" in given:
                out += self._remote_files(given)
                continue
            root = Path(given)
            if root.is_dir():
                found = sorted(p for p in root.rglob("*") if p.suffix.lower() in TABLE_SUFFIXES and p.is_file())
                if not found:
                    raise SourceError(f"{given}: no Parquet or Arrow files found")
                out += [(str(p), p.relative_to(root).as_posix()) for p in found]
            elif root.is_file():
                out.append((given, root.name))
            else:
                raise SourceNotFoundError(f"{given}: no such file or directory")
        return out

    def _remote_files(self, url: str) -> list[tuple[str, str]]:
        fs, path = fsspec.core.url_to_fs(url, **dict(self.storage_options or {}))
        proto = url.split("://", 1)[0] + "://"
        if fs.isdir(path):
            root = path.rstrip("/")
            found = sorted(p for p in fs.find(root) if p.lower().endswith(TABLE_SUFFIXES))
            if not found:
                raise SourceError(f"{url}: no Parquet or Arrow files found")
            return [(proto + p, p[len(root) + 1:]) for p in found]
        if not fs.exists(path):
            raise SourceNotFoundError(f"{url}: no such file or directory")
        return [(url, os.path.basename(path))]

    def _reader(self, path: str) -> tuple[_Reader, RowPlan]:
        cached = self._cache.get(path)
        if cached is None:
            reader = _Reader(path, self._rel(path), self.storage_options)
            plan = plan_columns(reader.schema, reader.name, self.payload_columns)
            cached = self._cache[path] = (reader, plan)
        return cached

    def _rel(self, path: str) -> str:
        for given in self.paths:
            if path.startswith(given.rstrip("/") + "/"):
                return path[len(given.rstrip("/")) + 1:]
        return os.path.basename(path)

    def list_items(self) -> list[SourceItem]:
        """One item per row; reads each file's metadata and its ``key`` column only.

        Returns:
            The items, by file then row; ``ref`` is ``<file>: row <n>``.

        Raises:
            SourceNotFoundError: a path does not exist.
            SourceError: a file is unreadable, a column has no rule, or two rows share a key.
        """
        items: list[SourceItem] = []
        seen: dict[str, str] = {}
        self._cache.clear()
        plans: set[RowPlan] = set()
        files = self.files()
        for path, rel in files:
            reader, plan = self._reader(path)
            plans.add(plan)
            keys = reader.keys(plan.key_column, path) if plan.key_column else None
            fields = [c.field + (".jpg" if c.role == "blob" else "") for c in plan.columns if c.role != "meta"]
            row = 0
            for rows, nbytes in zip(reader.rows, reader.group_bytes):
                share = nbytes // max(1, rows * len(fields))  # an estimate for the plan: the writer measures
                for _ in range(rows):
                    key = plan.key({str(plan.key_column): keys[row]} if keys is not None else {}, row)
                    if keys is None and len(files) > 1:
                        key = safe_key(f"{_stem(rel)}-{key}")  # row numbers repeat across files
                    if key in seen:
                        raise SourceError(f"{rel}: row {row}: key {key!r} is also {seen[key]}")
                    seen[key] = f"row {row} of {rel}"
                    items.append(SourceItem(ref=f"{path}: row {row}", nbytes=item_bytes(key, ((f, share) for f in fields)),
                                            key=key))
                    row += 1
        # Class names only when every file agrees on them (one schema).
        self._cache["labels"] = next(iter(plans)).classes if len(plans) == 1 else None
        return items

    def load(self, item: SourceItem) -> PackSample:
        """Read one row (its row group once per task, then kept until the next group).

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample: fields and metadata by the rule of
            :mod:`~shardkit.packing.sources.table_rows`; metadata ``source`` is ``<file>:<row>``.

        Raises:
            SourceNotFoundError: the file is gone.
            SourceError: the file changed or is unreadable, or the row has no payload.
        """
        path, _, row_text = item.ref.rpartition(": row ")
        row = int(row_text)
        reader, plan = self._reader(path)
        start = 0
        for g, rows in enumerate(reader.rows):
            if row < start + rows:
                break
            start += rows
        else:
            raise SourceError(f"{item.ref}: no such row (the file changed since it was listed?)")
        held = self._cache.get("group")
        if held is None or held[0] != (path, g):
            self._cache.pop("group", None)  # let the last group go before the next is read
            held = self._cache["group"] = ((path, g), reader.group(g, path))
        values = held[1].slice(row - start, 1).to_pylist()[0]
        fields, meta = plan.fields_of(values, item.ref)
        meta["source"] = f"{reader.name}:{row}"
        return PackSample(item.key, fields, meta)

    def task_done(self) -> None:
        """Let the row group a task read go (called after each task's last load)."""
        self._cache.pop("group", None)

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json.

        Returns:
            ``{"type": "table", "paths": [...]}`` (and ``payload_columns`` when given).
        """
        out: dict[str, Any] = {"type": "table", "paths": list(self.paths)}
        if self.payload_columns:
            out["payload_columns"] = dict(self.payload_columns)
        return out

    def labels(self) -> dict[str, int] | None:
        """The class names of a Hugging Face ``ClassLabel`` column, numbered as stored.

        Returns:
            Class name -> index, or None.
        """
        if "labels" not in self._cache:
            self.list_items()
        classes = self._cache["labels"]
        return {name: i for i, name in enumerate(classes)} if classes else None


def _stem(rel: str) -> str:
    return rel.rsplit(".", 1)[0].replace("/", "_").replace(".", "_")
