"""Partial reads of huge ``.npy`` members: their header, then only the rows asked for.

``ShardDataset.read_array`` reads a stored ``.npy`` member through a *fetch*: a callable that
returns a buffer holding shard bytes ``[start, end)`` (checked or not, as the dataset decided)
and the shard offset where that buffer begins. The functions here decide which ranges to
fetch and build arrays over the fetched bytes; they never touch storage themselves.
"""

from __future__ import annotations

import io
import operator
from typing import Callable, NamedTuple

import numpy as np

from shardkit.errors import ConfigError, IntegrityError, ShardkitError
from shardkit.format.npy import parse_npy_header
from shardkit.read.dataset import ShardRows
from shardkit.read.segments import GAP_BYTES

__all__ = ["Fetch", "NpyHeader", "array_at", "member_name", "member_span", "read_npy_header", "read_rows",
           "select_rows"]

_HEAD_READ = 4096            # first read of a .npy member; np.save headers are 128 bytes or so
_MAX_HEADER = 65536 + 16     # the bound numpy itself applies (codecs.npy_view)

#: Shard bytes ``[start, end)`` of one sample, fetched: a buffer holding them and the shard
#: byte where that buffer begins.
Fetch = Callable[[int, int], "tuple[np.ndarray, int]"]


class NpyHeader(NamedTuple):
    """Where a stored ``.npy`` member's array lies and how it is laid out."""

    dtype: np.dtype
    shape: tuple[int, ...]
    fortran: bool
    data_offset: int  # shard byte offset of the first array byte


def member_span(rows: ShardRows, pos: int, field: str, index: int) -> tuple[int, int]:
    """Where member ``field`` of sample ``pos`` lies in its shard.

    Args:
        rows: the shard's manifest rows.
        pos: the sample's position in the shard.
        field: the member (``"npy"``, ``"depth.npy"``, ...).
        index: the sample's global index (for the message).

    Returns:
        ``(shard offset, size)`` of the member's bytes.

    Raises:
        ConfigError: the sample has no such member.
    """
    names, offs, sizes = rows.fields(pos)
    if field not in names:
        raise ConfigError(f"sample {rows.key(pos)!r} (index {index}) has no field {field!r} (fields: {names})")
    j = names.index(field)
    return int(offs[j]), int(sizes[j])


def member_name(rows: ShardRows, pos: int, index: int, field: str) -> str:
    """A member named for error messages.

    Args:
        rows: the shard's manifest rows.
        pos: the sample's position in the shard.
        index: the sample's global index.
        field: the member.

    Returns:
        ``sample '<key>' (index <index>) field '<field>'``.
    """
    return f"sample {rows.key(pos)!r} (index {index}) field {field!r}"


def array_at(got: tuple[np.ndarray, int], start: int, hdr: NpyHeader, shape: tuple[int, ...]) -> np.ndarray:
    """The array of ``shape`` whose bytes begin at shard byte ``start``, as a view of ``got``.

    Args:
        got: a buffer of fetched bytes and the shard byte it begins at (what a :data:`Fetch` returns).
        start: the shard byte of the array's first byte (inside ``got``).
        hdr: the member's header (dtype and order).
        shape: the shape of the array to view.

    Returns:
        A view of ``got``'s buffer (no copy).
    """
    buf, base = got
    nbytes = int(np.prod(shape, dtype=np.int64)) * hdr.dtype.itemsize
    return buf[start - base:start - base + nbytes].view(hdr.dtype).reshape(shape, order="F" if hdr.fortran else "C")


def read_npy_header(fetch: Fetch, offset: int, size: int, name: str) -> NpyHeader:
    """Read and check the header of the ``.npy`` member at shard bytes ``[offset, offset + size)``.

    Fetches the first 4 KiB of the member (np.save headers are far smaller), and the rest of
    the header only when it is longer.

    Args:
        fetch: reads shard bytes of the sample holding the member.
        offset: the shard offset of the member's first byte.
        size: the member's size in bytes.
        name: the member, for error messages (sample key, index and field).

    Returns:
        The member's dtype, shape, order and the shard offset of its first array byte.

    Raises:
        IntegrityError: the header is not a valid ``.npy`` header, is implausibly large, or
            does not describe exactly the member's bytes.
    """
    def head(n: int) -> bytes:
        n = min(n, size)
        buf, base = fetch(offset, offset + n)
        return bytes(buf[offset - base:offset - base + n])

    raw = head(_HEAD_READ)
    if len(raw) >= 12 and raw[:6] == b"\x93NUMPY":
        prefix = 10 if raw[6] == 1 else 12
        need = prefix + int.from_bytes(raw[8:prefix], "little")
        if need > _MAX_HEADER:
            raise IntegrityError(f"{name}: .npy header of {need} bytes is implausibly large")
        if need > len(raw):
            raw = head(need)
    try:
        dtype, shape, fortran, hlen = parse_npy_header(io.BytesIO(raw), name=name)
    except ShardkitError as exc:
        raise IntegrityError(str(exc)) from exc
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if hlen + nbytes != size:
        raise IntegrityError(f"{name}: .npy header says {hlen} + {nbytes} bytes, the member is {size}")
    return NpyHeader(dtype, tuple(shape), fortran, offset + hlen)


