"""Choosing the source for what the user passed: a Source object, a path, a glob or a URL.

Directories are sniffed by their files (only tars, only arrays, only HDF5, else a keyed
folder); files by their extension. Nothing is read beyond names and sizes.
"""

from __future__ import annotations

import glob as _glob
import os
import posixpath
import re
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from shardkit.errors import ConfigError, SourceError, SourceNotFoundError
from shardkit.packing.sources.base import Source
from shardkit.packing.sources.filelist import FileListSource
from shardkit.packing.sources.files import FolderSource
from shardkit.packing.sources.imagefolder import ImageFolderSource
from shardkit.packing.sources.hdf5 import Hdf5Source
from shardkit.packing.sources.listing import walk_objects
from shardkit.packing.sources.lmdb import LmdbSource
from shardkit.packing.sources.npy import NpySource
from shardkit.packing.sources.objects import Objects
from shardkit.packing.sources.table import TABLE_SUFFIXES, TableSource, payload_columns_of
from shardkit.packing.sources.tfrecord import TfRecordSource, is_tfrecord_name
from shardkit.packing.sources.tokens import TokenSource
from shardkit.packing.sources.wds import WdsTarSource
from shardkit.packing.sources.zarr import ZarrSource
from shardkit.storage.urls import refuse_url_credentials

__all__ = ["resolve_source"]

_HDF5 = (".h5", ".hdf5", ".hdf", ".he5")
_LMDB = (".mdb", ".lmdb")
_COMPRESSED_TARS = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
# Extensions of single files a URL may name (a Zarr store or LMDB environment is a folder).
_FILES = (".csv", ".parquet", ".pq", ".npy", ".npz", ".json", ".jsonl", ".txt") + _HDF5
_BRACES = re.compile(r"\{[^{}]*(\.\.|,)[^{}]*\}")


def resolve_source(source: Any, *, labels_from_dirs: bool = False, storage_options: dict[str, Any] | None = None,
                   hdf5_rows: str | None = None, zarr_rows: str | None = None,
                   lmdb_field: str | None = None, payload_columns: str | dict[str, str] | None = None,
                   token_dtype: str | None = None, token_column: str | None = None) -> Source:
    """A Source for ``source``: a Source object, a path (folder, list, .h5, .npy, .tar, .tfrecord) or a URL.

    Directories are sniffed by their files: only ``.tar`` -> existing WebDataset shards
    (``.tar`` files beside any other file are refused as ambiguous); only TFRecords -> TFRecords
    (also on URLs: a ``*.tfrecord`` file or glob); only ``.npy``/``.npz`` ->
    arrays; only HDF5 -> HDF5; otherwise a keyed folder (or an ImageFolder with
    ``labels_from_dirs``). Only names and sizes are looked at. A directory or URL holding
    ``zarr.json`` (or named ``*.zarr``) is a Zarr store; one holding ``data.mdb``, or a
    ``.mdb``/``.lmdb`` file, an LMDB environment. Another URL names a file by its extension
    (TFRecord, table or list, HDF5, ``.npy``/``.npz``, ``.tar``), a glob of tars, or a prefix:
    an ImageFolder with ``labels_from_dirs``, tars when its first objects are all ``.tar``,
    TFRecords when they are all TFRecords, else a keyed folder of objects.

    Args:
        source: a Source, or a path, glob or URL (``file://`` too).
        labels_from_dirs: read a folder as an ImageFolder.
        storage_options: fsspec options for a remote source.
        hdf5_rows: for an HDF5 source, the datasets whose rows are the samples.
        zarr_rows: for a Zarr source, the arrays whose rows are the samples.
        lmdb_field: for an LMDB source, the field each value is packed as (default ``bin``).
        payload_columns: for a table (Parquet/Arrow rows holding the payload), column -> field
            of its binary columns (``"img:jpg"``); also picks a table over a file list.
        token_dtype: read the path as tokenized documents (:class:`TokenSource`): the dtype of
            ``.bin`` token files and the dtype stored (``uint16``/``uint32``).
        token_column: read the path as tokenized documents, Parquet rows' token lists in this
            column.

    Returns:
        The source.

    Raises:
        SourceNotFoundError: the path does not exist, or a glob matches nothing.
        SourceError: a type of input no source reads (a file type, a folder of tars and other
            files, an empty folder).
        ConfigError: ``hdf5_rows``, ``zarr_rows``, ``lmdb_field``, ``payload_columns``,
            ``token_dtype`` or ``token_column`` for a source of another kind (not silently
            ignored), or credentials in a URL.
    """
    if (token_dtype is not None or token_column is not None) and isinstance(source, (str, os.PathLike)):
        text = str(source)
        refuse_url_credentials(text, "source")
        if "://" in text and not text.startswith("file://"):
            raise SourceError(f"source {text}: token files are read from local disk; copy them there first")
        path = Path(text[len("file://"):] if text.startswith("file://") else text).absolute()
        if not path.exists():
            raise SourceNotFoundError(f"source {path} does not exist")
        return TokenSource(str(path), token_dtype=token_dtype, token_column=token_column)
    src = _resolve(source, labels_from_dirs=labels_from_dirs, storage_options=storage_options, hdf5_rows=hdf5_rows,
                   zarr_rows=zarr_rows, lmdb_field=lmdb_field, payload_columns=payload_columns)
    for option, value, kind, cls in (("hdf5_rows", hdf5_rows, "HDF5", Hdf5Source),
                                     ("zarr_rows", zarr_rows, "Zarr", ZarrSource),
                                     ("lmdb_field", lmdb_field, "LMDB", LmdbSource),
                                     ("payload_columns", payload_columns, "Parquet/Arrow table", TableSource),
                                     ("token_dtype", token_dtype, "token", TokenSource),
                                     ("token_column", token_column, "token", TokenSource)):
        if value is not None and not isinstance(src, cls):
            raise ConfigError(f"{option} (--{option.replace('_', '-')} {value}) applies to {kind} sources only; "
                              f"{source} is a {src.describe().get('type', type(src).__name__)} source")
    return src


