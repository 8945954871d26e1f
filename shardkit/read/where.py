"""Evaluating a ``where=`` query over a dataset's sample manifest with DuckDB: the sorted global
indices of the samples it selects.

The samples fragments are read from local files (the node's manifest copies, fetched from
storage once per node when missing). A fragment holds one row group per shard, each shard's
rows in order, so a row's global index is its position in its file plus a per-row-group
offset. A query naming no side column is a plain scan of the files that returns each matching
row's file and position (DuckDB's ``file_index`` and ``file_row_number``), mapped to global
indices with numpy: no join, rows in order. With side columns (:mod:`shardkit.read.annotations`)
the query runs over the view ``samples``: every manifest column, ``__index__`` (made by a join
with a table of one row per shard) and the side columns joined on it. DuckDB reads only the
columns the query names (projection pushdown) and streams the files, so memory stays bounded
by the result, not the manifest.

A node's first rank fetches the fragments before it can query them (677 MB for 20 M rows). A
query naming no side column therefore runs on each fragment as soon as it has landed, while
the next ones download, and the per-fragment results are put together in fragment order: the
query costs little more than the download. Whenever that cannot give the plain scan's answer
(fragments whose columns differ, so the scan would unify them; a condition DuckDB refuses) the
whole-manifest query runs over the local copies instead, and says what is wrong.

Figures for a 20 M-row manifest are in ``benchmarks/RESULTS.md`` (``bench_where.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardkit.errors import ConfigError, ManifestError, first_line
from shardkit.format.manifest import parquet_file
from shardkit.read.annotations import annotation_files, annotation_listing
from shardkit.read.dataset import Dataset
from shardkit.read.manifest import check_same_pack
from shardkit.read.manifest_copies import copy_path, keep_copy

__all__ = ["COPY_THREADS", "DUCKDB_MEMORY", "ManifestSQL", "connect", "duckdb_module", "landing_fragments",
           "local_fragments", "where_count", "where_indices"]

# DuckDB's own bound: it spills or fails past it instead of growing with the manifest.
DUCKDB_MEMORY = "512MB"
# Fragments fetched at once by the node's first rank (each is held whole while it is kept).
COPY_THREADS = 4

_T = TypeVar("_T")


def duckdb_module() -> Any:
    """The ``duckdb`` module, imported on first use (it is an optional dependency).

    Returns:
        The module.

    Raises:
        ConfigError: duckdb is not installed (with the install hint).
    """
    try:
        import duckdb
    except ImportError:
        raise ConfigError('where= needs duckdb: pip install "shardkit[query]"') from None
    return duckdb


def local_fragments(ds: Dataset, scratch: str) -> dict[str, str]:
    """Local files of every samples fragment of ``ds``: its node manifest copies, each fetched
    from storage (and checked to be of this pack) when missing or of another pack; without a
    copies directory, in ``scratch``.

    Args:
        ds: the dataset.
        scratch: where copies go when ``ds`` has no ``manifest_cache`` (the caller removes it).

    Returns:
        Fragment name -> local path, in name order.

    Raises:
        ManifestError: the manifest lacks the per-shard row-group columns, or a fragment is
            unreadable or of another pack.
        StorageError: a fragment could not be read.
    """
    return dict(landing_fragments(ds, scratch))


def landing_fragments(ds: Dataset, scratch: str) -> Iterator[tuple[str, str]]:
    """Every samples fragment of ``ds`` as a local file, in name order, each yielded as soon as
    it is there: the node's copies at once, the missing ones as their fetch (up to
    :data:`COPY_THREADS` at a time, in name order) lands, so the caller works on one while the
    next ones download.

    Args:
        ds: the dataset.
        scratch: where copies go when ``ds`` has no ``manifest_cache`` (the caller removes it).

    Yields:
        (fragment name, local path), in name order.

    Raises:
        ManifestError: the manifest lacks the per-shard row-group columns, or a fragment is
            unreadable or of another pack.
        StorageError: a fragment could not be read.
    """
    names = sorted({s.samples_file for s in ds.shard_list if s.num_samples})
    if any(s.num_samples and (not s.samples_file or s.samples_row_group < 0) for s in ds.shard_list):
        raise ManifestError(f"{ds.url}: where= needs shards.parquet's samples_file/samples_row_group columns "
                            "(a manifest of an older shardkit): re-pack or re-index it")
    where = ds.manifest_cache or scratch
    out = {name: copy_path(where, name) for name in names}
    missing = [name for name, path in out.items() if not os.path.exists(path) or not _copy_of_pack(ds, path)]
    if not missing:
        yield from out.items()
        return
    # Fetched a few at a time: one GET at a time leaves a remote store's bandwidth idle
    # behind each request's latency, and the node's first rank waits for every fragment.
    pool = ThreadPoolExecutor(min(COPY_THREADS, len(missing)), thread_name_prefix="shardkit-where")
    try:
        # Submitted in name order, so the fragments land roughly in the order they are yielded.
        fetches: dict[str, Future[None]] = {name: pool.submit(_fetch_copy, ds, name, where, out[name])
                                            for name in missing}
        for name, path in out.items():
            if name in fetches:
                fetches[name].result()
            yield name, path
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a caller that stopped early fetches no more


def _copy_of_pack(ds: Dataset, path: str) -> bool:
    """Whether the node's copy of a fragment at ``path`` describes ``ds``'s shards (a
    footer read): appended versions share the copies directory, which must never serve a
    copy of another pack's fragment of that name. A copy that does not is fetched again."""
    try:
        check_same_pack(pq.ParquetFile(path), path, ds.url, ds.shard_list)
    except (ManifestError, pa.ArrowException, OSError):
        return False
    return True


