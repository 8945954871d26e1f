"""A CSV or Parquet file list as a source: one sample per row's file, the other columns metadata.

CSV columns are read as text and typed only where nothing is lost (:func:`_csv_values`): an id
``"0001"`` stays text. A ``label`` column becomes the ``cls`` field: class indices as given,
class names numbered in sorted order.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from shardkit.errors import SourceError
from shardkit.packing.sample import MANIFEST_COLUMNS, FieldValue, PackSample, safe_key
from shardkit.packing.sources.base import ListingSkips, SourceItem, item_bytes
from shardkit.packing.sources.files import check_image, check_root, ensure_unique, read_field
from shardkit.storage.urls import refuse_url_credentials

__all__ = ["FileListSource"]


class FileListSource:
    """A CSV or Parquet table with a path column; every other column becomes metadata.

    Relative paths are resolved against the list file's directory. An optional ``key``
    column names the samples; otherwise the key is the path without its extension.

    Args:
        list_path: the ``.csv``, ``.parquet`` or ``.pq`` file (local path).
        path_column: the column naming each sample's file.
    """

    def __init__(self, list_path: str | os.PathLike[str], path_column: str = "path") -> None:
        self.list_path = str(list_path)
        self.path_column = path_column
        self.listing = ListingSkips()

    def _table(self) -> list[dict[str, Any]]:
        p = check_root(self.list_path)
        try:
            if p.suffix.lower() in (".parquet", ".pq"):
                table = pq.read_table(p)  # typed by its writer: taken as is
            else:
                # Every column as text first: pyarrow's type inference would read a zip code
                # "00123" or an id "0001" as the integers 123 and 1.
                with pacsv.open_csv(p) as head:
                    names = head.schema.names
                table = pacsv.read_csv(p, convert_options=pacsv.ConvertOptions(
                    column_types={n: pa.string() for n in names}, strings_can_be_null=False))
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad files
            raise SourceError(f"cannot read file list {p}: {exc}") from exc
        if self.path_column not in table.column_names:
            raise SourceError(f"file list {p} has no {self.path_column!r} column (columns: {table.column_names})")
        if table.num_rows == 0:
            raise SourceError(f"file list {p} is empty")
        for name in table.column_names:
            if name in (self.path_column, "key"):
                continue  # the path and the key are not metadata: they make the sample
            if name == "source":  # kept for every source: the input each sample came from
                raise SourceError(f"file list {p}: column 'source' is reserved (shardkit records each sample's "
                                  "path there); rename the column")
            if name in MANIFEST_COLUMNS:
                raise SourceError(f"file list {p}: column {name!r} is reserved (the manifest has its own "
                                  f"{name!r} column); rename the column")
        if p.suffix.lower() not in (".parquet", ".pq"):
            for i, name in enumerate(table.column_names):
                if name not in (self.path_column, "key"):
                    table = table.set_column(i, name, _csv_values(table.column(i)))
        return table.to_pylist()

    def list_items(self) -> list[SourceItem]:
        """One item per row, in row order (one ``stat`` per file; no data read).

        Returns:
            The items; ``ref`` is ``<row>:<path>``.

        Raises:
            SourceNotFoundError: the list does not exist.
            SourceError: the list is unreadable, lacks the path column or holds a reserved
                column; a row's file is missing, its path empty or its label bad (unless
                skipped); two rows share a key.
            ConfigError: a row's path is a URL carrying credentials or a signature.
        """
        base = Path(self.list_path).parent
        items = []
        self.listing.skipped.clear()
        self._rows = self._table()  # fresh: the local engine's tasks and labels() reuse it
        self.__dict__.pop("_class_map", None)
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
            path = Path(rel) if os.path.isabs(rel) else base / rel
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                self.listing.bad(f"{self.list_path}: row {i}", f"file list {self.list_path}: row {i}: {path} does not exist")
                continue
            key = row.get("key")  # 0 and "00" are keys too: only a missing one falls back to the path
            key = safe_key(str(key) if key is not None and key != "" else Path(rel).with_suffix("").as_posix())
            members = [(_list_field(path), size)]
            if "label" in row:
                members.append(("cls", 1))  # any class index fits the one block a 1-byte body takes
            items.append(SourceItem(ref=f"{i}:{path}", nbytes=item_bytes(key, members), key=key))
        ensure_unique(items, self.list_path)
        return items

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
        index, _, p = item.ref.partition(":")
        path = Path(p)
        row = self._row(int(index))
        ext = _list_field(path)
        meta = {k: v for k, v in row.items() if k not in (self.path_column, "key")}
        meta["source"] = row[self.path_column]
        fields: dict[str, FieldValue] = {ext: read_field(path)}
        check_image(path, ext, fields[ext])
        if "label" in row:
            cls = _label_class(row["label"], f"file list {self.list_path}: row {index}")
            # A class name is numbered; the column keeps the name (and an integral float as written).
            fields["cls"] = str(self._classes()[cls] if isinstance(cls, str) else cls).encode()
        return PackSample(item.key, fields, meta)

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
        return {"list_path": self.list_path, "path_column": self.path_column}

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


def _list_field(path: Path) -> str:
    """The field a file list's file is packed as: its lowercased extension, ``bin`` if none."""
    ext = path.suffix.lower().lstrip(".") or "bin"
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