def _zarr(path: str, zarr_rows: str | None, storage_options: dict[str, Any] | None) -> Source:
    return ZarrSource(path, arrays=zarr_rows, mode="rows" if zarr_rows else "arrays", storage_options=storage_options)


def _remote_kind(url: str, storage_options: dict[str, Any] | None) -> str | None:
    """``"zarr"`` or ``"lmdb"`` for a URL that names a Zarr store or an LMDB environment, else
    None. By its name (``*.zarr``, ``*.mdb``, ``*.lmdb``); a URL that no other source reads (no
    ``.tar``, glob or trailing ``/``) is also probed for a ``zarr.json``/``data.mdb`` under it,
    one request each, so URLs of tars cost no request here."""
    base = url.rstrip("/")
    if base.lower().endswith(".zarr"):
        return "zarr"
    if base.lower().endswith(_LMDB):
        return "lmdb"
    if url.endswith("/") or base.endswith(".tar") or "*" in base or posixpath.splitext(base)[1].lower() in _FILES:
        return None  # a URL another source reads by its name: no probe
    import fsspec  # a core dependency; imported here as only this probe needs it

    try:
        fs, root = fsspec.core.url_to_fs(base, **(storage_options or {}))
        if fs.isfile(f"{root}/zarr.json"):
            return "zarr"
        if fs.isfile(f"{root}/data.mdb"):
            return "lmdb"
    except Exception:  # noqa: BLE001 - only a probe: the refusal below names the URL either way
        return None
    return None


_GZIP = (".gz", ".gzip")


def _gzip_tfrecord(name: str) -> bool:
    """Whether a file name is a gzip-compressed TFRecord's (``train.tfrecord.gz``)."""
    stem, suffix = posixpath.splitext(name)
    return suffix.lower() in _GZIP and is_tfrecord_name(stem)


def _tfrecords(where: str, names: list[str]) -> bool:
    """Whether a folder's (or prefix's) files are all TFRecords; refused when they are all
    TFRecords but some gzip-compressed (packed as a keyed folder, each would be one opaque sample)."""
    if not names or not all(is_tfrecord_name(n) or _gzip_tfrecord(n) for n in names):
        return False
    compressed = sorted(n for n in names if _gzip_tfrecord(n))
    if compressed:
        raise SourceError(f"source {where} holds gzip-compressed TFRecord files ({compressed[0]}, "
                          f"{len(compressed)} in all); shardkit reads uncompressed TFRecords only: decompress "
                          "them (gunzip) and pack that")
    return True


