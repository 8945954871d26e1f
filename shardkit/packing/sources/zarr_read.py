"""Reading Zarr arrays as ``.npy`` bodies: opening a store, an array's layout, chunk-aligned slabs.

Shared by both modes of :class:`~shardkit.packing.sources.zarr.ZarrSource`. A local path opens
a ``LocalStore``, any other URL zarr's ``FsspecStore`` (``s3://`` with ``storage_options``).
zarr is imported on first use (:func:`~shardkit.packing.sources.optional.require`). Every read
error is turned into one line naming the store, the array and the rows read.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any, Iterator

import numpy as np

from shardkit.errors import SourceError, SourceNotFoundError, StorageError
from shardkit.packing.sample import FieldValue, StreamedField
from shardkit.packing.sources.npy import CHUNK_BYTES, npy_header
from shardkit.packing.sources.npy_rows import npy_slabs
from shardkit.packing.sources.optional import require

__all__ = ["array_layout", "array_npy", "is_local", "local_path", "meta_attrs", "npy_size", "open_node",
           "read_block", "store_name"]

_ATTR_OK = re.compile(r"[^A-Za-z0-9_]")


def is_local(url: str) -> bool:
    """Whether ``url`` is a local path (``file://`` included).

    Args:
        url: a path or URL.

    Returns:
        True for a plain path or a ``file://`` URL.
    """
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The local path of a plain path or ``file://`` URL.

    Args:
        url: a local path or ``file://`` URL.

    Returns:
        The path, ``file://`` removed.
    """
    return url[len("file://"):] if url.startswith("file://") else url


def store_name(url: str) -> str:
    """The store's base name (``images.zarr`` for ``s3://b/data/images.zarr/``): the same for a
    store on disk and its copy in a bucket, so keys and the ``source`` column are too.

    Args:
        url: the store's path or URL.

    Returns:
        The last component of its path.
    """
    return local_path(url).rstrip("/").rsplit("/", 1)[-1]


def open_node(url: str, storage_options: dict[str, Any] | None) -> Any:
    """The group or array at the root of the store at ``url``, opened read-only.

    Args:
        url: a local path, ``file://`` URL or any fsspec URL.
        storage_options: fsspec options for a remote store.

    Returns:
        A ``zarr.Group`` or ``zarr.Array``.

    Raises:
        SourceNotFoundError: nothing is there.
        SourceError: zarr is not installed, or it is no readable Zarr store.
        StorageError: the store could not be reached.
    """
    zarr = require("zarr")
    try:
        if is_local(url):
            path = local_path(url)
            if not os.path.isdir(path):
                raise SourceNotFoundError(f"{url}: no such Zarr store (a directory holding zarr.json)")
            store = zarr.storage.LocalStore(path, read_only=True)
        else:
            store = zarr.storage.FsspecStore.from_url(url, storage_options=dict(storage_options or {}),
                                                      read_only=True)
        return zarr.open(store=store, mode="r")
    except SourceError:
        raise
    except FileNotFoundError as exc:  # zarr's "no group or array found" derives from it too
        raise SourceNotFoundError(f"{url}: no Zarr group or array there (no zarr.json): {exc}") from None
    except OSError as exc:
        raise StorageError(f"{url}: cannot reach the Zarr store: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # zarr raises many types for bad metadata (ValueError, TypeError, its own)
        raise SourceError(f"{url}: not a readable Zarr store: {type(exc).__name__}: {exc}") from exc


def array_layout(arr: Any, ref: str) -> tuple[np.dtype, tuple[int, ...]]:
    """The (dtype, shape) the .npy body of ``arr`` will have.

    Args:
        arr: a ``zarr.Array``.
        ref: the array, for the error.

    Returns:
        The dtype (byte order kept) and shape.

    Raises:
        SourceError: a dtype ``.npy`` cannot hold (variable-length strings, objects).
    """
    dtype = np.dtype(arr.dtype)
    if dtype.hasobject or dtype.kind in "OT":
        raise SourceError(f"{ref}: unsupported dtype {arr.dtype} (variable-length strings or objects cannot be "
                          "stored as .npy); store it as a fixed-width dtype, or leave the array out")
    return dtype, tuple(int(n) for n in arr.shape)


def npy_size(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of the .npy body of an array of this dtype and shape.

    Args:
        dtype: the dtype.
        shape: the shape.

    Returns:
        The header's bytes plus the data's.
    """
    return len(npy_header(dtype, shape)) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def read_block(arr: Any, sel: tuple[slice, ...], dtype: np.dtype, ref: str, what: str) -> np.ndarray:
    """``arr[sel]`` read in one request, C-ordered in ``dtype``.

    Args:
        arr: a ``zarr.Array``.
        sel: the selection.
        dtype: the dtype to return (the array's own).
        ref: the array, for the error.
        what: the part read, for the error (``rows 0-127``).

    Returns:
        The data.

    Raises:
        SourceError: a chunk is truncated, corrupt or cannot be decoded.
        StorageError: the store could not be read.
    """
    try:
        return np.ascontiguousarray(arr[sel], dtype=dtype)
    except SourceError:
        raise
    except FileNotFoundError as exc:
        raise SourceError(f"{ref} {what}: a chunk vanished while reading it: {exc}") from exc
    except OSError as exc:
        raise StorageError(f"{ref} {what}: cannot read the Zarr store: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # codecs raise ValueError, RuntimeError, TypeError, their own types
        raise SourceError(f"{ref} {what}: cannot decode Zarr data ({type(exc).__name__}: {exc}): a chunk is "
                          "truncated or corrupt; rewrite it, or pack with on_error='skip'") from exc


def _what(lead: tuple[int, ...], slab: tuple[slice, ...]) -> str:
    """The part of an array a read covers, for its error (``row 7``, ``[0:128, 0:64]``)."""
    if lead:
        return f"row {lead[0]}"
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in slab) + "]"


def iter_npy(arr: Any, lead: tuple[int, ...], ref: str) -> Iterator[bytes]:
    """The .npy bytes of ``arr[lead]``: the header, then the data slab by slab.

    Args:
        arr: a ``zarr.Array``.
        lead: leading indices (``(i,)`` for row ``i``); empty for the whole array.
        ref: the array, for errors.

    Yields:
        The header, then the data in C order, pieces of at most CHUNK_BYTES where the
        array's trailing axes allow.

    Raises:
        SourceError: a dtype ``.npy`` cannot hold, or a chunk cannot be decoded.
        StorageError: the store could not be read.
    """
    dtype, full = array_layout(arr, ref)
    shape = full[len(lead):]
    yield npy_header(dtype, shape)
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return
    head = tuple(slice(i, i + 1) for i in lead)
    for slab in npy_slabs(shape, dtype.itemsize, tuple(arr.chunks)[len(lead):], CHUNK_BYTES):
        yield read_block(arr, head + slab, dtype, ref, _what(lead, slab)).tobytes()


def _reopen_chunks(url: str, storage_options: dict[str, Any] | None, name: str, lead: tuple[int, ...],
                   ref: str) -> Iterator[bytes]:
    """:func:`iter_npy` of array ``name``, opening the store for the read (a streamed field
    is written after the load that made it returned)."""
    node = open_node(url, storage_options)
    yield from iter_npy(node if not name else node[name], lead, ref)


def array_npy(arr: Any, url: str, storage_options: dict[str, Any] | None, name: str, lead: tuple[int, ...],
              ref: str) -> FieldValue:
    """The .npy body of ``arr[lead]`` as a field value.

    Args:
        arr: the ``zarr.Array`` (open now).
        url: its store (a streamed field reopens it).
        storage_options: fsspec options for a remote store.
        name: its path in the store (``""`` when the store is the array).
        lead: leading indices (``(i,)`` for row ``i``); empty for the whole array.
        ref: the array, for errors.

    Returns:
        The bytes, read now, if they fit CHUNK_BYTES; else a StreamedField that reads it
        slab by slab, so a large array never sits in memory whole.

    Raises:
        SourceError: a dtype ``.npy`` cannot hold, or a chunk cannot be decoded.
        StorageError: the store could not be read.
    """
    dtype, full = array_layout(arr, ref)
    size = npy_size(dtype, full[len(lead):])
    if size <= CHUNK_BYTES:
        return b"".join(iter_npy(arr, lead, ref))
    return StreamedField(size=size, chunks=functools.partial(_reopen_chunks, url, storage_options, name, lead, ref))


def meta_attrs(arr: Any) -> dict[str, Any]:
    """An array's scalar attributes (str, int, float, bool) as ``attr_<name>`` metadata, as the
    HDF5 source keeps them; lists, dicts and nulls are left out.

    Args:
        arr: a ``zarr.Array``.

    Returns:
        Metadata column -> value.
    """
    meta: dict[str, Any] = {}
    for name, value in sorted(arr.attrs.asdict().items()):
        if isinstance(value, (str, int, float, bool)):
            meta["attr_" + _ATTR_OK.sub("_", name)] = value
    return meta
