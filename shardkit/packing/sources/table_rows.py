"""Rows of an Arrow table as samples: which column becomes which field or metadata value.

Shared by :class:`~shardkit.packing.sources.table.TableSource` (Parquet / Arrow files) and
the Hugging Face sources (:mod:`~shardkit.packing.sources.hf`), whose rows are Arrow too. The
rule, per column (:func:`plan_columns`):

- ``key`` (for Hugging Face datasets also ``__key__``): the sample's key (not metadata);
- binary: a field holding the bytes as stored; named after the column, or as
  ``payload_columns`` says (``{"img": "jpg"}``: column ``img`` -> field ``jpg``);
- a struct of ``bytes`` (and ``path``), as Hugging Face stores an ``Image`` or ``Audio``: the
  bytes as stored (never re-encoded) as field ``<column>.<ext>``, ``ext`` from the ``path``'s
  suffix, else from the bytes' magic number (jpg, png, gif, webp, bmp, tiff), else ``bin``;
  with no bytes, the file at ``path`` is read;
- a class label, i.e. a Hugging Face ``ClassLabel`` column, or an integer column named
  ``label``: field ``cls`` (the index as text; a second such column ``<column>.cls``) and also
  metadata (the index);
- lists of numbers: ``<column>.npy`` (its Arrow value type kept: float32 stays float32);
- strings: metadata, or with ``text_fields`` (Hugging Face datasets) field ``<column>.txt``;
- other scalars (numbers, booleans, dates): metadata.

Anything else (a struct of other fields, a map) is refused naming the column. A null value
leaves its field (or metadata value) out of that row.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from shardkit.errors import SourceError
from shardkit.packing.sample import MANIFEST_COLUMNS, FieldValue, check_field_name, safe_key
from shardkit.packing.sources.npy import npy_header

__all__ = ["Column", "RowPlan", "parse_payload_columns", "plan_columns", "sniff_ext"]

_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"GIF8", "gif"), (b"BM", "bmp"),
          (b"II*\x00", "tiff"), (b"MM\x00*", "tiff"), (b"fLaC", "flac"), (b"OggS", "ogg"))


def sniff_ext(data: bytes, path: str | None = None) -> str:
    """The extension for an encoded blob: the path's suffix, else its magic number.

    Args:
        data: the bytes.
        path: the file it came from, if known.

    Returns:
        ``jpg``, ``png``, ... (``jpeg`` is written ``jpg``), or ``bin`` when unknown.
    """
    if path:
        ext = os.path.splitext(path)[1].lower().lstrip(".")
        if ext and ext.isalnum():
            return "jpg" if ext == "jpeg" else ext
    if data[:4] == b"RIFF" and data[8:12] in (b"WEBP", b"WAVE"):
        return "webp" if data[8:12] == b"WEBP" else "wav"
    return next((ext for magic, ext in _MAGIC if data.startswith(magic)), "bin")


def parse_payload_columns(spec: str | Mapping[str, str] | None) -> dict[str, str]:
    """``"img:jpg,depth:npy"`` (or a dict) as column -> field.

    Args:
        spec: the option as given.

    Returns:
        Column name -> field name.

    Raises:
        SourceError: an entry is not ``column:field``.
    """
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        return dict(spec)
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        column, colon, field = part.partition(":")
        if not colon or not column or not field:
            raise SourceError(f"--payload-columns: {part!r} is not column:field (e.g. img:jpg)")
        out[column] = field
    return out


@dataclass(frozen=True)
class Column:
    """How one column is packed.

    Attributes:
        name: the column.
        role: ``field``, ``blob`` (bytes + path struct), ``cls``, ``npy``, ``text`` or ``meta``.
        field: the field it makes (its stem for a ``blob``); empty for ``meta``.
        dtype: the numpy dtype of an ``npy`` column's values.
    """

    name: str
    role: str
    field: str
    dtype: Any = None


@dataclass(frozen=True)
class RowPlan:
    """The columns of a table, planned (see the module docstring).

    Attributes:
        columns: every column but the key, planned.
        key_column: the key column's name, or None (keys are row numbers then).
        classes: class names of the ``cls`` column (Hugging Face ``ClassLabel``), or None.
    """

    columns: tuple[Column, ...]
    key_column: str | None
    classes: tuple[str, ...] | None

    def fields_of(self, row: dict[str, Any], where: str) -> tuple[dict[str, FieldValue], dict[str, Any]]:
        """One row (as ``Table.to_pylist`` gives it) as fields and metadata.

        Args:
            row: column -> value.
            where: the row, for errors.

        Returns:
            (fields, metadata).

        Raises:
            SourceError: the row has no payload, a list is ragged, or a blob has no bytes and
                its path cannot be read.
        """
        fields: dict[str, FieldValue] = {}
        meta: dict[str, Any] = {}
        for col in self.columns:
            value = row.get(col.name)
            if value is None:
                continue
            if col.role == "meta":
                meta[col.name] = value
            elif col.role == "field":
                fields[col.field] = bytes(value)
            elif col.role == "text":
                fields[col.field] = str(value).encode("utf-8")
            elif col.role == "cls":
                fields[col.field] = str(int(value)).encode()
                meta[col.name] = int(value)
            elif col.role == "npy":
                fields[col.field] = _npy(value, col, where)
            else:  # blob
                data, path = value.get("bytes"), value.get("path")
                if data is None:
                    data = _read_path(path, col.name, where)
                fields[f"{col.field}.{sniff_ext(data, path)}"] = bytes(data)
        if not any(c.role != "meta" and row.get(c.name) is not None for c in self.columns):
            raise SourceError(f"{where}: the row has no payload (every payload column is null)")
        return fields, meta

    def key(self, row: dict[str, Any], index: int) -> str:
        """The key of a row: its key column, else the row number (9 digits).

        Args:
            row: column -> value (only the key column is needed).
            index: the row number.

        Returns:
            The tar-safe key.
        """
        raw = row.get(self.key_column) if self.key_column else None
        if raw is None or raw == "":
            return f"{index:09d}"
        return safe_key(raw if isinstance(raw, bytes) else str(raw))


def _npy(value: Any, col: Column, where: str) -> bytes:
    try:
        array = np.asarray(value, dtype=col.dtype)
    except ValueError as exc:  # ragged nested lists
        raise SourceError(f"{where}: column {col.name!r}: not an array ({exc})") from None
    if array.dtype == object:
        raise SourceError(f"{where}: column {col.name!r}: a ragged list is no array")
    return npy_header(array.dtype, array.shape) + np.ascontiguousarray(array).tobytes()


def _read_path(path: str | None, column: str, where: str) -> bytes:
    if not path:
        raise SourceError(f"{where}: column {column!r} has neither bytes nor a path")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SourceError(f"{where}: column {column!r}: cannot read {path}: {exc.strerror or exc}") from None


def _hf_features(schema: pa.Schema) -> dict[str, Any]:
    """The Hugging Face ``features`` recorded in an Arrow schema's metadata (``{}`` if none)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return {}
    try:
        info = json.loads(raw)
    except ValueError:
        return {}
    features = info.get("info", {}).get("features") if isinstance(info, dict) else None
    return features if isinstance(features, dict) else {}


