"""HDF5 files as a source: one sample per dataset, or one sample per row of some datasets.

Every array is packed as a standard ``.npy`` body (the header ``np.save`` writes, then the
C-order bytes), so any reader gets dtype and shape back with ``np.load``; large arrays stream
(:mod:`shardkit.packing.sources.hdf5_read`).

Files may be objects (``s3://...``), read with ranged GETs through fsspec file objects.
The source is pickled into Ray tasks, so what it pickles is only paths and options. In rows
mode ``load`` keeps the files it reads open, with their datasets looked up, until
:meth:`Hdf5Source.close` (the packer calls it after each task; see
:mod:`shardkit.packing.sources.hdf5_rows`).
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Any, Literal, Sequence, Union

import numpy as np

from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.packing.sample import FieldValue, PackSample, safe_key
from shardkit.packing.sources.base import ListingSkips, SourceItem, check_unique_keys, item_bytes
from shardkit.packing.sources.hdf5_read import array_field, array_layout, get_dataset, meta_attrs, open_h5
from shardkit.packing.sources.hdf5_rows import OpenRows
from shardkit.packing.sources.npy import npy_header
from shardkit.packing.sources.npy_rows import row_field
from shardkit.packing.sources.objects import is_url
from shardkit.packing.sources.optional import require

__all__ = ["Hdf5Source"]

PathLike = Union[str, os.PathLike]
_H5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5", ".nc")


class Hdf5Source:
    """HDF5 datasets as samples.

    Args:
        path_or_paths: an HDF5 file, a list of files, or a directory (searched recursively for
            ``.h5``/``.hdf5``/``.hdf``/``.he5``/``.nc``), local paths; files may also be
            object URLs (``s3://...``).
        datasets: in ``"datasets"`` mode, an optional comma-separated list of dataset paths or
            glob patterns (``images/*``) to include (default: all); in ``"rows"`` mode, the
            comma-separated datasets whose rows form the samples (required).
        mode: ``"datasets"``: each dataset is a sample, key ``safe_key("<stem>/<path>")``,
            field ``npy``, meta ``source`` = ``"<file>::<path>"`` plus scalar attributes as
            ``attr_<name>``. ``"rows"``: row ``i`` of every named dataset is one sample, key
            ``safe_key(f"{stem}_{i:09d}")``, fields ``<basename>.npy``, meta ``source`` =
            ``"<file>::<i>"``.
        storage_options: fsspec options for URLs (credentials, endpoint); never shown.

    Raises:
        SourceError: a bad mode, no paths, or rows mode without datasets.
    """

    def __init__(
        self,
        path_or_paths: PathLike | Sequence[PathLike],
        *,
        datasets: str | None = None,
        mode: Literal["datasets", "rows"] = "datasets",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.storage_options = dict(storage_options) if storage_options else None
        if mode not in ("datasets", "rows"):
            raise SourceError(f"Hdf5Source: mode must be 'datasets' or 'rows', not {mode!r}")
        self.paths = (
            [os.fspath(path_or_paths)]
            if isinstance(path_or_paths, (str, os.PathLike))
            else [os.fspath(p) for p in path_or_paths]
        )
        if not self.paths:
            raise SourceError("Hdf5Source: no paths given")
        self.mode = mode
        self.datasets = [d.strip().strip("/") for d in datasets.split(",")] if datasets else []
        self.datasets = [d for d in self.datasets if d]
        if mode == "rows" and not self.datasets:
            raise SourceError("Hdf5Source: mode='rows' needs datasets='name[,name...]'")
        self.listing = ListingSkips()  # datasets .npy cannot hold: refused, or skipped (on_error="skip")
        self._open_rows = OpenRows()

    def __getstate__(self) -> dict[str, Any]:
        """Paths and options only."""
        state = dict(self.__dict__)
        del state["_open_rows"]  # open h5py files never cross a process boundary
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy in another process opens its own files."""
        self.__dict__.update(state)
        self._open_rows = OpenRows()

    def close(self) -> None:
        """Close the files ``load`` keeps open in this process (rows mode); a later ``load``
        reopens them. The packer calls this after each task (as ``task_done``)."""
        self._open_rows.release()
        self._open_rows = OpenRows()

    task_done = close  # the packer's end-of-task hook (see sources.base.Source)

    def __repr__(self) -> str:
        return f"Hdf5Source({self.paths!r}, datasets={','.join(self.datasets) or None!r}, mode={self.mode!r})"

    # -- listing ---------------------------------------------------------------------------

    def _files(self) -> list[str]:
        out: list[str] = []
        for p in self.paths:
            if is_url(p):
                out.append(p)  # a missing object is named when it is opened
            elif os.path.isdir(p):
                found = sorted(
                    str(f) for f in Path(p).rglob("*") if f.suffix.lower() in _H5_SUFFIXES and f.is_file()
                )
                if not found:
                    raise SourceError(f"{p}: no HDF5 files found")
                out.extend(found)
            elif os.path.exists(p):
                out.append(p)
            else:
                raise SourceNotFoundError(f"{p}: no such file or directory")
        return out

    def _stems(self, files: list[str]) -> dict[str, str]:
        """File -> the name keys start with: its stem, or its relative path when stems clash."""
        stems = {f: Path(f).stem for f in files}
        if len(set(stems.values())) == len(files):
            return stems
        root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
        return {f: Path(os.path.relpath(os.path.abspath(f), root)).with_suffix("").as_posix() for f in files}

    def list_items(self) -> list[SourceItem]:
        """All items, reading only HDF5 metadata (names, shapes, dtypes).

        Returns:
            One item per dataset (``ref`` ``<file>::/<path>``) or per row (``<file>::[<i>]``).

        Raises:
            SourceNotFoundError: a path does not exist.
            SourceError: h5py is not installed, a file is no HDF5, a dataset is missing or
                holds what ``.npy`` cannot (in datasets mode, unless skipped), rows datasets
                disagree in length, nothing to pack, or two items share a key.
        """
        h5py = require("hdf5")
        self.listing.skipped.clear()
        files = self._files()
        stems = self._stems(files)
        items: list[SourceItem] = []
        for path in files:
            if not is_url(path) and not h5py.is_hdf5(path):
                raise SourceError(f"{path}: not an HDF5 file")
            with open_h5(path, self.storage_options) as f:
                if self.mode == "datasets":
                    items.extend(self._list_datasets(f, path, stems[path]))
                else:
                    items.extend(self._list_rows(f, path, stems[path]))
        if not items:
            raise SourceError(f"{', '.join(self.paths)}: no datasets to pack")
        check_unique_keys(items)
        return items

    def _list_datasets(self, f: Any, path: str, stem: str) -> list[SourceItem]:
        h5py = require("hdf5")
        names: list[str] = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        if self.datasets:
            names = [n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in self.datasets)]
        items = []
        for name in sorted(names):
            ref = f"{path}::/{name}"
            try:
                dtype, shape = array_layout(f[name], ref)
            except SourceError as exc:  # a dtype .npy cannot hold, a null dataspace
                self.listing.bad(ref, str(exc))
                continue
            size = len(npy_header(dtype, shape)) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            key = safe_key(f"{stem}/{name}")
            items.append(SourceItem(ref=ref, nbytes=item_bytes(key, [("npy", size)]), key=key))
        return items

    def _list_rows(self, f: Any, path: str, stem: str) -> list[SourceItem]:
        members: list[tuple[str, int]] = []
        length: int | None = None
        fields: set[str] = set()
        for name in self.datasets:
            ref = f"{path}::/{name}"
            dset = get_dataset(f, name, ref)
            dtype, shape = array_layout(dset, ref)
            if not shape:
                raise SourceError(f"{ref}: scalar dataset has no rows")
            if length is not None and shape[0] != length:
                raise SourceError(f"{ref}: has {shape[0]} rows but {self.datasets[0]} has {length}")
            length = shape[0]
            field = row_field(name, ref)
            if field in fields:
                raise SourceError(f"{ref}: two datasets would both be field {field!r}")
            fields.add(field)
            size = len(npy_header(dtype, shape[1:])) + int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
            members.append((field, size))
        # Computed once: one file's row keys have the same length (below 10**9 rows), so alike headers.
        row_bytes = item_bytes(safe_key(f"{stem}_{0:09d}"), members)
        return [
            SourceItem(ref=f"{path}::[{i}]", nbytes=row_bytes, key=safe_key(f"{stem}_{i:09d}"))
            for i in range(length or 0)
        ]

    # -- loading ---------------------------------------------------------------------------

    def load(self, item: SourceItem) -> PackSample:
        """Read one item.

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample; arrays over CHUNK_BYTES come back as StreamedFields.

        Raises:
            SourceError: the file or dataset cannot be read, or a row is out of range.
        """
        path, _, what = item.ref.rpartition("::")
        if self.mode == "rows":
            return self._load_row(item, path, int(what.strip("[]")))
        with open_h5(path, self.storage_options) as f:
            dset = get_dataset(f, what, item.ref)
            meta = meta_attrs(dset)
            meta["source"] = item.ref
            field = array_field(dset, path, what, (), self.storage_options)
            return PackSample(key=item.key, fields={"npy": field}, meta=meta)

    def _load_row(self, item: SourceItem, path: str, row: int) -> PackSample:
        if self._open_rows.inherited:  # forked since: the parent's files stay as they are
            self._open_rows.release()
            self._open_rows = OpenRows()
        rf = self._open_rows.get(path, self.storage_options)
        fields: dict[str, FieldValue] = {}
        for name in self.datasets:
            col = rf.column(name)
            if row >= col.n_rows:
                raise SourceError(f"{col.ref}: row {row} out of range ({col.n_rows} rows)")
            fields[col.field] = col.value(row)
        return PackSample(key=item.key, fields=fields, meta={"source": f"{path}::{row}"})

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json.

        Returns:
            ``{"type": "hdf5", "paths": ..., "mode": ..., "datasets": ...}`` (``datasets``
            None when every dataset is packed).
        """
        return {"type": "hdf5", "paths": list(self.paths), "mode": self.mode, "datasets": self.datasets or None}

    def labels(self) -> dict[str, int] | None:
        """An HDF5 source has no classes.

        Returns:
            None.
        """
        return None
