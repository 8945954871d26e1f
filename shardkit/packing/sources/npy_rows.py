"""Arrays (Zarr, HDF5) as ``.npy`` bodies piece by piece: the slabs a big array streams in,
and rows mode's rows, each its own ``.npy`` body, served from blocks of consecutive rows.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from shardkit.errors import SourceError
from shardkit.packing.sample import check_field_name
from shardkit.packing.sources.npy import npy_header

__all__ = ["NpyRows", "npy_slabs", "row_field"]


def npy_slabs(shape: tuple[int, ...], itemsize: int, chunks: tuple[int, ...] | None,
              bound: int) -> Iterator[tuple[slice, ...]]:
    """Selections covering an array of ``shape`` in C order, each at most ``bound`` bytes when possible.

    Splits along the first axis whose trailing block fits the bound; leading axes are walked
    one index at a time. Slab lengths are rounded to whole chunks when that still fits, so no
    chunk is decoded twice for one slab boundary. Zarr arrays and HDF5 datasets stream their
    ``.npy`` bodies slab by slab.

    Args:
        shape: the array's shape.
        itemsize: bytes per element.
        chunks: the chunk shape along the same axes, or None for an unchunked array.
        bound: the most bytes a slab should hold (the caller's CHUNK_BYTES).

    Returns:
        An iterator of selections (one slice per axis), in C order.
    """
    if not shape:
        yield ()
        return
    inner, k = itemsize, len(shape) - 1  # inner: bytes of one index step along axis k
    for axis in range(len(shape) - 1, -1, -1):
        if inner * shape[axis] > bound:
            k = axis
            break
        inner *= shape[axis]
    else:
        yield tuple(slice(0, n) for n in shape)  # the whole array fits in one piece
        return
    step = max(1, bound // inner)
    if chunks is not None and chunks[k] <= step:
        step -= step % chunks[k]
    for lead in np.ndindex(*shape[:k]):
        for start in range(0, shape[k], step):
            yield (tuple(slice(i, i + 1) for i in lead) + (slice(start, min(start + step, shape[k])),)
                   + tuple(slice(0, n) for n in shape[k + 1:]))


def row_field(name: str, ref: str) -> str:
    """The field a rows-mode dataset's (HDF5) or array's (Zarr) rows are packed as: its base name plus ``.npy``.

    Args:
        name: the dataset's path in the file (the array's in the store).
        ref: the dataset, for the error.

    Returns:
        The field name (``img.npy`` for ``grp/img``).

    Raises:
        SourceError: the name makes no valid field name.
    """
    field = name.rsplit("/", 1)[-1] + ".npy"
    try:
        check_field_name(field)
    except SourceError as exc:
        raise SourceError(f"{ref}: {exc}") from None
    return field


class NpyRows:
    """The rows of one array as ``.npy`` bodies, served from the block of rows read last.

    Rows-mode Zarr and HDF5 columns share this: the header every row shares (a row's shape
    and dtype are fixed), the block size, and slicing a row out of the block. A subclass
    reads blocks in :meth:`_read`, setting ``start``, ``stop`` and ``block``.

    Args:
        dtype: the array's dtype.
        shape: the array's shape (rows along axis 0).
        chunk_rows: rows per chunk along axis 0, or None for an unchunked array.
        block_bytes: read at least this many bytes of consecutive rows at once.
        whole_chunk_bytes: a chunk bigger than ``block_bytes`` but at most this size is read
            whole (0: never).

    Raises:
        SourceError: a dtype ``.npy`` cannot hold.
    """

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...], chunk_rows: int | None, block_bytes: int,
                 whole_chunk_bytes: int = 0) -> None:
        self.dtype, self.n_rows, self.row_shape = dtype, shape[0], shape[1:]
        self.header = npy_header(dtype, self.row_shape)
        self.row_nbytes = int(np.prod(self.row_shape, dtype=np.int64)) * dtype.itemsize
        self.size = len(self.header) + self.row_nbytes
        rows = max(1, block_bytes // max(1, self.row_nbytes))
        if chunk_rows is not None and chunk_rows <= rows:
            rows -= rows % chunk_rows  # whole chunks: each is decoded by one read only
        elif whole_chunk_bytes and chunk_rows is not None and chunk_rows * self.row_nbytes <= whole_chunk_bytes:
            rows = chunk_rows
        self.block_rows = rows
        self.start = self.stop = 0
        self.block = memoryview(b"")

    def row_body(self, row: int) -> bytes:
        """The .npy body of ``row`` (at most CHUNK_BYTES: the caller streams bigger ones).

        Args:
            row: the row index (in range: the caller checks).

        Returns:
            The header and the row's bytes, from the block read last, else after reading its block.

        Raises:
            SourceError: the block holding it cannot be read.
        """
        if not self.row_nbytes:  # rows of zero elements are their header alone
            return self.header
        if not self.start <= row < self.stop:
            self._read(row)
        at = (row - self.start) * self.row_nbytes
        return self.header + self.block[at:at + self.row_nbytes]

    def _read(self, row: int) -> None:
        raise NotImplementedError