def _numeric_list(t: pa.DataType) -> pa.DataType | None:
    """The value type of a (nested) list of numbers, else None."""
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return None
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    return t if (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)) else None


def plan_columns(schema: pa.Schema, where: str, payload_columns: Mapping[str, str] | None = None,
                 text_fields: bool = False, key_columns: tuple[str, ...] = ("key",)) -> RowPlan:
    """Plan how each column of ``schema`` is packed, by the rule in the module docstring.

    Args:
        schema: the table's schema (its Hugging Face metadata read if present).
        where: the table, for errors.
        payload_columns: column -> field for binary columns.
        text_fields: strings become ``<column>.txt`` fields (else metadata), except in
            columns named ``__<name>__`` (WebDataset's ``__url__``), kept as metadata.
        key_columns: the names a key column may have, the first found is it.

    Returns:
        The plan.

    Raises:
        SourceError: a column of a type with no rule, a ``payload_columns`` column missing,
            a field name made twice or invalid, a reserved metadata name, or no payload column.
    """
    payload = dict(payload_columns or {})
    missing = sorted(set(payload) - set(schema.names))
    if missing:
        raise SourceError(f"{where}: --payload-columns names {missing[0]!r}, which is no column "
                          f"(columns: {schema.names})")
    hf = _hf_features(schema)
    columns: list[Column] = []
    classes: tuple[str, ...] | None = None
    key_column = next((k for k in key_columns if k in schema.names), None)
    for f in schema:
        if f.name == key_column:
            continue
        t = f.type
        while isinstance(t, pa.ExtensionType):  # Hugging Face's Array2D..Array5D: lists underneath
            t = t.storage_type
        if pa.types.is_dictionary(t):  # pandas categoricals: rows read back as their values
            t = t.value_type
        feature: dict[str, Any] = hf[f.name] if isinstance(hf.get(f.name), dict) else {}
        if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
            columns.append(Column(f.name, "field", payload.get(f.name, f.name)))
        elif pa.types.is_struct(t) and "bytes" in [t.field(i).name for i in range(t.num_fields)]:
            columns.append(Column(f.name, "blob", payload.get(f.name, f.name)))
        elif pa.types.is_integer(t) and (feature.get("_type") == "ClassLabel" or f.name == "label"):
            first = not any(c.role == "cls" for c in columns)
            columns.append(Column(f.name, "cls", "cls" if first else f"{f.name}.cls"))
            if first and feature.get("_type") == "ClassLabel" and isinstance(feature.get("names"), list):
                classes = tuple(str(n) for n in feature["names"])
        elif _numeric_list(t) is not None:
            value_type = _numeric_list(t)
            assert value_type is not None
            columns.append(Column(f.name, "npy", f"{f.name}.npy", np.dtype(value_type.to_pandas_dtype())))
        elif (pa.types.is_string(t) or pa.types.is_large_string(t)) and text_fields and not f.name.startswith("__"):
            columns.append(Column(f.name, "text", f"{f.name}.txt"))
        elif not pa.types.is_nested(t):
            columns.append(Column(f.name, "meta", ""))
        else:
            raise SourceError(f"{where}: column {f.name!r} of type {t} has no rule to pack it (binary, a struct of "
                              "bytes and path, lists of numbers, strings and scalars do): drop or convert it")
    _check(columns, where)
    return RowPlan(tuple(columns), key_column, classes)


def _check(columns: list[Column], where: str) -> None:
    made: dict[str, str] = {}
    for col in columns:
        if col.role in ("meta", "cls"):
            if col.name in MANIFEST_COLUMNS or col.name == "source":
                raise SourceError(f"{where}: column {col.name!r} is a reserved metadata name (the manifest "
                                  "has its own); rename the column")
        if col.role == "meta":
            continue
        try:
            check_field_name(col.field)
        except SourceError as exc:
            raise SourceError(f"{where}: column {col.name!r}: {exc}") from None
        if col.field.lower() in made:
            raise SourceError(f"{where}: columns {made[col.field.lower()]!r} and {col.name!r} both make field "
                              f"{col.field!r}")
        made[col.field.lower()] = col.name
    if not made:
        raise SourceError(f"{where}: no payload column (binary, a struct of bytes and path, lists of numbers"
                          " or a label): nothing to pack")
