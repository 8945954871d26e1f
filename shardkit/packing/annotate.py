"""Side columns: :func:`annotate` adds a table's columns (scores, captions, embedding ids) to a
committed dataset without rewriting its shards or samples fragments.

Storage: one new file, ``manifest/annotations/<name>.parquet``, holding ``__index__`` (the
global sample index each row's key resolves to, ascending) and the table's columns; readers
join it on ``__index__`` (:mod:`shardkit.read.annotations`). Keys are resolved once, here, so a
read joins on an integer instead of a 20 M-string key column, and the samples fragments (most
of a manifest's bytes) are never rewritten: an annotation costs the size of its own columns,
and any number of them can be added, replaced (``overwrite``) or deleted independently. The
file records the shards it was written for, so a re-pack at the URL makes readers refuse it
instead of joining stale rows.
"""

from __future__ import annotations

import io
import os
import re
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from shardkit.errors import ConfigError, SourceError, first_line
from shardkit.read.annotations import ANNOTATIONS_DIR, annotation_meta
from shardkit.read.cache_refs import cache_namespace
from shardkit.read.dataset import Dataset
from shardkit.read.manifest_copies import manifest_copies_dir
from shardkit.read.where import connect

__all__ = ["annotate"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_LISTED = 5  # offending keys a refusal names


def _q(name: str) -> str:
    """A SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def _table(table: str | os.PathLike[str] | pa.Table) -> tuple[pa.Table, str]:
    if isinstance(table, pa.Table):
        return table, "the table"
    path = os.fspath(table)
    try:
        return pq.read_table(path, use_threads=False), path
    except FileNotFoundError:
        raise SourceError(f"annotation table {path} does not exist") from None
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"annotation table {path} is not a readable Parquet file ({first_line(exc)})") from None


def _listed(rows: list[tuple[Any, ...]]) -> str:
    return ", ".join(repr(r[0]) for r in rows[:_LISTED]) + (" ..." if len(rows) > _LISTED else "")


def annotate(dest: str, table: str | os.PathLike[str] | pa.Table, *, on: str = "key", name: str | None = None,
             storage_options: dict[str, Any] | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Add the columns of ``table`` to the dataset at ``dest``, joined on ``on``.

    Every key of the table must name exactly one sample, and each at most once; samples the
    table does not list get nulls. The columns are then usable in ``where=`` and returned by
    readers asked for them (``StreamingDataset(annotations=True)``) as ``__annotations__``.

    Args:
        dest: the dataset root.
        table: a Parquet file's path, or an Arrow table.
        on: the table's column matching the manifest column of the same name (``key``, or a
            metadata column whose values are unique).
        name: the annotation's name (default: the file's stem; ``annotations`` for a table).
        storage_options: fsspec options for ``dest``.
        overwrite: replace an annotation of the same name (else refused).

    Returns:
        ``{"name", "path", "rows", "columns"}``: what was written.

    Raises:
        ConfigError: a bad ``name``; ``on`` is no column of the table or the manifest; a
            column clashes with a manifest or side column; a key is missing from the
            dataset, null, listed twice or names several samples (one line, listing some).
        DatasetExistsError: the annotation exists and ``overwrite`` is False.
        DatasetNotFoundError: there is no dataset at ``dest``.
        SourceError: ``table`` is unreadable.
        StorageError: the store failed.
    """
    data, what = _table(table)
    if name is None:
        name = "annotations" if isinstance(table, pa.Table) else os.path.splitext(os.path.basename(os.fspath(table)))[0]
    if not _NAME.match(name):
        raise ConfigError(f"annotation name {name!r}: use letters, digits, '_', '.' and '-' (up to 100)")
    if on not in data.column_names:
        raise ConfigError(f"{what} has no column {on!r} to join on (columns: {', '.join(data.column_names)})")
    added = [c for c in data.column_names if c != on]
    if not added:
        raise ConfigError(f"{what} has no column besides {on!r}: nothing to add")
    ds = Dataset(dest, storage_options)
    ds.manifest_cache = manifest_copies_dir(cache_namespace(ds))
    path = f"{ANNOTATIONS_DIR}/{name}.parquet"
    sql = connect(ds)
    con = sql.con
    try:
        have = [c for c in con.table("samples").columns if c != "__index__"]
        if on not in have:
            raise ConfigError(f"{ds.url} has no manifest column {on!r} to join on (columns: {', '.join(have)})")
        base = set(con.table("_rows").columns)
        clash = [c for c in added if c in base]
        if clash:
            raise ConfigError(f"{what}: column(s) {', '.join(map(repr, clash))} are manifest columns of {ds.url}; "
                              "rename them")
        side = [c for c in added if c in have]
        if side and not overwrite:
            raise ConfigError(f"{what}: column(s) {', '.join(map(repr, side))} exist in an annotation of {ds.url}; "
                              "rename them (or overwrite=True to replace the annotation of the same name)")
        con.register("_t", data)
        k = _q(on)
        nulls = con.execute(f"SELECT count(*) FROM _t WHERE {k} IS NULL").fetchone()[0]
        if nulls:
            raise ConfigError(f"{what}: {nulls} row(s) have no {on!r}")
        dup = con.execute(f"SELECT {k}, count(*) FROM _t GROUP BY 1 HAVING count(*) > 1 ORDER BY 1 "
                          f"LIMIT {_LISTED + 1}").fetchall()
        if dup:
            raise ConfigError(f"{what} lists {on} {_listed(dup)} more than once; each key at most once")
        missing = con.execute(f"SELECT {k} FROM _t ANTI JOIN samples USING ({k}) ORDER BY 1 "
                              f"LIMIT {_LISTED + 1}").fetchall()
        if missing:
            count = con.execute(f"SELECT count(*) FROM _t ANTI JOIN samples USING ({k})").fetchone()[0]
            raise ConfigError(f"{what}: {count} {on} value(s) are not in {ds.url}: {_listed(missing)}")
        ambiguous = con.execute(f"SELECT {k} FROM samples SEMI JOIN _t USING ({k}) GROUP BY 1 HAVING count(*) > 1 "
                                f"ORDER BY 1 LIMIT {_LISTED + 1}").fetchall()
        if ambiguous:
            raise ConfigError(f"{ds.url}: {on} {_listed(ambiguous)} names several samples; join on a unique column")
        picks = ", ".join(f"_t.{_q(c)}" for c in added)
        rel = con.sql(f"SELECT s.__index__, {picks} FROM _t JOIN (SELECT __index__, {k} FROM samples) s "
                      f"USING ({k}) ORDER BY s.__index__")
        # duckdb 1.4 renamed arrow() (which now returns a reader) to to_arrow_table().
        joined = rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()
    finally:
        sql.close()
    joined = joined.replace_schema_metadata(annotation_meta(ds, on))
    buf = io.BytesIO()
    pq.write_table(joined, buf, compression="zstd")
    if overwrite:
        ds.store.put_bytes(path, buf.getvalue())
    else:
        ds.store.put_create(path, buf.getvalue())
    return {"name": name, "path": ds.store.url_of(path), "rows": joined.num_rows, "columns": added}