def _unsupported(where: str, suffix: str) -> str:
    """The refusal of a single file (or object) that no source reads, saying what to do with
    the compressed kinds that are read once decompressed (a ``.tar.gz``, a ``.tfrecord.gz``)."""
    name = posixpath.basename(where.rstrip("/")).lower()
    if name.endswith(_COMPRESSED_TARS):
        return f"source {where}: a compressed tar; shardkit reads uncompressed .tar files only: decompress it to .tar"
    if _gzip_tfrecord(name):
        return (f"source {where}: a gzip-compressed TFRecord file; shardkit reads uncompressed TFRecords only: "
                "decompress it (gunzip) and pack that")
    return f"source {where}: unsupported file type {suffix or '(none)'}"


# What shardkit keeps beside the tars of a folder it indexed (``shardkit index DIR``), and a
# pack's claim folder: not input, so not "other files" when that folder is packed as tars.
_DATASET_OWN = ("dataset.json", "manifest", "_pack")


def _files(path: Path) -> Iterator[Path]:
    """Every file under ``path``, hidden ones aside, and a committed dataset's own files
    (``dataset.json``, ``manifest/``, ``_pack/``) when ``path`` is one (a generator: a folder
    may hold 20 M)."""
    own = _DATASET_OWN if (path / "dataset.json").is_file() else ()
    return (p for p in path.rglob("*")
            if p.is_file() and not p.name.startswith(".") and p.relative_to(path).parts[0] not in own)


def _mixed_tars(path: Path) -> str:
    """The refusal for a folder of ``.tar`` files and other files: packed as a keyed folder,
    each tar would become one opaque sample (field ``tar``), silently; as tars, the other
    files would be dropped, silently. Neither is safe to guess. (Lists the folder again: only
    on this error.)"""
    tars, others, compressed = 0, [], []
    for p in _files(path):
        if p.suffix.lower() == ".tar":
            tars += 1
        else:
            others.append(p.relative_to(path))
            if p.name.lower().endswith(_COMPRESSED_TARS):
                compressed.append(p.relative_to(path))
    shown = min(compressed or others)
    what = f"{shown}: compressed tars are not supported, decompress it to .tar" if compressed else str(shown)

    def count(n: int, noun: str) -> str:
        return f"{n} {noun}{'' if n == 1 else 's'}"

    return (f"source {path} holds {count(tars, '.tar file')} and {count(len(others), 'other file')} ({what}): "
            "a folder of WebDataset tars must hold only .tar files; move the other files out, or the tars into "
            "a folder of their own")


# What Hugging Face's ``save_to_disk`` writes beside its ``.arrow`` files.
_HF_SIDECARS = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})


def _table_folder(path: Path, suffixes: set[str], payload_columns: str | dict[str, str] | None) -> bool:
    """Whether a folder is a table split in files: only Parquet/Arrow files (and Hugging
    Face's own ``.json`` files), the first of which holds binary columns (or
    ``payload_columns`` says so)."""
    files = sorted(p for p in _files(path) if p.name not in _HF_SIDECARS)
    if not files or not all(p.suffix.lower() in TABLE_SUFFIXES for p in files):
        return False
    if payload_columns is not None or files[0].suffix.lower() in (".arrow", ".feather"):
        return True
    try:
        return bool(payload_columns_of(pq.read_schema(files[0])))
    except Exception:  # noqa: BLE001 - not a readable Parquet file: packed as the folder it is
        return False


def _local_glob(pattern: Path) -> Source:
    """WebDataset tars matching a local glob (``dir/shard-*.tar``), read as a glob of
    ``s3://`` tars is; anything else it matches is refused, not read as a tar."""
    matches = sorted(p for p in _glob.glob(str(pattern), recursive=True) if os.path.isfile(p))
    if not matches:
        raise SourceNotFoundError(f"source {pattern}: no files match this pattern")
    others = [p for p in matches if not p.lower().endswith(".tar")]
    if others:
        raise SourceError(f"source {pattern}: a glob is read as WebDataset tars, but it matches {others[0]} "
                          f"({len(others)} files that are not .tar)")
    return WdsTarSource(str(pattern))


