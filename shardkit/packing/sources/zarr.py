"""Zarr v3 groups and arrays as a source: one sample per array, or one sample per row of some arrays.

Arrays are packed as standard ``.npy`` bodies, as the HDF5 source packs its datasets (the
header ``np.save`` writes, then the C-order bytes; byte order kept), so readers decode both
the same way. A local store is read with zarr's ``LocalStore``, any other URL (``s3://``, ...)
with its ``FsspecStore``.

Keys and the ``source`` column name the store by its base name (``images.zarr``), not its full
path, so a store packed from disk and its copy in a bucket give identical datasets; the
store's URL is in dataset.json's ``source``.

Listing reads metadata only (``zarr.json`` of each node). The source is pickled into Ray
tasks, so it pickles only the URL and options; a process keeps the store open between loads
(rows mode also the block of rows read last) until ``task_done``.
"""

from __future__ import annotations

import fnmatch
import os
from typing import Any, Literal

import numpy as np

from shardkit.errors import SourceError
from shardkit.packing.sample import FieldValue, PackSample, safe_key
from shardkit.packing.sources.base import ListingSkips, SourceItem, check_unique_keys, item_bytes
from shardkit.packing.sources.npy import CHUNK_BYTES
from shardkit.packing.sources.npy_rows import NpyRows, row_field
from shardkit.packing.sources.zarr_read import (array_layout, array_npy, is_local, local_path, meta_attrs, npy_size,
                                                open_node, read_block, store_name)

__all__ = ["ZarrSource"]

# Rows mode reads at least this many bytes of consecutive rows at once, rounded down to whole
# chunks along axis 0: rows packed in order are read in order, and one request per small row
# would cost far more than its bytes (each chunk is also decoded once, not once per row).
_BLOCK_BYTES = 1 << 20
# A chunk up to this size is read whole even when it is bigger than _BLOCK_BYTES: reading part
# of a compressed chunk decodes all of it anyway, so reading it row block by row block would
# decode it once per block.
_MAX_CHUNK_BLOCK = 64 << 20


class _Column(NpyRows):
    """One rows-mode array of an open store: its field, the ``.npy`` header its rows share and
    the block of rows read last."""

    def __init__(self, arr: Any, ref: str) -> None:
        self.arr, self.ref = arr, ref
        dtype, shape = array_layout(arr, ref)
        super().__init__(dtype, shape, int(arr.chunks[0]), _BLOCK_BYTES, _MAX_CHUNK_BLOCK)
        self.chunk_rows = int(arr.chunks[0])
        self.bad = (0, 0)  # a block that failed to read: its rows are read chunk by chunk

    def value(self, row: int, url: str, storage_options: dict[str, Any] | None, name: str) -> FieldValue:
        """The .npy body of ``row``: from the block read last, else after reading its block."""
        if self.size > CHUNK_BYTES:
            return array_npy(self.arr, url, storage_options, name, (row,), self.ref)
        return self.row_body(row)

    def _read(self, row: int) -> None:
        """Read the block holding ``row``; if it fails, only the chunk holding it, so one bad
        chunk fails (or skips) its own rows, not every row of the block."""
        size = self.chunk_rows if self.bad[0] <= row < self.bad[1] else self.block_rows
        start = row - row % size  # aligned, so blocks start on chunk boundaries
        stop = min(start + size, self.n_rows)
        try:
            data = read_block(self.arr, (slice(start, stop),), self.dtype, self.ref,
                              f"rows {start}-{stop - 1} (row {row})")
        except SourceError:
            if size == self.chunk_rows or stop - start <= self.chunk_rows:
                raise
            self.bad = (start, stop)
            self._read(row)
            return
        self.start, self.stop, self.block = start, stop, data.reshape(-1).view(np.uint8).data