def _fetch_copy(ds: Dataset, name: str, where: str, path: str) -> None:
    """Fetch fragment ``name``, check it is of this pack, and keep it at ``path`` (in ``where``)."""
    data = ds.store.read_bytes(name)
    check_same_pack(parquet_file(data, ds.store.url_of(name)), ds.store.url_of(name), ds.url, ds.shard_list)
    keep_copy(where, name, data)  # best effort: renamed into place
    if not os.path.exists(path):
        raise ManifestError(f"could not keep a local copy of {ds.store.url_of(name)} in {where}")


class ManifestSQL:
    """A DuckDB connection over a dataset's manifest (made by :func:`connect`).

    Args:
        con: the connection; its view ``samples`` has every manifest column, the side
            columns and ``__index__`` (the global sample index, made by a join per shard).
        scan: the SQL of a plain scan of the fragments (every manifest column, with the
            virtual ``file_index`` and ``file_row_number``): no join, for queries that name
            no side column.
        firsts: per fragment (in the scan's file order), where each row group starts and
            the global index of its first row.
        annotated: whether the dataset has side columns.
        scratch: a directory of copies to remove on :meth:`close`.
    """

    def __init__(self, con: Any, scan: str, firsts: list[tuple[np.ndarray, np.ndarray]], annotated: bool,
                 scratch: str) -> None:
        self.con, self.scan, self.annotated = con, scan, annotated
        self._firsts, self._scratch = firsts, scratch

    def close(self) -> None:
        """Close the connection and remove the copies made without a node copies directory."""
        self.con.close()
        shutil.rmtree(self._scratch, ignore_errors=True)

    def global_indices(self, file_index: np.ndarray, row: np.ndarray) -> np.ndarray:
        """Global sample indices of rows given by (file, row in the file), grouped by file.

        Args:
            file_index: each row's file (a scan yields them ascending).
            row: each row's position in its file.

        Returns:
            The global indices, int64, in the order given.

        Raises:
            ManifestError: a row lies in a row group no shard names.
        """
        return _global_indices(self._firsts, file_index, row)


def _global_indices(firsts: list[tuple[np.ndarray, np.ndarray]], file_index: np.ndarray, row: np.ndarray) -> np.ndarray:
    """:meth:`ManifestSQL.global_indices` over the per-fragment row-group starts ``firsts``."""
    if file_index.size > 1 and not bool(np.all(file_index[1:] >= file_index[:-1])):
        order = np.argsort(file_index, kind="stable")  # a scan yields files in order; in case not
        out = np.empty(row.size, np.int64)
        out[order] = _global_indices(firsts, file_index[order], row[order])
        return out
    out = np.empty(row.size, np.int64)
    cuts = np.searchsorted(file_index, np.arange(len(firsts) + 1, dtype=file_index.dtype))
    for k, (starts, first_of) in enumerate(firsts):
        a, z = int(cuts[k]), int(cuts[k + 1])
        if a == z:
            continue
        r = row[a:z]
        g = np.searchsorted(starts, r, side="right") - 1
        first = first_of[g]
        if int(first.min()) < 0:
            raise ManifestError("a samples fragment holds a row group no shard of shards.parquet names")
        first += r
        first -= starts[g]
        out[a:z] = first
    return out


