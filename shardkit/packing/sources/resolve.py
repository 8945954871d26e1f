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

from shardkit.errors import ConfigError, SourceError, SourceNotFoundError
from shardkit.packing.sources.base import Source
from shardkit.packing.sources.filelist import FileListSource
from shardkit.packing.sources.files import FolderSource
from shardkit.packing.sources.imagefolder import ImageFolderSource
from shardkit.packing.sources.hdf5 import Hdf5Source
from shardkit.packing.sources.listing import walk_objects
from shardkit.packing.sources.npy import NpySource
from shardkit.packing.sources.objects import Objects
from shardkit.packing.sources.wds import WdsTarSource
from shardkit.storage.urls import refuse_url_credentials

__all__ = ["resolve_source"]

_HDF5 = (".h5", ".hdf5", ".hdf", ".he5")
_COMPRESSED_TARS = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
_BRACES = re.compile(r"\{[^{}]*(\.\.|,)[^{}]*\}")


def resolve_source(source: Any, *, labels_from_dirs: bool = False, storage_options: dict[str, Any] | None = None,
                   hdf5_rows: str | None = None) -> Source:
    """A Source for ``source``: a Source object, a path (folder, list, .h5, .npy, .tar) or a URL.

    Directories are sniffed by their files: only ``.tar`` -> existing WebDataset shards
    (``.tar`` files beside any other file are refused as ambiguous); only ``.npy``/``.npz`` ->
    arrays; only HDF5 -> HDF5; otherwise a keyed folder (or an ImageFolder with
    ``labels_from_dirs``). Only names and sizes are looked at. A URL names a file by its
    extension (list, HDF5, ``.npy``/``.npz``, ``.tar``), a glob of tars, or a prefix: an
    ImageFolder with ``labels_from_dirs``, tars when its first objects are all ``.tar``, else a
    keyed folder of objects.

    Args:
        source: a Source, or a path, glob or URL (``file://`` too).
        labels_from_dirs: read a folder as an ImageFolder.
        storage_options: fsspec options for a remote source.
        hdf5_rows: for an HDF5 source, the datasets whose rows are the samples.

    Returns:
        The source.

    Raises:
        SourceNotFoundError: the path does not exist, or a glob matches nothing.
        SourceError: a type of input no source reads (a file type, a folder of tars and other
            files, an empty folder).
        ConfigError: ``hdf5_rows`` for a source that is not HDF5 (not silently ignored), or
            credentials in a URL.
    """
    src = _resolve(source, labels_from_dirs=labels_from_dirs, storage_options=storage_options, hdf5_rows=hdf5_rows)
    if hdf5_rows is not None:
        if not isinstance(src, Hdf5Source):
            raise ConfigError(f"hdf5_rows (--hdf5-rows {hdf5_rows}) applies to HDF5 sources only; "
                              f"{source} is a {src.describe().get('type', type(src).__name__)} source")
    return src


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


# Objects a remote folder is sniffed by (the first ones listed): only .tar -> WebDataset tars.
_SNIFF = 1000


def _remote(url: str, *, labels_from_dirs: bool, storage_options: dict[str, Any] | None,
            hdf5_rows: str | None) -> Source:
    """The source for a URL: a file by its extension, a prefix as tars, an ImageFolder or a
    keyed folder of objects (sniffed by its first objects' names)."""
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
    if labels_from_dirs:
        return ImageFolderSource(bare, storage_options)
    names = [rel for rel, _ in islice(walk_objects(Objects(storage_options), bare, lambda n: n), _SNIFF)]
    # A prefix `shardkit index` made a dataset keeps its own files beside the tars: not input.
    names = [n for n in names if n.split("/", 1)[0] not in _DATASET_OWN]
    if names and all(n.lower().endswith(".tar") for n in names):
        return WdsTarSource(url if url.endswith("/") else url + "/", storage_options=storage_options)
    return FolderSource(bare, storage_options)


def _resolve(source: Any, *, labels_from_dirs: bool, storage_options: dict[str, Any] | None,
             hdf5_rows: str | None) -> Source:
    if isinstance(source, Source) and not isinstance(source, (str, os.PathLike)):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise SourceError(f"unsupported source {type(source).__name__}: pass a path, URL, Source or iterable of dicts")
    text = str(source)
    refuse_url_credentials(text, "source")  # before any message repeats the URL
    if _BRACES.search(text):  # WebDataset's shards-{000000..000099}.tar, local or remote
        return WdsTarSource(text, storage_options=storage_options)
    if "://" in text and not text.startswith("file://"):
        return _remote(text, labels_from_dirs=labels_from_dirs, storage_options=storage_options, hdf5_rows=hdf5_rows)
    # Absolute: Ray tasks on an existing cluster run in another working directory.
    path = Path(text[len("file://"):] if text.startswith("file://") else text).absolute()
    if not path.exists() and _glob.has_magic(str(path)):  # a file named "[a].tar" is read as itself
        return _local_glob(path)
    if not path.exists():
        raise SourceNotFoundError(f"source {path} does not exist")
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix in (".csv", ".parquet", ".pq"):
            return FileListSource(path, storage_options=storage_options)  # its rows may be URLs
        if suffix in _HDF5:
            return Hdf5Source(str(path), datasets=hdf5_rows, mode="rows" if hdf5_rows else "datasets")
        if suffix in (".npy", ".npz"):
            return NpySource([str(path)])
        if suffix == ".tar":
                return WdsTarSource(str(path))
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
