"""A CSV or Parquet file list as a source: one sample per row's file, the other columns metadata.

CSV columns are read as text and typed only where nothing is lost (:func:`_csv_values`): an id
``"0001"`` stays text. A ``label`` column becomes the ``cls`` field: class indices as given,
class names numbered in sorted order.

The list and its files may be objects (``s3://``): a list at a URL, paths that are URLs, or
paths relative to the list's own URL. Their sizes are asked for many at once while listing,
and their bytes read ahead within each task (:class:`~shardkit.packing.sources.objects.ReadAhead`).
"""

from __future__ import annotations

import math
import os
import re
from stat import S_ISDIR
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.packing.sample import MANIFEST_COLUMNS, FieldValue, PackSample, safe_key
from shardkit.packing.sources.base import ListingSkips, SourceItem, item_bytes
from shardkit.packing.sources.files import check_image, check_root, ensure_unique, read_field
from shardkit.packing.sources.objects import Objects, ReadAhead, ReadsAhead, is_url, join_url
from shardkit.storage.urls import refuse_url_credentials

__all__ = ["FileListSource"]

# Sizes of the files a list names are asked for this many rows at a time, on this many threads.
_HEAD_BLOCK = 4096
_HEAD_THREADS = 32


class FileListSource(ReadsAhead):
    """A CSV or Parquet table with a path column; every other column becomes metadata.

    Relative paths are resolved against the list file's directory (or URL). An optional
    ``key`` column names the samples; otherwise the key is the path without its extension.

    Args:
        list_path: the ``.csv``, ``.parquet`` or ``.pq`` file (a local path or a URL).
        path_column: the column naming each sample's file (a path, relative or absolute, or a URL).
        storage_options: fsspec options for URLs (credentials, endpoint); never shown.
    """

    def __init__(self, list_path: str | os.PathLike[str], path_column: str = "path",
                 storage_options: dict[str, Any] | None = None) -> None:
        self.list_path = str(list_path)
        self.path_column = path_column
        self.storage_options = dict(storage_options) if storage_options else None
        self.listing = ListingSkips()
        self._objects: Objects | None = None
        self._ahead: ReadAhead[Any] | None = None

    @property
    def objects(self) -> Objects:
        """The reader of objects at URLs (made on first use, with :attr:`storage_options`)."""
        if self._objects is None:
            self._objects = Objects(self.storage_options)
        return self._objects

    def _table(self) -> list[dict[str, Any]]:
        remote = is_url(self.list_path)
        p: Any = PurePosixPath(self.list_path) if remote else check_root(self.list_path)

        def opened() -> Any:  # the list itself: a local path, or an object read through shardkit's store
            return self.objects.open(self.list_path, block_size=8 * 2**20) if remote else p
        try:
            if p.suffix.lower() in (".parquet", ".pq"):
                table = pq.read_table(opened())  # typed by its writer: taken as is
            else:
                # Every column as text first: pyarrow's type inference would read a zip code
                # "00123" or an id "0001" as the integers 123 and 1.
                with pacsv.open_csv(opened()) as head:
                    names = head.schema.names
                table = pacsv.read_csv(opened(), convert_options=pacsv.ConvertOptions(
                    column_types={n: pa.string() for n in names}, strings_can_be_null=False))
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad files
            raise SourceError(f"cannot read file list {self.list_path}: {exc}") from exc
        if self.path_column not in table.column_names:
            raise SourceError(f"file list {self.list_path} has no {self.path_column!r} column (columns: {table.column_names})")
        if table.num_rows == 0:
            raise SourceError(f"file list {self.list_path} is empty")
        for name in table.column_names:
            if name in (self.path_column, "key"):
                continue  # the path and the key are not metadata: they make the sample
            if name == "source":  # kept for every source: the input each sample came from
                raise SourceError(f"file list {self.list_path}: column 'source' is reserved (shardkit records each sample's "
                                  "path there); rename the column")
            if name in MANIFEST_COLUMNS:
                raise SourceError(f"file list {self.list_path}: column {name!r} is reserved (the manifest has its own "
                                  f"{name!r} column); rename the column")
        if p.suffix.lower() not in (".parquet", ".pq"):
            for i, name in enumerate(table.column_names):
                if name not in (self.path_column, "key"):
                    table = table.set_column(i, name, _csv_values(table.column(i)))
        return table.to_pylist()

    def list_items(self) -> list[SourceItem]:
        """One item per row, in row order (one ``stat`` or HEAD per file, many HEADs at once;
        no data read).

        Returns:
            The items; ``ref`` is ``<row>:<path or URL>``.

        Raises:
            SourceNotFoundError: the list does not exist.
            SourceError: the list is unreadable, lacks the path column or holds a reserved
                column; a row's file is missing, its path empty or its label bad (unless
                skipped); two rows share a key.
            ConfigError: a row's path is a URL carrying credentials or a signature.
        """
        items = []
        self.listing.skipped.clear()
        self._rows = self._table()  # fresh: the local engine's tasks and labels() reuse it
        self.__dict__.pop("_class_map", None)
        for i, row, rel, where, size in self._sized(self._targets()):
            if size is None:
                self.listing.bad(f"{self.list_path}: row {i}", f"file list {self.list_path}: row {i}: {where} does not exist")
                continue
            if size < 0:
                self.listing.bad(f"{self.list_path}: row {i}", f"file list {self.list_path}: row {i}: {where} is a folder, "
                                 "not a file; list its files one per row (or pack the folder itself)")
                continue
            key = row.get("key")  # 0 and "00" are keys too: only a missing one falls back to the path
            stem = os.path.splitext(rel)[0] if is_url(rel) else Path(rel).with_suffix("").as_posix()
            key = safe_key(str(key) if key is not None and key != "" else stem)
            members = [(_list_field(where), size)]
            if "label" in row:
                members.append(("cls", 1))  # any class index fits the one block a 1-byte body takes
            items.append(SourceItem(ref=f"{i}:{where}", nbytes=item_bytes(key, members), key=key))
        ensure_unique(items, self.list_path)
        self.reads_s3 = any(it.ref.partition(":")[2].startswith(("s3://", "s3a://")) for it in items)
        return items

    def _targets(self) -> Iterator[tuple[int, dict[str, Any], str, str]]:
        """(row, its values, its path as given, the file's path or URL) of each usable row."""
        remote = is_url(self.list_path)
        base = self.list_path.rpartition("/")[0] if remote else str(Path(self.list_path).parent)
        for i, row in enumerate(self._rows):
            rel = row[self.path_column]
            if not rel:
                self.listing.bad(f"{self.list_path}: row {i}",
                                 f"file list {self.list_path}: row {i} has an empty {self.path_column!r}")
                continue
            if "label" in row:
                try:
                    _label_class(row["label"], f"file list {self.list_path}: row {i}")
                except SourceError as exc:
                    self.listing.bad(f"{self.list_path}: row {i}", str(exc))
                    continue
            # A signed URL would be kept in error messages and dataset.json's "skipped": refused at once.
            refuse_url_credentials(str(rel), f"file list {self.list_path}: row {i}: {self.path_column!r}")
            rel = str(rel)
            if is_url(rel):
                where = rel
            elif rel.startswith("file://"):
                where = rel[len("file://"):]
            elif os.path.isabs(rel):
                where = str(Path(rel))
            elif remote:
                resolved = _relative_url(base, rel)
                if resolved is None:
                    self.listing.bad(f"{self.list_path}: row {i}",
                                     f"file list {self.list_path}: row {i}: {rel!r} climbs above the bucket of the "
                                     "list; give it as a full URL")
                    continue
                where = resolved
            else:
                where = str(Path(base) / rel)
            yield i, row, rel, where

    def _sized(self, rows: Iterator[tuple[int, dict[str, Any], str, str]]
               ) -> Iterator[tuple[int, dict[str, Any], str, str, int | None]]:
        """``rows`` with each file's size (None: missing, -1: a folder), objects' sizes asked for
        many at once."""
        def size(where: str) -> int | None:
            try:
                if is_url(where):
                    info = self.objects.call(where, lambda fs, p: fs.info(p))
                    return -1 if info.get("type") == "directory" else int(info.get("size") or 0)
                stat = Path(where).stat()
                return -1 if S_ISDIR(stat.st_mode) else stat.st_size
            except (SourceNotFoundError, FileNotFoundError):
                return None
        with ThreadPoolExecutor(_HEAD_THREADS, thread_name_prefix="shardkit-head") as pool:
            while block := [r for _, r in zip(range(_HEAD_BLOCK), rows)]:
                remote = [pool.submit(size, r[3]) if is_url(r[3]) else None for r in block]
                for r, fut in zip(block, remote):
                    yield (*r, fut.result() if fut is not None else size(r[3]))

    def load(self, item: SourceItem) -> PackSample:
        """Read one row's file.

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample: the file as the field its extension names (``bin`` without one) and
            ``cls`` if the list has labels; the row's other columns as metadata, ``source`` its path.

        Raises:
            SourceError: the file is unreadable, an image field is no image, or the label is bad.
        """
        index, _, where = item.ref.partition(":")
        row = self._row(int(index))
        ext = _list_field(where)
        meta = {k: v for k, v in row.items() if k not in (self.path_column, "key")}
        meta["source"] = row[self.path_column]
        if is_url(where):
            value = self._read_ahead().get(item)
            check_image(where, ext, value, lambda: self.objects.open(where))
        else:
            value = read_field(Path(where))
            check_image(Path(where), ext, value)
        fields: dict[str, FieldValue] = {ext: value}
        if "label" in row:
            cls = _label_class(row["label"], f"file list {self.list_path}: row {index}")
            # A class name is numbered; the column keeps the name (and an integral float as written).
            fields["cls"] = str(self._classes()[cls] if isinstance(cls, str) else cls).encode()
        return PackSample(item.key, fields, meta)

    def _fetch(self, item: SourceItem) -> FieldValue:
        return self.objects.read(item.ref.partition(":")[2], item.nbytes)

    def task_items(self, items: list[SourceItem]) -> None:
        """The packer's hook at a task's start: read the task's objects ahead, in this order.

        Args:
            items: the task's items, in order.
        """
        if any(is_url(it.ref.partition(":")[2]) for it in items):
            self._read_ahead().start(items)

    def _classes(self) -> dict[str, int]:
        """Class name -> index of a text ``label`` column ("cat", "dog"): the sorted distinct
        names, as --labels-from-dirs numbers its folders; empty for numeric labels."""
        classes: dict[str, int] | None = getattr(self, "_class_map", None)
        if classes is None:
            names = {r.get("label") for r in self._all_rows()}
            classes = {c: i for i, c in enumerate(sorted(n for n in names if isinstance(n, str) and n))}
            self._class_map = classes
        return classes

    def _row(self, index: int) -> dict[str, Any]:
        return self._all_rows()[index]

    def _all_rows(self) -> list[dict[str, Any]]:
        # Tasks reload the (small) list once per process rather than pickling all rows.
        rows: list[dict[str, Any]] | None = getattr(self, "_rows", None)
        if rows is None:
            rows = self._table()
            self._rows = rows
        return rows

    def __getstate__(self) -> dict[str, Any]:
        """Only the options: a task reads the list again rather than receive every row."""
        return {"list_path": self.list_path, "path_column": self.path_column,
                "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (a Ray task) opens its own stores and threads."""
        self.__init__(**state)  # type: ignore[misc]

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json.

        Returns:
            ``{"type": "filelist", "path": <the list>}``.
        """
        return {"type": "filelist", "path": self.list_path}

    def labels(self) -> dict[str, int] | None:
        """The class map of a ``label`` column of names (reads the list if not yet read).

        Returns:
            Class name -> index, the sorted distinct names numbered from 0; None for numeric
            labels or no ``label`` column.

        Raises:
            SourceNotFoundError: the list does not exist.
            SourceError: the list is unreadable, lacks the path column or holds a reserved column.
        """
        return self._classes() or None


def _label_class(label: Any, where: str) -> int | str:
    """The class a file list's ``label`` value names: an index, or a class name to number.

    Integral floats are indices: pandas writes integer labels with one missing value as
    float64. A missing label (null, NaN, empty) or any other value is refused: a sample without
    ``cls`` among samples with it breaks batching downstream.

    Args:
        label: the row's ``label`` value.
        where: the row, for the error.

    Returns:
        A class index (int) or a class name (str).

    Raises:
        SourceError: naming ``where``, for a missing label or one of another type.
    """
    if label is None or label == "" or (isinstance(label, float) and math.isnan(label)):
        raise SourceError(f"{where}: the label is missing (every row of a list with a 'label' column needs one)")
    if isinstance(label, float) and label.is_integer():
        return int(label)
    if isinstance(label, str) or (isinstance(label, int) and not isinstance(label, bool)):
        return label
    raise SourceError(f"{where}: label {label!r} is neither a class index (a whole number) nor a class name")


def _relative_url(base: str, rel: str) -> str | None:
    """``rel`` resolved against the folder URL ``base`` as a path on disk is against its folder:
    ``.`` and ``..`` segments are resolved (an object store would take them as part of the key).

    Args:
        base: the list's folder URL (``s3://bucket/lists``).
        rel: a relative posix path (``../img/a.jpg``).

    Returns:
        The URL, or None when ``..`` climbs above the bucket.
    """
    if not any(seg in (".", "..") for seg in rel.split("/")):
        return join_url(base, rel)
    scheme, _, rest = base.partition("://")
    bucket, _, prefix = rest.partition("/")
    parts = [seg for seg in prefix.split("/") if seg]
    for seg in rel.split("/"):
        if seg == "..":
            if not parts:
                return None
            parts.pop()
        elif seg != ".":
            parts.append(seg)
    return join_url(f"{scheme}://{bucket}", "/".join(parts))


def _list_field(path: str) -> str:
    """The field a file list's file (path or URL) is packed as: its lowercased extension, ``bin`` if none."""
    ext = PurePosixPath(path).suffix.lower().lstrip(".") or "bin"
    return "jpg" if ext == "jpeg" else ext


# pyarrow's default CSV null spellings: in a numeric or boolean column they are missing values.
_CSV_NULLS = frozenset({"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                        "N/A", "NA", "NULL", "NaN", "n/a", "nan", "null"})
_CSV_INT = re.compile(r"^(0|-?[1-9][0-9]{0,17})$")  # exactly str(int(v)) == v, and fits int64
_CSV_FLOAT = re.compile(r"^-?[0-9]+\.[0-9]+$")
_CSV_BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}


def _csv_values(column: Any) -> Any:
    """A CSV column read as text, typed only where nothing is lost.

    Integers if every value reads back as written (``str(int(v)) == v``: ``"0012"`` keeps the
    column text), floats likewise (``repr(float(v)) == v``, integers allowed), booleans if
    every value is true/false; otherwise the text as given. In a typed column the usual null
    spellings (empty, ``NA``, ...) are missing values; in a text column they stay text.

    Args:
        column: a pyarrow string column.

    Returns:
        A typed pyarrow array, or ``column`` itself when it stays text.
    """
    values: list[str] = column.to_pylist()
    present = [v for v in values if v not in _CSV_NULLS]
    if not present:
        return pa.array([None] * len(values), pa.null())
    if all(_CSV_INT.match(v) for v in present):
        return pa.array([None if v in _CSV_NULLS else int(v) for v in values], pa.int64())
    if all(_CSV_INT.match(v) or (_CSV_FLOAT.match(v) and repr(float(v)) == v) for v in present):
        return pa.array([None if v in _CSV_NULLS else float(v) for v in values], pa.float64())
    if all(v in _CSV_BOOL for v in present):
        return pa.array([None if v in _CSV_NULLS else _CSV_BOOL[v] for v in values], pa.bool_())
    return column