def connect(ds: Dataset, threads: int | None = None) -> ManifestSQL:
    """A DuckDB connection over ``ds``'s manifest: the view ``samples`` (every manifest column,
    the side columns, and ``__index__``, the global sample index) and a plain scan.

    Args:
        ds: the dataset.
        threads: DuckDB threads (default: the CPUs, at most 4).

    Returns:
        The connection and what maps its rows to samples (close it).

    Raises:
        ConfigError: duckdb is missing, or the dataset holds no samples.
        ManifestError: a fragment or annotation is unreadable or of another pack.
        StorageError: the manifest could not be read.
    """
    duckdb = duckdb_module()
    scratch = tempfile.mkdtemp(prefix="shardkit-where-")
    try:
        return _connect(ds, threads, duckdb, scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


_Starts = tuple[np.ndarray, np.ndarray]  # a fragment's row-group starts, and each group's first global index


def _first_rows(ds: Dataset) -> dict[tuple[str, int], int]:
    """(fragment, row group) -> the global index of its first row, for every shard with samples."""
    return {(s.samples_file, s.samples_row_group): s.first_sample for s in ds.shard_list if s.num_samples}


def _fragment_starts(name: str, meta: pq.FileMetaData, first_rows: dict[tuple[str, int], int]) -> _Starts:
    """Where each row group of fragment ``name`` (its footer ``meta``) starts, and the global
    index of its first row (-1 for a row group no shard names; one more -1 past the end)."""
    starts = np.concatenate(([0], np.cumsum([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])))
    first = np.array([first_rows.get((name, g), -1) for g in range(meta.num_row_groups)] + [-1], np.int64)
    return starts.astype(np.int64), first


def _footer(ds: Dataset, name: str, path: str) -> pq.FileMetaData:
    try:
        return pq.read_metadata(path)
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"local copy of {ds.store.url_of(name)} is unreadable ({first_line(exc)})") from exc


def _shard_deltas(ds: Dataset, starts_of: dict[str, _Starts]) -> tuple[list[int], list[int]]:
    """Per shard with samples: its number, and the delta from a row's position in its
    fragment to its global index (checking each shard's row group is in its fragment)."""
    shard_ids, deltas = [], []
    for s in ds.shard_list:
        if s.num_samples:
            starts, _ = starts_of[s.samples_file]
            if s.samples_row_group >= len(starts) - 1:
                raise ManifestError(f"{ds.url}: shard {s.shard} names row group {s.samples_row_group} of "
                                    f"{s.samples_file}, which has {len(starts) - 1}")
            shard_ids.append(s.shard)
            deltas.append(s.first_sample - int(starts[s.samples_row_group]))
    return shard_ids, deltas


def _scan_sql(paths: list[str], first_index: int = 0) -> str:
    """The plain scan of the fragment files ``paths`` (every manifest column, ``file_index``
    and ``file_row_number``), the first of them numbered ``first_index``. Paths are local
    files this module named, quoted as SQL strings (a view cannot take parameters)."""
    listed = ", ".join("'" + p.replace("'", "''") + "'" for p in paths)
    index = "file_index" if first_index == 0 else f"CAST(file_index + {int(first_index)} AS UBIGINT) AS file_index"
    return f"SELECT {index}, file_row_number, * FROM read_parquet([{listed}], union_by_name = true)"