def _remote_table(url: str, storage_options: dict[str, Any] | None,
                  payload_columns: str | dict[str, str] | None) -> Source | None:
    """A table for an ``.arrow``/``.feather`` URL, or a Parquet URL whose schema has binary
    columns (read from its footer); None for anything else."""
    name = url.lower().rstrip("/")
    if name.endswith((".arrow", ".feather")) or (payload_columns is not None and name.endswith(TABLE_SUFFIXES)):
        return TableSource(url, payload_columns=payload_columns, storage_options=storage_options)
    if not name.endswith((".parquet", ".pq")):
        return None
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        with fs.open(path, "rb") as f:
            schema = pq.read_schema(f)
    except FileNotFoundError as exc:
        raise SourceNotFoundError(f"source {url} does not exist") from exc
    except Exception:  # noqa: BLE001 - not a readable Parquet file: left to the other sources
        return None
    payload = payload_columns_of(schema)
    if payload and "path" in schema.names and pa.types.is_string(schema.field("path").type):
        raise SourceError(_ambiguous(url, payload))
    return TableSource(url, storage_options=storage_options) if payload else None


def _ambiguous(source: Any, payload: list[str]) -> str:
    return (f"source {source} has both a 'path' column (a file list) and binary column(s) {payload} (a table "
            "holding the payload): pass --payload-columns (payload_columns=) to pack it as a table, or drop the "
            "binary columns to pack it as a file list")


def _table_or_list(path: Path, payload_columns: str | dict[str, str] | None,
                   storage_options: dict[str, Any] | None) -> Source:
    """A Parquet file's rows as a table (binary columns: the payload is in it) or as a file
    list (a ``path`` column of strings naming files), by its schema alone."""
    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise SourceError(f"cannot read Parquet file {path}: {exc}") from exc
    payload = payload_columns_of(schema)
    if payload_columns is not None or (payload and "path" not in schema.names):
        return TableSource(path, payload_columns=payload_columns)
    if payload and pa.types.is_string(schema.field("path").type):
        raise SourceError(_ambiguous(path, payload))
    if payload:
        return TableSource(path)
    return FileListSource(path, storage_options=storage_options)  # its rows may be URLs


# Objects a remote folder is sniffed by (the first ones listed): only .tar -> WebDataset tars.
_SNIFF = 1000


def _remote(url: str, *, labels_from_dirs: bool, storage_options: dict[str, Any] | None,
            hdf5_rows: str | None) -> Source:
    """The source for a URL: a file by its extension, a prefix as tars, as TFRecords, an
    ImageFolder or a keyed folder of objects (sniffed by its first objects' names)."""
    bare = url.rstrip("/")
    suffix = posixpath.splitext(bare)[1].lower()
    if bare.endswith(".tar") or _glob.has_magic(url):
        return WdsTarSource(url, storage_options=storage_options)
    if suffix in (".csv", ".parquet", ".pq"):
        return FileListSource(bare, storage_options=storage_options)
    if suffix in _HDF5:
        return Hdf5Source(bare, datasets=hdf5_rows, mode="rows" if hdf5_rows else "datasets",
                          storage_options=storage_options)
    if suffix in (".npy", ".npz"):
        return NpySource([bare], storage_options=storage_options)
    objects = Objects(storage_options)
    if suffix and not url.endswith("/") and objects.call(bare, lambda fs, p: fs.isfile(p)):
        # One object of a type no source reads: as a prefix it would list nothing under it.
        raise SourceError(_unsupported(bare, suffix))
    if labels_from_dirs:
        return ImageFolderSource(bare, storage_options)
    names = [rel for rel, _ in islice(walk_objects(objects, bare, lambda n: n), _SNIFF)]
    # A prefix `shardkit index` made a dataset keeps its own files beside the tars: not input.
    names = [n for n in names if n.split("/", 1)[0] not in _DATASET_OWN]
    if names and all(n.lower().endswith(".tar") for n in names):
        return WdsTarSource(url if url.endswith("/") else url + "/", storage_options=storage_options)
    if _tfrecords(bare, names):  # as a folder of only TFRecords on disk
        return TfRecordSource(url if url.endswith("/") else url + "/", storage_options=storage_options)
    return FolderSource(bare, storage_options)