def select_rows(shape: tuple[int, ...], rows: int | slice, what: str) -> int | slice:
    """Check a row selection against an array's first axis.

    Args:
        shape: the array's shape.
        rows: an int (negative counts from the end) or a slice along the first axis.
        what: the member, for error messages.

    Returns:
        The non-negative row, or the slice unchanged.

    Raises:
        IndexError: a 0-d array, or a row or slice bound out of range (slices are not clipped).
        ConfigError: a zero slice step, or ``rows`` neither an int nor a slice.
    """
    if not shape:
        raise IndexError(f"{what}: a 0-d array has no rows to select")
    n0 = shape[0]
    if isinstance(rows, slice):
        if rows.step == 0:
            raise ConfigError(f"{what}: slice step cannot be zero")
        for bound in (rows.start, rows.stop):
            if bound is not None and not -n0 <= operator.index(bound) <= n0:
                raise IndexError(f"{what}: slice bound {bound} out of range for {n0} rows")
        return rows
    try:
        r = operator.index(rows)
    except TypeError:
        raise ConfigError(f"{what}: rows must be None, an int or a slice, got {type(rows).__name__}") from None
    if not -n0 <= r < n0:
        raise IndexError(f"{what}: row {r} out of range for {n0} rows")
    return r + n0 if r < 0 else r


def read_rows(fetch: Fetch, hdr: NpyHeader, end: int, sel: int | slice) -> np.ndarray:
    """The rows ``sel`` of the member ``hdr`` describes, fetching only the bytes they need.

    A C-ordered member fetches the rows covering the selection (a fetch may round that out,
    to the checked blocks around it); rows of a stepped slice at least ``GAP_BYTES`` apart are
    fetched one by one instead of the span between them. A Fortran-ordered member (its rows
    are not contiguous) is fetched whole, then sliced.

    Args:
        fetch: reads shard bytes of the sample holding the member.
        hdr: the member's header.
        end: the shard offset just past the member's last byte.
        sel: a row or slice from :func:`select_rows`.

    Returns:
        The rows, over bytes fetched for this call (copied out when a few rows would keep
        much larger fetched blocks alive); for an int row, the row with the first axis dropped.
    """
    if hdr.fortran:
        # Fortran order: a row is strided through the whole array, so the whole array is read.
        whole = array_at(fetch(hdr.data_offset, end), hdr.data_offset, hdr, hdr.shape)
        return np.ascontiguousarray(whole[sel])
    picked = range(sel, sel + 1) if isinstance(sel, int) else range(*sel.indices(hdr.shape[0]))
    if not picked:
        return np.empty((0,) + hdr.shape[1:], dtype=hdr.dtype)
    row_bytes = int(np.prod(hdr.shape[1:], dtype=np.int64)) * hdr.dtype.itemsize
    if (abs(picked.step) - 1) * row_bytes >= GAP_BYTES:
        # Rows far apart (rows=slice(0, 2400, 800)): one read each, not the span between.
        out = np.empty((len(picked),) + hdr.shape[1:], dtype=hdr.dtype)
        for k, r in enumerate(picked):
            start = hdr.data_offset + r * row_bytes
            out[k] = array_at(fetch(start, start + row_bytes), start, hdr, (1,) + hdr.shape[1:])[0]
        return out
    lo, hi = min(picked), max(picked) + 1  # the covering rows; exactly the rows when step is 1
    start = hdr.data_offset + lo * row_bytes
    got = fetch(start, start + (hi - lo) * row_bytes)
    block = array_at(got, start, hdr, (hi - lo,) + hdr.shape[1:])
    if 2 * block.nbytes < len(got[0]):
        block = block.copy()  # a few rows must not keep the blocks read around them alive
    if isinstance(sel, int):
        return block[0]
    if picked.step == 1:
        return block
    return np.ascontiguousarray(block[np.asarray(picked) - lo])