def _connect(ds: Dataset, threads: int | None, duckdb: Any, scratch: str) -> ManifestSQL:
    files = local_fragments(ds, scratch)
    if not files:
        raise ConfigError(f"where= on {ds.url}: the dataset holds no samples")
    first_rows = _first_rows(ds)
    starts_of = {name: _fragment_starts(name, _footer(ds, name, path), first_rows) for name, path in files.items()}
    firsts = list(starts_of.values())
    shard_ids, deltas = _shard_deltas(ds, starts_of)
    con = _duckdb_connect(duckdb, threads)
    con.register("_shard_delta", pa.table({"shard": pa.array(shard_ids, pa.int32()),
                                           "_delta": pa.array(deltas, pa.int64())}))
    # The user's condition is parsed by DuckDB as an expression only (filter).
    scan = _scan_sql(list(files.values()))
    listed = ", ".join("'" + p.replace("'", "''") + "'" for p in files.values())
    con.execute("CREATE TEMP VIEW _rows AS SELECT p.* EXCLUDE (file_row_number), "
                "p.file_row_number + d._delta AS __index__ "
                f"FROM read_parquet([{listed}], file_row_number = true, union_by_name = true) p "
                "JOIN _shard_delta d USING (shard)")
    joins: list[str] = []
    picks: list[str] = []
    for k, path in enumerate(annotation_files(ds, scratch).values()):
        quoted = "'" + path.replace("'", "''") + "'"
        con.execute(f"CREATE TEMP VIEW _a{k} AS SELECT * FROM read_parquet({quoted})")
        cols = [c for c in con.table(f"_a{k}").columns if c != "__index__"]
        joins.append(f"LEFT JOIN _a{k} ON _a{k}.__index__ = r.__index__")
        picks.extend(f'_a{k}."{c}"' for c in cols)
    select = ", ".join(["r.*"] + picks)
    con.execute(f"CREATE TEMP VIEW samples AS SELECT {select} FROM _rows r {' '.join(joins)}")
    return ManifestSQL(con, scan, firsts, bool(joins), scratch)


def _duckdb_connect(duckdb: Any, threads: int | None) -> Any:
    return duckdb.connect(config={"memory_limit": DUCKDB_MEMORY, "threads": threads or min(os.cpu_count() or 1, 4)})


_VIRTUAL = ("file_index", "file_row_number", "__index__")


def _check_condition(where: str) -> None:
    if not isinstance(where, str) or not where.strip():
        raise ConfigError(f"where= must be a non-empty SQL condition, got {where!r}")


def _filtered(sql: ManifestSQL, ds: Dataset, where: str) -> Any:
    """The relation of samples matching ``where`` (checked to parse and name known columns):
    over the plain scan when the dataset has no side columns (no join: the rows come in
    file order), else over the view ``samples``."""
    _check_condition(where)
    duckdb = duckdb_module()
    rel = sql.con.table("samples") if sql.annotated else sql.con.sql(sql.scan)
    try:
        filtered = rel.filter(where)
        filtered.limit(0).fetchall()  # binds the expression: unknown columns and type errors show here
    except duckdb.Error as exc:
        columns = ", ".join(c for c in rel.columns if c not in _VIRTUAL)
        raise ConfigError(f"where={where!r} on {ds.url}: {first_line(exc)} (columns: {columns})") from None
    return filtered


def _per_fragment(ds: Dataset, where: str, threads: int | None, scratch: str,
                  pick: Callable[[Any, _Starts], _T]) -> list[_T] | None:
    """Fetch the fragments of ``ds`` and run ``where`` on each as soon as it has landed (the
    plain scan of that one file, its ``file_index`` its place among all of them), while the
    next ones download.

    Args:
        ds: the dataset (with no side columns).
        where: the condition.
        threads: DuckDB threads.
        scratch: where copies go without a node copies directory.
        pick: what to take of a fragment's filtered relation (given the fragment's row-group
            starts and their first global indices).

    Returns:
        ``pick``'s result per fragment, in name order; None when they may not be the
        whole-manifest scan's: a fragment's query failed (a bad condition, which the
        whole-manifest query reports) or the fragments' columns differ (that scan unifies
        them by name). Every fragment is local then.

    Raises:
        ConfigError: the dataset holds no samples.
        ManifestError: a fragment is unreadable or of another pack, or a shard names a row
            group its fragment lacks.
        StorageError: a fragment could not be read.
    """
    duckdb = duckdb_module()
    first_rows = _first_rows(ds)
    starts_of: dict[str, _Starts] = {}
    schema: pa.Schema | None = None
    got: list[_T] | None = []
    con = None
    try:
        for k, (name, path) in enumerate(landing_fragments(ds, scratch)):
            if got is None:
                continue  # the fetches go on: the whole-manifest query needs every fragment
            meta = _footer(ds, name, path)
            starts_of[name] = _fragment_starts(name, meta, first_rows)
            if schema is None:
                schema = meta.schema.to_arrow_schema()
            elif not meta.schema.to_arrow_schema().equals(schema, check_metadata=False):
                got = None
                continue
            if con is None:
                con = _duckdb_connect(duckdb, threads)
            try:
                got.append(pick(con.sql(_scan_sql([path], k)).filter(where), starts_of[name]))
            except duckdb.Error:
                got = None
    finally:
        if con is not None:
            con.close()
    if schema is None and got is not None:
        raise ConfigError(f"where= on {ds.url}: the dataset holds no samples")
    if got is not None:
        _shard_deltas(ds, starts_of)  # every shard's row group is where shards.parquet says
    return got


