"""Reading HDF5 datasets as ``.npy`` bodies: the header ``np.save`` writes, then the data slab by slab.

A large array streams: its field is a :class:`~shardkit.packing.sample.StreamedField` that
reads the dataset slab by slab into one reused buffer, so a dataset of hundreds of MB never
sits in memory whole. h5py is imported on first use (:func:`~shardkit.packing.sources.optional.require`).
A file may be an object (``s3://...``): h5py reads it through a seekable fsspec file object,
each read a ranged GET, so a streamed array still moves slab by slab.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any, Iterator

import numpy as np

from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.packing.sample import FieldValue, StreamedField
from shardkit.packing.sources.npy import CHUNK_BYTES, npy_header
from shardkit.packing.sources.npy_rows import npy_slabs
from shardkit.packing.sources.objects import Objects, is_url
from shardkit.packing.sources.optional import require

__all__ = ["array_field", "array_layout", "dataset_chunks", "get_dataset", "meta_attrs", "open_h5", "read_into",
           "streaming_dataset"]

# Chunk cache per open file: big enough that a slab spanning a compressed HDF5 chunk does not
# decompress that chunk again for the next slab (h5py's default is 1 MB).
_RDCC_NBYTES = 32 * 1024 * 1024
_ATTR_OK = re.compile(r"[^A-Za-z0-9_]")


def open_h5(path: str, storage_options: dict[str, Any] | None = None) -> Any:
    """``path`` opened read-only with a chunk cache big enough for streamed slabs.

    Args:
        path: an HDF5 file: a local path or an object URL.
        storage_options: fsspec options for a URL (credentials, endpoint).

    Returns:
        The open ``h5py.File``.

    Raises:
        SourceNotFoundError: it does not exist.
        SourceError: it is no readable HDF5 file, or h5py is not installed.
    """
    h5py = require("hdf5")
    if is_url(path):
        raw = Objects(storage_options).open(path)  # SourceNotFoundError when missing
        try:
            return h5py.File(raw, "r", rdcc_nbytes=_RDCC_NBYTES)
        except (OSError, ValueError) as exc:
            raw.close()
            raise SourceError(f"{path}: not a readable HDF5 file: {exc}") from exc
    if not os.path.exists(path):
        raise SourceNotFoundError(f"{path}: no such file")
    try:
        return h5py.File(path, "r", rdcc_nbytes=_RDCC_NBYTES)
    except OSError as exc:
        raise SourceError(f"{path}: not a readable HDF5 file: {exc}") from exc


def array_layout(dset: Any, ref: str) -> tuple[np.dtype, tuple[int, ...]]:
    """The (dtype, shape) the .npy body of ``dset`` will have.

    Args:
        dset: an h5py dataset.
        ref: the dataset, for the error.

    Returns:
        The dtype and shape (an HDF5 array type's axes appended to the dataset's).

    Raises:
        SourceError: a dtype ``.npy`` cannot hold (objects, variable-length strings, opaque),
            or a null dataspace.
    """
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


def dataset_chunks(path: str, name: str, sel: tuple[Any, ...],
                   storage_options: dict[str, Any] | None = None) -> Iterator[bytes]:
    """The .npy bytes of ``path[name][sel]``, opening the file for the read.

    Args:
        path: the HDF5 file (a local path or an object URL).
        name: the dataset's path in it.
        sel: a leading selection (``(slice(i, i + 1),)`` for row ``i``); empty for the whole
            dataset.
        storage_options: fsspec options for a URL.

    Yields:
        The header, then the data slab by slab.

    Raises:
        SourceError: the file or dataset cannot be read.
    """
    ref = f"{path}::{name}"
    with open_h5(path, storage_options) as f:
        yield from _iter_npy(streaming_dataset(f, name, ref), sel, ref)


def streaming_dataset(f: Any, name: str, ref: str) -> Any:
    """Dataset ``name`` opened with a chunk cache of about one chunk (at most the file's).

    A streamed read visits every chunk once, in order, so the file-wide cache would only hold
    chunks never read again, raising the pack's peak memory (see benchmarks/RESULTS.md); one
    chunk still spares re-reading a chunk that two slabs share. HDF5 shares one cache between
    opens of a dataset, so the probe is closed before the reopen.

    Args:
        f: the open h5py file.
        name: the dataset's path in it.
        ref: the dataset, for the error.

    Returns:
        The h5py dataset.

    Raises:
        SourceError: no such dataset.
    """
    h5py = require("hdf5")
    probe = get_dataset(f, name, ref)
    chunks, itemsize, path = probe.chunks, probe.dtype.itemsize, probe.name
    del probe  # closes it: the cache settings of the first open would win
    if chunks is None:
        return get_dataset(f, name, ref)
    chunk_bytes = int(np.prod(chunks, dtype=np.int64)) * itemsize
    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_chunk_cache(521, min(_RDCC_NBYTES, max(1 << 20, chunk_bytes)), 0.75)
    return h5py.Dataset(h5py.h5d.open(f.id, path.encode(), dapl=dapl))


def _iter_npy(dset: Any, sel: tuple[Any, ...], ref: str) -> Iterator[bytes]:
    """Yield the .npy bytes of ``dset[sel]``: the header, then slab after slab.

    Slabs are read into one reused buffer of at most CHUNK_BYTES.

    Args:
        dset: an h5py dataset.
        sel: a leading selection (e.g. ``(slice(i, i + 1),)`` for row ``i``); empty means the
            whole dataset.
        ref: the dataset, for errors.

    Yields:
        The header, then the data slab by slab, in C order.

    Raises:
        SourceError: a dtype ``.npy`` cannot hold, or HDF5 cannot read the data.
    """
    dtype, full_shape = array_layout(dset, ref)
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
    for slab in npy_slabs(shape, dset.dtype.itemsize, chunk_shape, CHUNK_BYTES):
        dims = tuple(s.stop - s.start for s in slab) + sub
        n = int(np.prod(dims, dtype=np.int64))
        if buf is None or buf.size < n:
            buf = np.empty(n, dtype=dtype)
        view = buf[:n].reshape(dims)
        read_into(dset, view, tuple(sel) + slab, ref)
        yield view.tobytes()


def read_into(dset: Any, out: np.ndarray, sel: tuple[Any, ...], ref: str) -> None:
    """Read ``dset[sel]`` into ``out``.

    Args:
        dset: an h5py dataset.
        out: an array of the selection's shape and the dataset's dtype.
        sel: the selection.
        ref: the dataset, for the error.

    Raises:
        SourceError: HDF5 cannot read it.
    """
    try:
        if dset.dtype.subdtype is not None:
            out[...] = dset[sel]  # read_direct refuses array types; slices are small anyway
        else:
            dset.read_direct(out, source_sel=sel)
    except (OSError, ValueError, TypeError) as exc:
        raise SourceError(f"{ref}: cannot read HDF5 data: {exc}") from exc


def get_dataset(f: Any, name: str, ref: str) -> Any:
    """The dataset ``name`` of an open file.

    Args:
        f: the open h5py file.
        name: the dataset's path in it.
        ref: the dataset, for the error.

    Returns:
        The h5py dataset.

    Raises:
        SourceError: no such dataset, or a group rather than a dataset.
    """
    h5py = require("hdf5")
    try:
        obj = f[name]
    except KeyError as exc:
        raise SourceError(f"{ref}: no such dataset") from exc
    if not isinstance(obj, h5py.Dataset):
        raise SourceError(f"{ref}: not a dataset")
    return obj


def meta_attrs(dset: Any) -> dict[str, Any]:
    """A dataset's scalar attributes as ``attr_<name>`` metadata; anything else is left out.

    Args:
        dset: an h5py dataset.

    Returns:
        Metadata column -> value (str, int, float or bool).
    """
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


def array_field(dset: Any, path: str, name: str, sel: tuple[Any, ...],
                storage_options: dict[str, Any] | None = None) -> FieldValue:
    """The .npy body of ``dset[sel]`` as a field value.

    Args:
        dset: an h5py dataset of the open file ``path``.
        path: the HDF5 file (a streamed field reopens it).
        name: the dataset's path in it.
        sel: a leading selection (``(slice(i, i + 1),)`` for row ``i``); empty for the whole
            dataset.
        storage_options: fsspec options for a URL (a streamed field reopens it).

    Returns:
        The bytes, read now, if they fit CHUNK_BYTES; else a StreamedField that reopens the
        file and reads it slab by slab.

    Raises:
        SourceError: the data cannot be read, or not all of it.
    """
    ref = f"{path}::{name}"
    dtype, full_shape = array_layout(dset, ref)
    shape = full_shape[len(sel):]
    size = len(npy_header(dtype, shape)) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size <= CHUNK_BYTES:
        data = b"".join(_iter_npy(dset, sel, ref))
        if len(data) != size:
            raise SourceError(f"{ref}: read {len(data)} bytes, expected {size}")
        return data
    return StreamedField(size=size, chunks=functools.partial(dataset_chunks, path, name, sel, storage_options))
