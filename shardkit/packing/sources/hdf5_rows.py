"""Rows mode of the HDF5 source: files kept open between loads, rows read in blocks.

One sample per row would otherwise reopen the file and look every dataset up again per row,
and read each small row on its own. A process keeps at most :data:`_MAX_OPEN_FILES` files open
(the least recently used closes); files inherited across a fork are never used or closed by
the child.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from shardkit.errors import SourceError
from shardkit.packing.sample import FieldValue, StreamedField
from shardkit.packing.sources.hdf5_read import array_layout, dataset_chunks, open_h5, read_into, streaming_dataset
from shardkit.packing.sources.npy import CHUNK_BYTES
from shardkit.packing.sources.npy_rows import NpyRows, row_field
from shardkit.util.lru import LRU

__all__ = ["OpenRows", "RowColumn", "RowFile"]

# Rows mode reads this many bytes of consecutive rows at once: rows packed in order are read in
# order, and one HDF5 read per row costs far more than a small row's bytes (see
# benchmarks/RESULTS.md, bench_hdf5_rows). Blocks are rounded to whole chunks, so a compressed
# chunk is decompressed once.
_BLOCK_BYTES = 1 << 20
# Rows-mode files a source keeps open at once (per process); the least recently used closes.
_MAX_OPEN_FILES = 4


class RowColumn(NpyRows):
    """One dataset of an open rows-mode file, looked up once: its field, the ``.npy`` header
    every row shares (a row's shape and dtype are fixed), and the block of rows read last.

    Args:
        f: the open h5py file.
        path: the file's path or URL.
        name: the dataset's path in the file.
        storage_options: fsspec options for a URL (a streamed row reopens it).

    Raises:
        SourceError: no such dataset, a scalar one, or a dtype ``.npy`` cannot hold.
    """

    def __init__(self, f: Any, path: str, name: str, storage_options: dict[str, Any] | None = None) -> None:
        self.path, self.name, self.ref = path, name, f"{path}::/{name}"
        self.storage_options = storage_options
        dset = streaming_dataset(f, name, self.ref)
        dtype, shape = array_layout(dset, self.ref)
        if not shape:
            raise SourceError(f"{self.ref}: scalar dataset has no rows")
        self.field = row_field(name, self.ref)
        chunk_rows = dset.chunks[0] if dset.chunks else None
        super().__init__(dtype, shape, chunk_rows, _BLOCK_BYTES)
        # A row over CHUNK_BYTES streams through its own open (see dataset_chunks); holding
        # the dataset here would make that open share this one's bigger chunk cache.
        self.dset: Any = dset if self.size <= CHUNK_BYTES and self.row_nbytes else None

    def value(self, row: int) -> FieldValue:
        """The .npy body of ``row``.

        Args:
            row: the row index (in range: the caller checks).

        Returns:
            Bytes, or a StreamedField for a row over CHUNK_BYTES.

        Raises:
            SourceError: HDF5 cannot read the block holding it.
        """
        if self.size > CHUNK_BYTES:
            return StreamedField(size=self.size, chunks=functools.partial(
                dataset_chunks, self.path, "/" + self.name, (row,), self.storage_options))
        return self.row_body(row)

    def _read(self, row: int) -> None:
        start = row - row % self.block_rows  # aligned, so blocks start on chunk boundaries
        stop = min(start + self.block_rows, self.n_rows)
        buf = np.empty((stop - start,) + self.row_shape, dtype=self.dtype)
        read_into(self.dset, buf, (slice(start, stop),), self.ref)
        self.start, self.stop, self.block = start, stop, buf.reshape(-1).view(np.uint8).data


class RowFile:
    """An open rows-mode file and the columns looked up in it so far.

    Args:
        path: the HDF5 file (a local path or an object URL).
        storage_options: fsspec options for a URL.

    Raises:
        SourceNotFoundError: it does not exist.
        SourceError: it is no readable HDF5 file.
    """

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None) -> None:
        self.path = path
        self.storage_options = storage_options
        self.file = open_h5(path, storage_options)
        self.columns: dict[str, RowColumn] = {}

    def column(self, name: str) -> RowColumn:
        """The dataset ``name``, looked up on first use.

        Args:
            name: the dataset's path in the file.

        Returns:
            Its column.

        Raises:
            SourceError: as :class:`RowColumn`.
        """
        col = self.columns.get(name)
        if col is None:  # a missing dataset is not remembered: it raises on every load, as before
            col = self.columns[name] = RowColumn(self.file, self.path, name, self.storage_options)
        return col

    def close(self) -> None:
        """Close the file (its columns with it)."""
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


class OpenRows:
    """A process's open rows-mode files, at most ``_MAX_OPEN_FILES`` (the least recently used
    closes when another opens)."""

    def __init__(self) -> None:
        self.generation = _fork_generation
        self.files: LRU[str, RowFile] = LRU(_MAX_OPEN_FILES, on_evict=RowFile.close)

    @property
    def inherited(self) -> bool:
        """Made before this process forked: its files are the parent's (see :meth:`release`)."""
        return self.generation != _fork_generation

    def get(self, path: str, storage_options: dict[str, Any] | None = None) -> RowFile:
        """The open file at ``path``, opened now if it is not.

        Args:
            path: an HDF5 file (a local path or an object URL).
            storage_options: fsspec options for a URL.

        Returns:
            The open file.

        Raises:
            SourceNotFoundError: it does not exist.
            SourceError: it is no readable HDF5 file.
        """
        rf = self.files.get(path)
        if rf is None:
            rf = RowFile(path, storage_options)
            self.files.put(path, rf)
        return rf

    def release(self) -> None:
        """Close the files, oldest first; in a forked child, keep the inherited ones referenced
        instead (closing them there would drop the parent's lock on them)."""
        if self.inherited:
            _INHERITED.append(self)
            return
        for path in list(self.files):
            rf = self.files.pop(path)
            if rf is not None:
                rf.close()