def where_indices(ds: Dataset, where: str, *, threads: int | None = None) -> np.ndarray:
    """The global indices of the samples of ``ds`` that ``where`` selects.

    Args:
        ds: the dataset (its ``manifest_cache``, when set, holds the local fragment copies).
        where: a SQL condition over the manifest's columns (``key``, ``shard``, ``size``, the
            metadata columns the pack recorded, side columns), e.g. ``"label < 500"``.
        threads: DuckDB threads (default: the CPUs, at most 4).

    Returns:
        The selected global sample indices, ascending, int64.

    Raises:
        ConfigError: duckdb is missing, or ``where`` does not parse or names an unknown
            column (the line lists the columns there are).
        ManifestError: a fragment is unreadable or of another pack.
        StorageError: a fragment could not be read.
    """
    _check_condition(where)
    duckdb = duckdb_module()
    scratch = tempfile.mkdtemp(prefix="shardkit-where-")
    try:
        got = None
        if not annotation_listing(ds):
            parts = _per_fragment(ds, where, threads, scratch, _fragment_indices)
            if parts is not None:
                got = np.concatenate(parts)
        if got is None:
            sql = _connect(ds, threads, duckdb, scratch)  # the copies are local now: no fetch
            try:
                if sql.annotated:
                    got = _filtered(sql, ds, where).project("__index__").fetchnumpy()["__index__"]
                else:
                    rows_all = _filtered(sql, ds, where).project("file_index, file_row_number").fetchnumpy()
                    got = sql.global_indices(rows_all["file_index"],
                                             np.asarray(rows_all["file_row_number"], np.int64))
            finally:
                sql.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = np.ascontiguousarray(got, dtype=np.int64)
    if out.size > 1 and not bool(np.all(out[1:] > out[:-1])):
        out.sort(kind="stable")
    return out


def _fragment_indices(rel: Any, starts: _Starts) -> np.ndarray:
    """The global indices of the rows of one fragment's filtered scan ``rel``."""
    row = np.asarray(rel.project("file_row_number").fetchnumpy()["file_row_number"], np.int64)
    return _global_indices([starts], np.zeros(row.size, np.int64), row)


def _count_and_size(rel: Any, starts: _Starts | None = None) -> tuple[int, int]:
    count, size = rel.aggregate("count(*), coalesce(sum(size), 0)").fetchall()[0]
    return int(count), int(size)


def where_count(ds: Dataset, where: str, *, threads: int | None = None) -> tuple[int, int]:
    """How many samples of ``ds`` ``where`` selects, and their bytes.

    Args:
        ds: the dataset.
        where: the SQL condition (as :func:`where_indices`).
        threads: DuckDB threads.

    Returns:
        (selected samples, the sum of their ``size`` in the shards).

    Raises:
        ConfigError: as :func:`where_indices`.
        ManifestError: a fragment is unreadable or of another pack.
        StorageError: a fragment could not be read.
    """
    _check_condition(where)
    duckdb = duckdb_module()
    scratch = tempfile.mkdtemp(prefix="shardkit-where-")
    try:
        if not annotation_listing(ds):
            parts = _per_fragment(ds, where, threads, scratch, _count_and_size)
            if parts is not None:
                return sum(c for c, _ in parts), sum(b for _, b in parts)
        sql = _connect(ds, threads, duckdb, scratch)
        try:
            return _count_and_size(_filtered(sql, ds, where))
        finally:
            sql.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