def _resolve(source: Any, *, labels_from_dirs: bool, storage_options: dict[str, Any] | None,
             hdf5_rows: str | None, zarr_rows: str | None, lmdb_field: str | None,
             payload_columns: str | dict[str, str] | None = None) -> Source:
    if isinstance(source, Source) and not isinstance(source, (str, os.PathLike)):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise SourceError(f"unsupported source {type(source).__name__}: pass a path, URL, Source or iterable of dicts")
    text = str(source)
    refuse_url_credentials(text, "source")  # before any message repeats the URL
    if _BRACES.search(text):  # WebDataset's shards-{000000..000099}.tar, local or remote
        return WdsTarSource(text, storage_options=storage_options)
    if "://" in text and not text.startswith("file://"):
        if is_tfrecord_name(text):  # a TFRecord file, or a glob of them (s3://b/train/*.tfrecord)
            return TfRecordSource(text, storage_options=storage_options)
        table = _remote_table(text, storage_options, payload_columns)
        if table is not None:
            return table
        kind = _remote_kind(text, storage_options)  # it may probe the URL: after the names above
        if kind == "zarr":
            return _zarr(text, zarr_rows, storage_options)
        if kind == "lmdb":  # refused (one line): LMDB is read from local disk only
            return LmdbSource(text)
        return _remote(text, labels_from_dirs=labels_from_dirs, storage_options=storage_options, hdf5_rows=hdf5_rows)
    # Absolute: Ray tasks on an existing cluster run in another working directory.
    path = Path(text[len("file://"):] if text.startswith("file://") else text).absolute()
    if not path.exists() and _glob.has_magic(str(path)):  # a file named "[a].tar" is read as itself
        return _local_glob(path)
    if not path.exists():
        raise SourceNotFoundError(f"source {path} does not exist")
    suffix = path.suffix.lower()
    if path.is_dir() and (path / "zarr.json").is_file():
        return _zarr(str(path), zarr_rows, storage_options)
    if (path.is_dir() and (path / "data.mdb").is_file()) or (path.is_file() and suffix in _LMDB):
        return LmdbSource(path, field=lmdb_field or "bin")
    if path.is_file():
        if suffix in (".parquet", ".pq"):
            return _table_or_list(path, payload_columns, storage_options)
        if suffix in (".arrow", ".feather"):
            return TableSource(path, payload_columns=payload_columns)
        if suffix == ".csv":
            return FileListSource(path, storage_options=storage_options)  # its rows may be URLs
        if suffix in _HDF5:
            return Hdf5Source(str(path), datasets=hdf5_rows, mode="rows" if hdf5_rows else "datasets")
        if suffix in (".npy", ".npz"):
            return NpySource([str(path)])
        if suffix == ".tar":
                return WdsTarSource(str(path))
        if is_tfrecord_name(path.name):
            return TfRecordSource(str(path))
        if suffix == ".bin":
            raise SourceError(f"source {path}: a raw token file? pass token_dtype (--token-dtype uint16|uint32)")
        raise SourceError(_unsupported(str(path), suffix))
    if labels_from_dirs:
        return ImageFolderSource(path)
    names = [p.relative_to(path).as_posix() for p in _files(path)]
    if _tfrecords(str(path), names):
        return TfRecordSource(str(path))
    suffixes = {p.suffix.lower() for p in _files(path)}
    if not suffixes:
        raise SourceError(f"source {path} holds no files")
    if ".tar" in suffixes:
        if suffixes != {".tar"}:
            raise SourceError(_mixed_tars(path))
        return WdsTarSource(str(path))
    if suffixes & set(TABLE_SUFFIXES) and _table_folder(path, suffixes, payload_columns):
        return TableSource(path, payload_columns=payload_columns)
    if suffixes <= {".npy", ".npz"}:
        return NpySource(str(path))
    if suffixes <= set(_HDF5):
        return Hdf5Source(sorted(str(p) for p in path.rglob("*") if p.suffix.lower() in _HDF5),
                          datasets=hdf5_rows, mode="rows" if hdf5_rows else "datasets")
    return FolderSource(path)
