"""HDF5 files as a source: one sample per dataset, or one sample per row of some datasets.

Every array is packed as a standard ``.npy`` body (the header ``np.save`` writes, then the
C-order bytes), so any reader gets dtype and shape back with ``np.load``. Large arrays stream:
their field is a :class:`~shardkit.packing.sample.StreamedField` that reads the dataset slab by slab
into one reused buffer, so a 300 MB dataset never sits in memory whole.

The source is pickled into Ray tasks, so what it pickles is only paths and options. In rows
mode ``load`` keeps the files it reads open, with their datasets looked up, until
:meth:`Hdf5Source.close` (the packer calls it after each task): one sample per row would
otherwise reopen the file and look every dataset up again per row (~1 ms a row).
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence, Union

import numpy as np

from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.packing.sample import FieldValue, PackSample, StreamedField, check_field_name, safe_key
from shardkit.packing.sources.base import SourceItem, item_bytes
from shardkit.packing.sources.npy import CHUNK_BYTES, npy_header

PathLike = Union[str, os.PathLike]
_H5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5", ".nc")
# Chunk cache per open file: big enough that a slab spanning a compressed HDF5 chunk does not
# decompress that chunk again for the next slab (h5py's default is 1 MB).
_RDCC_NBYTES = 32 * 1024 * 1024
_ATTR_OK = re.compile(r"[^A-Za-z0-9_]")
# Rows mode reads this many bytes of consecutive rows at once: rows packed in order are read
# in order, and one HDF5 read per row costs far more than a small row's bytes (measured on
# 64 float32 + an int64 in 4096-row chunks: 113 us a row read by row, 2.4 us in blocks).
# Blocks are rounded to whole chunks, so a compressed chunk is decompressed once.
_BLOCK_BYTES = 1 << 20
# Rows-mode files a source keeps open at once (per process); the least recently used closes.
_MAX_OPEN_FILES = 4


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SourceError("Hdf5Source needs h5py: pip install 'shardkit[hdf5]'") from exc
    return h5py


def _open(path: str) -> Any:
    h5py = _h5py()
    if not os.path.exists(path):
        raise SourceNotFoundError(f"{path}: no such file")
    try:
        return h5py.File(path, "r", rdcc_nbytes=_RDCC_NBYTES)
    except OSError as exc:
        raise SourceError(f"{path}: not a readable HDF5 file: {exc}") from exc


def _array_layout(dset: Any, ref: str) -> tuple[np.dtype, tuple[int, ...]]:
    """The (dtype, shape) the .npy body will have; refuses what .npy cannot hold."""
    if dset.shape is None:
        raise SourceError(f"{ref}: empty (null dataspace) HDF5 dataset has no array to store")
    dtype = dset.dtype
    shape = tuple(dset.shape)
    if dtype.subdtype is not None:
        # An HDF5 array type reads as extra trailing axes; the bytes are the same.
        base, sub = dtype.subdtype
        dtype, shape = base, shape + tuple(sub)
    if dtype.hasobject or dtype.kind == "O":
        raise SourceError(
            f"{ref}: unsupported dtype {dset.dtype} (variable-length strings, references or "
            "objects cannot be stored as .npy)"
        )
    if dtype.kind == "V" and dtype.names is None and dtype.itemsize == 0:
        raise SourceError(f"{ref}: unsupported opaque dtype {dset.dtype}")
    return dtype, shape


def _slabs(shape: tuple[int, ...], itemsize: int, chunks: tuple[int, ...] | None) -> Iterator[tuple[Any, ...]]:
    """Selections covering ``shape`` in C order, each at most CHUNK_BYTES when possible.

    Splits along the first axis whose trailing block fits the bound; leading axes are walked
    one index at a time. Slab lengths are rounded to whole HDF5 chunks when that still fits.
    """
    if not shape:
        yield ()
        return
    inner = itemsize
    k = len(shape) - 1
    # inner = bytes of one index step along axis k
    for axis in range(len(shape) - 1, -1, -1):
        if inner * shape[axis] > CHUNK_BYTES:
            k = axis
            break
        inner *= shape[axis]
    else:
        yield tuple(slice(0, n) for n in shape)  # the whole array fits in one piece
        return
    step = max(1, CHUNK_BYTES // inner)
    if chunks is not None and chunks[k] <= step:
        step -= step % chunks[k]
    for lead in np.ndindex(*shape[:k]):
        for start in range(0, shape[k], step):
            stop = min(start + step, shape[k])
            yield tuple(slice(i, i + 1) for i in lead) + (slice(start, stop),) + tuple(
                slice(0, n) for n in shape[k + 1 :]
            )


def _dataset_chunks(path: str, name: str, sel: tuple[Any, ...]) -> Iterator[bytes]:
    """Open ``path`` and yield the .npy bytes of ``path[name][sel]`` (see :func:`_iter_npy`)."""
    ref = f"{path}::{name}"
    with _open(path) as f:
        yield from _iter_npy(_streaming_dataset(f, name, ref), sel, ref)


def _streaming_dataset(f: Any, name: str, ref: str) -> Any:
    """Dataset ``name`` opened with a chunk cache of about one chunk (at most the file's).

    A streamed read visits every chunk once, in order, so the file-wide cache would only hold
    up to 32 MiB of chunks never read again (measured: +42 MB peak RSS packing 300 MB
    samples); one chunk still spares re-reading a chunk that two slabs share. HDF5 shares
    one cache between opens of a dataset, so the probe is closed before the reopen.
    """
    h5py = _h5py()
    probe = _get_dataset(f, name, ref)
    chunks, itemsize, path = probe.chunks, probe.dtype.itemsize, probe.name
    del probe  # closes it: the cache settings of the first open would win
    if chunks is None:
        return _get_dataset(f, name, ref)
    chunk_bytes = int(np.prod(chunks, dtype=np.int64)) * itemsize
    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_chunk_cache(521, min(_RDCC_NBYTES, max(1 << 20, chunk_bytes)), 0.75)
    return h5py.Dataset(h5py.h5d.open(f.id, path.encode(), dapl=dapl))


def _iter_npy(dset: Any, sel: tuple[Any, ...], ref: str) -> Iterator[bytes]:
    """Yield the .npy bytes of ``dset[sel]``: the header, then slab after slab.

    ``sel`` is a leading selection (e.g. ``(slice(i, i + 1),)`` for row ``i``); empty means
    the whole dataset. Slabs are read into one reused buffer of at most CHUNK_BYTES.
    """
    dtype, full_shape = _array_layout(dset, ref)
    yield npy_header(dtype, full_shape[len(sel):])
    if int(np.prod(full_shape, dtype=np.int64)) == 0:
        return
    # Slabs cover the dataset's own axes; an HDF5 array type adds trailing axes to each element.
    shape = tuple(dset.shape)[len(sel):]
    sub = tuple(dset.dtype.subdtype[1]) if dset.dtype.subdtype else ()
    if not shape:
        yield np.ascontiguousarray(dset[sel] if sel else dset[()], dtype=dtype).tobytes()
        return
    chunk_shape = tuple(dset.chunks[len(sel):]) if dset.chunks else None
    buf: np.ndarray | None = None
    for slab in _slabs(shape, dset.dtype.itemsize, chunk_shape):
        dims = tuple(s.stop - s.start for s in slab) + sub
        n = int(np.prod(dims, dtype=np.int64))
        if buf is None or buf.size < n:
            buf = np.empty(n, dtype=dtype)
        view = buf[:n].reshape(dims)
        _read(dset, view, tuple(sel) + slab, ref)
        yield view.tobytes()


def _read(dset: Any, out: np.ndarray, sel: tuple[Any, ...], ref: str) -> None:
    try:
        if dset.dtype.subdtype is not None:
            out[...] = dset[sel]  # read_direct refuses array types; slices are small anyway
        else:
            dset.read_direct(out, source_sel=sel)
    except (OSError, ValueError, TypeError) as exc:
        raise SourceError(f"{ref}: cannot read HDF5 data: {exc}") from exc


def _get_dataset(f: Any, name: str, ref: str) -> Any:
    h5py = _h5py()
    try:
        obj = f[name]
    except KeyError as exc:
        raise SourceError(f"{ref}: no such dataset") from exc
    if not isinstance(obj, h5py.Dataset):
        raise SourceError(f"{ref}: not a dataset")
    return obj


def _meta_attrs(dset: Any) -> dict[str, Any]:
    """Scalar attributes as ``attr_<name>`` metadata; anything else is left out."""
    meta: dict[str, Any] = {}
    try:
        attrs = dict(dset.attrs.items())
    except (OSError, TypeError, ValueError):  # attributes h5py cannot read are skipped by design
        return meta
    for name, value in sorted(attrs.items()):
        if isinstance(value, np.ndarray):
            if value.ndim != 0:
                continue
            value = value[()]
        if isinstance(value, np.generic):
            if value.dtype.kind not in "biufSU":
                continue
            value = value.item()
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, (str, int, float, bool)):
            meta["attr_" + _ATTR_OK.sub("_", name)] = value
    return meta


class _RowColumn:
    """One dataset of an open rows-mode file, looked up once: its field, the ``.npy`` header
    every row shares (a row's shape and dtype are fixed), and the block of rows read last."""

    def __init__(self, f: Any, path: str, name: str) -> None:
        self.path, self.name, self.ref = path, name, f"{path}::/{name}"
        dset = _streaming_dataset(f, name, self.ref)
        dtype, shape = _array_layout(dset, self.ref)
        if not shape:
            raise SourceError(f"{self.ref}: scalar dataset has no rows")
        self.field = _row_field(name, self.ref)
        self.n_rows = shape[0]
        self.header = npy_header(dtype, shape[1:])
        self.row_nbytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self.size = len(self.header) + self.row_nbytes
        # A row over CHUNK_BYTES streams through its own open (see _dataset_chunks); holding
        # the dataset here would make that open share this one's bigger chunk cache.
        self.dset: Any = dset if self.size <= CHUNK_BYTES and self.row_nbytes else None
        self.dtype, self.row_shape = dtype, shape[1:]
        rows = max(1, _BLOCK_BYTES // max(1, self.row_nbytes))
        chunk_rows = dset.chunks[0] if dset.chunks else None
        if chunk_rows is not None and chunk_rows <= rows:
            rows -= rows % chunk_rows  # whole chunks: each is decompressed by one read only
        self.block_rows = rows
        self.start = self.stop = 0
        self.block = memoryview(b"")

    def value(self, row: int) -> FieldValue:
        """The .npy body of ``row``: bytes, or a StreamedField for a row over CHUNK_BYTES."""
        if self.size > CHUNK_BYTES:
            return StreamedField(size=self.size, chunks=functools.partial(
                _dataset_chunks, self.path, "/" + self.name, (row,)))
        if self.dset is None:  # rows of zero elements are their header alone
            return self.header
        if not self.start <= row < self.stop:
            self._read_block(row)
        at = (row - self.start) * self.row_nbytes
        return self.header + self.block[at:at + self.row_nbytes]

    def _read_block(self, row: int) -> None:
        start = row - row % self.block_rows  # aligned, so blocks start on chunk boundaries
        stop = min(start + self.block_rows, self.n_rows)
        buf = np.empty((stop - start,) + self.row_shape, dtype=self.dtype)
        _read(self.dset, buf, (slice(start, stop),), self.ref)
        self.start, self.stop, self.block = start, stop, buf.reshape(-1).view(np.uint8).data


class _RowFile:
    """An open rows-mode file and the columns looked up in it so far."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file = _open(path)
        self.columns: dict[str, _RowColumn] = {}

    def column(self, name: str) -> _RowColumn:
        col = self.columns.get(name)
        if col is None:  # a missing dataset is not remembered: it raises on every load, as before
            col = self.columns[name] = _RowColumn(self.file, self.path, name)
        return col

    def close(self) -> None:
        self.columns.clear()
        self.file.close()


# Open files a forked child inherited: HDF5 state copied from the parent is not safe to use in
# the child, and closing it there would drop the parent's lock on the file (flock is shared
# across fork), so the child only keeps it referenced and opens its own.
_INHERITED: list[Any] = []
# Bumped in every forked child: cheaper to compare per row than os.getpid() (a system call).
_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere processes are spawned, never forked
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _OpenRows:
    """A process's open rows-mode files, least recently used first, at most _MAX_OPEN_FILES."""

    def __init__(self) -> None:
        self.generation = _fork_generation
        self.files: OrderedDict[str, _RowFile] = OrderedDict()

    def get(self, path: str) -> _RowFile:
        rf = self.files.get(path)
        if rf is not None:
            self.files.move_to_end(path)
            return rf
        rf = _RowFile(path)
        self.files[path] = rf
        while len(self.files) > _MAX_OPEN_FILES:
            self.files.popitem(last=False)[1].close()
        return rf

    def close(self) -> None:
        while self.files:
            self.files.popitem(last=False)[1].close()


class Hdf5Source:
    """HDF5 datasets as samples.

    Args:
        path_or_paths: an HDF5 file, a list of files, or a directory (searched recursively for
            ``.h5``/``.hdf5``/``.hdf``/``.he5``/``.nc``), local paths.
        datasets: in ``"datasets"`` mode, an optional comma-separated list of dataset paths or
            glob patterns (``images/*``) to include (default: all); in ``"rows"`` mode, the
            comma-separated datasets whose rows form the samples (required).
        mode: ``"datasets"``: each dataset is a sample, key ``safe_key("<stem>/<path>")``,
            field ``npy``, meta ``source`` = ``"<file>::<path>"`` plus scalar attributes as
            ``attr_<name>``. ``"rows"``: row ``i`` of every named dataset is one sample, key
            ``safe_key(f"{stem}_{i:09d}")``, fields ``<basename>.npy``, meta ``source`` =
            ``"<file>::<i>"``.
    """

    def __init__(
        self,
        path_or_paths: PathLike | Sequence[PathLike],
        *,
        datasets: str | None = None,
        mode: Literal["datasets", "rows"] = "datasets",
    ) -> None:
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
        self._open_rows = _OpenRows()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_open_rows"]  # open h5py files never cross a process boundary
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open_rows = _OpenRows()

    def close(self) -> None:
        """Close the files ``load`` keeps open in this process (rows mode); a later ``load``
        reopens them. The packer calls this after each task (as ``task_done``)."""
        if self._open_rows.generation == _fork_generation:
            self._open_rows.close()
        else:
            _INHERITED.append(self._open_rows)
        self._open_rows = _OpenRows()

    task_done = close  # the packer's end-of-task hook (see sources.base.Source)

    def __repr__(self) -> str:
        return f"Hdf5Source({self.paths!r}, datasets={','.join(self.datasets) or None!r}, mode={self.mode!r})"

    # -- listing ---------------------------------------------------------------------------

    def _files(self) -> list[str]:
        out: list[str] = []
        for p in self.paths:
            if os.path.isdir(p):
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
        """All items, reading only HDF5 metadata (names, shapes, dtypes)."""
        h5py = _h5py()
        files = self._files()
        stems = self._stems(files)
        items: list[SourceItem] = []
        for path in files:
            if not h5py.is_hdf5(path):
                raise SourceError(f"{path}: not an HDF5 file")
            with _open(path) as f:
                if self.mode == "datasets":
                    items.extend(self._list_datasets(f, path, stems[path]))
                else:
                    items.extend(self._list_rows(f, path, stems[path]))
        if not items:
            raise SourceError(f"{', '.join(self.paths)}: no datasets to pack")
        seen: dict[str, str] = {}
        for it in items:
            if it.key in seen:
                raise SourceError(f"{it.ref}: key {it.key!r} collides with {seen[it.key]}")
            seen[it.key] = it.ref
        return items

    def _list_datasets(self, f: Any, path: str, stem: str) -> list[SourceItem]:
        h5py = _h5py()
        names: list[str] = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        if self.datasets:
            names = [n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in self.datasets)]
        items = []
        for name in sorted(names):
            ref = f"{path}::/{name}"
            dtype, shape = _array_layout(f[name], ref)
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
            dset = _get_dataset(f, name, ref)
            dtype, shape = _array_layout(dset, ref)
            if not shape:
                raise SourceError(f"{ref}: scalar dataset has no rows")
            if length is not None and shape[0] != length:
                raise SourceError(f"{ref}: has {shape[0]} rows but {self.datasets[0]} has {length}")
            length = shape[0]
            field = _row_field(name, ref)
            if field in fields:
                raise SourceError(f"{ref}: two datasets would both be field {field!r}")
            fields.add(field)
            size = len(npy_header(dtype, shape[1:])) + int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
            members.append((field, size))
        # Measured once: one file's row keys have the same length (below 10**9 rows), so alike headers.
        row_bytes = item_bytes(safe_key(f"{stem}_{0:09d}"), members)
        return [
            SourceItem(ref=f"{path}::[{i}]", nbytes=row_bytes, key=safe_key(f"{stem}_{i:09d}"))
            for i in range(length or 0)
        ]

    # -- loading ---------------------------------------------------------------------------

    def load(self, item: SourceItem) -> PackSample:
        """Read one item; arrays over CHUNK_BYTES come back as StreamedFields."""
        path, _, what = item.ref.rpartition("::")
        if self.mode == "rows":
            return self._load_row(item, path, int(what.strip("[]")))
        with _open(path) as f:
            dset = _get_dataset(f, what, item.ref)
            meta = _meta_attrs(dset)
            meta["source"] = item.ref
            return PackSample(key=item.key, fields={"npy": _array_field(dset, path, what, ())}, meta=meta)

    def _load_row(self, item: SourceItem, path: str, row: int) -> PackSample:
        if self._open_rows.generation != _fork_generation:  # forked since: see _INHERITED
            _INHERITED.append(self._open_rows)
            self._open_rows = _OpenRows()
        rf = self._open_rows.get(path)
        fields: dict[str, FieldValue] = {}
        for name in self.datasets:
            col = rf.column(name)
            if row >= col.n_rows:
                raise SourceError(f"{col.ref}: row {row} out of range ({col.n_rows} rows)")
            fields[col.field] = col.value(row)
        return PackSample(key=item.key, fields=fields, meta={"source": f"{path}::{row}"})

    def describe(self) -> dict[str, Any]:
        return {"type": "hdf5", "paths": list(self.paths), "mode": self.mode, "datasets": self.datasets or None}

    def labels(self) -> dict[str, int] | None:
        return None


def _row_field(name: str, ref: str) -> str:
    field = name.rsplit("/", 1)[-1] + ".npy"
    try:
        check_field_name(field)
    except SourceError as exc:
        raise SourceError(f"{ref}: {exc}") from None
    return field


def _array_field(dset: Any, path: str, name: str, sel: tuple[Any, ...]) -> FieldValue:
    """The .npy body of ``dset[sel]``: bytes now if small, else a StreamedField that reopens."""
    ref = f"{path}::{name}"
    dtype, full_shape = _array_layout(dset, ref)
    shape = full_shape[len(sel):]
    size = len(npy_header(dtype, shape)) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size <= CHUNK_BYTES:
        data = b"".join(_iter_npy(dset, sel, ref))
        if len(data) != size:
            raise SourceError(f"{ref}: read {len(data)} bytes, expected {size}")
        return data
    return StreamedField(size=size, chunks=functools.partial(_dataset_chunks, path, name, sel))
