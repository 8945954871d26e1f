"""Choosing the source for what the user passed: a Source object, a path, a glob or a URL.

Directories are sniffed by their files (only tars, only arrays, only HDF5, else a keyed
folder); files by their extension. Nothing is read beyond names and sizes.
"""

from __future__ import annotations

import glob as _glob
import os
import re
from pathlib import Path
from typing import Any, Iterator

from shardkit.errors import ConfigError, SourceError, SourceNotFoundError
from shardkit.packing.sources.base import Source
from shardkit.packing.sources.filelist import FileListSource
from shardkit.packing.sources.files import FolderSource, ImageFolderSource
from shardkit.packing.sources.hdf5 import Hdf5Source
from shardkit.packing.sources.lmdb import LmdbSource
from shardkit.packing.sources.npy import NpySource
from shardkit.packing.sources.tokens import TokenSource
from shardkit.packing.sources.wds import WdsTarSource
from shardkit.packing.sources.zarr import ZarrSource
from shardkit.storage.urls import refuse_url_credentials

__all__ = ["resolve_source"]

_HDF5 = (".h5", ".hdf5", ".hdf", ".he5")
_LMDB = (".mdb", ".lmdb")
_COMPRESSED_TARS = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
_BRACES = re.compile(r"\{[^{}]*(\.\.|,)[^{}]*\}")


def resolve_source(source: Any, *, labels_from_dirs: bool = False, storage_options: dict[str, Any] | None = None,
                   hdf5_rows: str | None = None, zarr_rows: str | None = None,
                   lmdb_field: str | None = None, token_dtype: str | None = None,
                   token_column: str | None = None) -> Source:
    """A Source for ``source``: a Source object, a path (folder, list, .h5, .npy, .tar) or a URL.

    Directories are sniffed by their files: only ``.tar`` -> existing WebDataset shards
    (``.tar`` files beside any other file are refused as ambiguous); only ``.npy``/``.npz`` ->
    arrays; only HDF5 -> HDF5; otherwise a keyed folder (or an ImageFolder with
    ``labels_from_dirs``). Only names and sizes are looked at. A directory or URL holding
    ``zarr.json`` (or named ``*.zarr``) is a Zarr store; one holding ``data.mdb``, or a
    ``.mdb``/``.lmdb`` file, an LMDB environment.

    Args:
        source: a Source, or a path, glob or URL (``file://`` too).
        labels_from_dirs: read a folder as an ImageFolder.
        storage_options: fsspec options for a remote source.
        hdf5_rows: for an HDF5 source, the datasets whose rows are the samples.
        zarr_rows: for a Zarr source, the arrays whose rows are the samples.
        lmdb_field: for an LMDB source, the field each value is packed as (default ``bin``).
        token_dtype: read the path as tokenized documents (:class:`TokenSource`): the dtype of
            ``.bin`` token files and the dtype stored (``uint16``/``uint32``).
        token_column: read the path as tokenized documents, Parquet rows' token lists in this
            column.

    Returns:
        The source.

    Raises:
        SourceNotFoundError: the path does not exist, or a glob matches nothing.
        SourceError: a type of input no source reads (a remote path that is no tar, a file
            type, a folder of tars and other files, an empty folder).
        ConfigError: ``hdf5_rows``, ``zarr_rows``, ``lmdb_field``, ``token_dtype`` or
            ``token_column`` for a source of another kind (not silently ignored), or
            credentials in a URL.
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
                   zarr_rows=zarr_rows, lmdb_field=lmdb_field)
    for option, value, kind, cls in (("hdf5_rows", hdf5_rows, "HDF5", Hdf5Source),
                                     ("zarr_rows", zarr_rows, "Zarr", ZarrSource),
                                     ("lmdb_field", lmdb_field, "LMDB", LmdbSource),
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
    if url.endswith("/") or base.endswith(".tar") or "*" in base:
        return None
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


def _resolve(source: Any, *, labels_from_dirs: bool, storage_options: dict[str, Any] | None,
             hdf5_rows: str | None, zarr_rows: str | None, lmdb_field: str | None) -> Source:
    if isinstance(source, Source) and not isinstance(source, (str, os.PathLike)):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise SourceError(f"unsupported source {type(source).__name__}: pass a path, URL, Source or iterable of dicts")
    text = str(source)
    refuse_url_credentials(text, "source")  # before any message repeats the URL
    if _BRACES.search(text):  # WebDataset's shards-{000000..000099}.tar, local or remote
        return WdsTarSource(text, storage_options=storage_options)
    if "://" in text and not text.startswith("file://"):
        kind = _remote_kind(text, storage_options)
        if kind == "zarr":
            return _zarr(text, zarr_rows, storage_options)
        if kind == "lmdb":  # refused (one line): LMDB is read from local disk only
            return LmdbSource(text)
        if text.rstrip("/").endswith(".tar") or "*" in text or text.endswith("/"):
                return WdsTarSource(text, storage_options=storage_options)
        raise SourceError(f"remote source {text}: only WebDataset tars (*.tar or a glob) are read from URLs")
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
        if suffix in (".csv", ".parquet", ".pq"):
            return FileListSource(path)
        if suffix in _HDF5:
            return Hdf5Source(str(path), datasets=hdf5_rows, mode="rows" if hdf5_rows else "datasets")
        if suffix in (".npy", ".npz"):
            return NpySource([str(path)])
        if suffix == ".tar":
                return WdsTarSource(str(path))
        if suffix == ".bin":
            raise SourceError(f"source {path}: a raw token file? pass token_dtype (--token-dtype uint16|uint32)")
        raise SourceError(f"source {path}: unsupported file type {suffix or '(none)'}")
    if labels_from_dirs:
        return ImageFolderSource(path)
    suffixes = {p.suffix.lower() for p in _files(path)}
    if not suffixes:
        raise SourceError(f"source {path} holds no files")
    if ".tar" in suffixes:
        if suffixes != {".tar"}:
            raise SourceError(_mixed_tars(path))
        return WdsTarSource(str(path))
    if suffixes <= {".npy", ".npz"}:
        return NpySource(str(path))
    if suffixes <= set(_HDF5):
        return Hdf5Source(sorted(str(p) for p in path.rglob("*") if p.suffix.lower() in _HDF5),
                          datasets=hdf5_rows, mode="rows" if hdf5_rows else "datasets")
    return FolderSource(path)