class _Open:
    """The store as one process opened it: the root node and the arrays looked up so far."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        self.pid = os.getpid()  # a forked child opens its own (fsspec's clients are per process)
        self.node = open_node(url, storage_options)
        self.columns: dict[str, _Column] = {}


class ZarrSource:
    """Zarr arrays as samples.

    Args:
        url: a Zarr v3 group or array: a local path, ``file://`` URL or any fsspec URL.
        arrays: in ``"arrays"`` mode, an optional comma-separated list of array paths or glob
            patterns (``images/*``) to include (default: every array); in ``"rows"`` mode, the
            comma-separated arrays whose rows form the samples (required).
        mode: ``"arrays"``: each array is a sample, key ``safe_key("<stem>/<path>")`` (``<stem>``
            the store's base name without ``.zarr``), field ``npy``, meta ``source`` =
            ``"<store name>::/<path>"`` plus scalar attributes as ``attr_<name>``. ``"rows"``:
            row ``i`` of every named array is one sample, key ``safe_key(f"{stem}_{i:09d}")``,
            fields ``<basename>.npy``, meta ``source`` = ``"<store name>::<i>"``.
        storage_options: fsspec options for a remote store (endpoint, credentials).

    A store that is one array (no group) is named by its stem: one sample keyed
    ``safe_key(stem)``, or its rows with ``arrays=stem``.

    Raises:
        SourceError: a bad mode, or rows mode without arrays.
    """

    def __init__(self, url: str | os.PathLike[str], *, arrays: str | None = None,
                 mode: Literal["arrays", "rows"] = "arrays", storage_options: dict[str, Any] | None = None) -> None:
        if mode not in ("arrays", "rows"):
            raise SourceError(f"ZarrSource: mode must be 'arrays' or 'rows', not {mode!r}")
        text = os.fspath(url)
        # Absolute: Ray tasks on an existing cluster run in another working directory.
        self.url = os.path.abspath(local_path(text)) if is_local(text) else text.rstrip("/")
        self.mode = mode
        self.arrays = [a.strip().strip("/") for a in (arrays or "").split(",") if a.strip().strip("/")]
        if mode == "rows" and not self.arrays:
            raise SourceError("ZarrSource: mode='rows' needs arrays='name[,name...]' (--zarr-rows)")
        self.storage_options = dict(storage_options or {})
        self.listing = ListingSkips()
        name = store_name(self.url)
        self.name = name
        self.stem = name[:-5] if name.lower().endswith(".zarr") and len(name) > 5 else name
        self._open: _Open | None = None

    def __getstate__(self) -> dict[str, Any]:
        """The URL and options only: open stores never cross a process boundary."""
        state = dict(self.__dict__)
        state["_open"] = None
        return state

    def __repr__(self) -> str:
        return f"ZarrSource({self.url!r}, arrays={','.join(self.arrays) or None!r}, mode={self.mode!r})"

    def task_done(self) -> None:
        """Drop the store and the block of rows this process kept between loads; a later
        ``load`` reopens it. The packer calls this after each task."""
        self._open = None

    # -- listing ---------------------------------------------------------------------------

    def _members(self, node: Any) -> dict[str, Any]:
        """Array path -> array; a store that is one array is named by its stem."""
        if not hasattr(node, "members"):
            return {self.stem: node}
        return {path: obj for path, obj in node.members(max_depth=None) if not hasattr(obj, "members")}

    def list_items(self) -> list[SourceItem]:
        """All items, reading only Zarr metadata (names, shapes, dtypes).

        Returns:
            One item per array (``ref`` ``<url>::/<path>``) or per row (``<url>::[<i>]``).

        Raises:
            SourceNotFoundError: no Zarr store at the URL.
            SourceError: zarr is not installed; in arrays mode a named array is missing or
                holds what ``.npy`` cannot (unless skipped); in rows mode a named array is
                missing, scalar or unsupported, or the arrays differ in length; nothing to
                pack; or two items share a key.
        """
        node = open_node(self.url, self.storage_options)
        members = self._members(node)
        root_array = not hasattr(node, "members")
        items = self._list_arrays(members, root_array) if self.mode == "arrays" else self._list_rows(members)
        if not items:
            raise SourceError(f"{self.url}: no arrays to pack")
        check_unique_keys(items)
        return items

    def _ref(self, name: str) -> str:
        return f"{self.url}::/{name}"

    def _list_arrays(self, members: dict[str, Any], root_array: bool) -> list[SourceItem]:
        names = sorted(members)
        if self.arrays:
            for pattern in self.arrays:  # a name without wildcards must exist
                if not any(c in pattern for c in "*?[") and pattern not in members:
                    self.listing.bad(self._ref(pattern), f"{self._ref(pattern)}: no such array in the store "
                                     f"({_some(names)}); fix the name, or pack with on_error='skip'")
            names = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in self.arrays)]
        items = []
        for name in names:
            ref = self._ref(name)
            try:
                dtype, shape = array_layout(members[name], ref)
            except SourceError as exc:
                self.listing.bad(ref, str(exc))
                continue
            key = safe_key(self.stem if root_array else f"{self.stem}/{name}")
            items.append(SourceItem(ref=ref, nbytes=item_bytes(key, [("npy", npy_size(dtype, shape))]), key=key))
        return items

    def _list_rows(self, members: dict[str, Any]) -> list[SourceItem]:
        fields: list[tuple[str, int]] = []
        length: int | None = None
        for name in self.arrays:
            ref = self._ref(name)
            if name not in members:
                raise SourceError(f"{ref}: no such array in the store ({_some(sorted(members))}); fix --zarr-rows")
            dtype, shape = array_layout(members[name], ref)
            if not shape:
                raise SourceError(f"{ref}: a scalar array has no rows; leave it out of --zarr-rows")
            if length is not None and shape[0] != length:
                raise SourceError(f"{ref}: has {shape[0]} rows but {self._ref(self.arrays[0])} has {length}; "
                                  "rows mode needs arrays of equal length along axis 0")
            length = shape[0]
            field = row_field(name, ref)
            if field in (f for f, _ in fields):
                raise SourceError(f"{ref}: two arrays would both be field {field!r}")
            fields.append((field, npy_size(dtype, shape[1:])))
        # Computed once: every row key has the same length (below 10**9 rows), so alike headers.
        row_bytes = item_bytes(safe_key(f"{self.stem}_{0:09d}"), fields)
        return [SourceItem(ref=f"{self.url}::[{i}]", nbytes=row_bytes, key=safe_key(f"{self.stem}_{i:09d}"))
                for i in range(length or 0)]

    # -- loading ---------------------------------------------------------------------------

    def _opened(self) -> _Open:
        if self._open is None or self._open.pid != os.getpid():
            self._open = _Open(self.url, self.storage_options)
        return self._open

    def _array(self, opened: _Open, name: str, ref: str) -> Any:
        node = opened.node
        if not hasattr(node, "members"):
            return node
        try:
            arr = node[name]
        except KeyError:
            raise SourceError(f"{ref}: no such array (the store changed since it was listed)") from None
        if hasattr(arr, "members"):
            raise SourceError(f"{ref}: a group, not an array")
        return arr

    def load(self, item: SourceItem) -> PackSample:
        """Read one item.

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample; arrays or rows over CHUNK_BYTES come back as StreamedFields.

        Raises:
            SourceError: the store or array cannot be read, a chunk is truncated or corrupt,
                or a row is out of range.
            StorageError: the store could not be reached.
        """
        _, _, what = item.ref.rpartition("::")
        opened = self._opened()
        if self.mode == "rows":
            return self._load_row(opened, item, int(what.strip("[]")))
        name = what[1:]
        arr = self._array(opened, name, item.ref)
        meta = meta_attrs(arr)
        meta["source"] = f"{self.name}::/{name}"
        inner = "" if not hasattr(opened.node, "members") else name
        return PackSample(key=item.key, fields={"npy": array_npy(arr, self.url, self.storage_options, inner, (),
                                                                 item.ref)}, meta=meta)

    def _load_row(self, opened: _Open, item: SourceItem, row: int) -> PackSample:
        fields: dict[str, FieldValue] = {}
        for name in self.arrays:
            col = opened.columns.get(name)
            if col is None:
                ref = self._ref(name)
                col = opened.columns[name] = _Column(self._array(opened, name, ref), ref)
            if row >= col.n_rows:
                raise SourceError(f"{col.ref}: row {row} out of range ({col.n_rows} rows)")
            inner = "" if not hasattr(opened.node, "members") else name
            fields[row_field(name, col.ref)] = col.value(row, self.url, self.storage_options, inner)
        return PackSample(key=item.key, fields=fields, meta={"source": f"{self.name}::{row}"})

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json.

        Returns:
            ``{"type": "zarr", "url": ..., "mode": ..., "arrays": ...}`` (``arrays`` None when
            every array is packed; no storage options).
        """
        return {"type": "zarr", "url": self.url, "mode": self.mode, "arrays": self.arrays or None}

    def labels(self) -> dict[str, int] | None:
        """A Zarr source has no classes.

        Returns:
            None.
        """
        return None


def _some(names: list[str], limit: int = 5) -> str:
    """A few of the store's array names, for an error."""
    if not names:
        return "it holds no arrays"
    shown = ", ".join(names[:limit])
    return f"it holds {shown}" + (f" and {len(names) - limit} more" if len(names) > limit else "")
