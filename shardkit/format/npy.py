"""The ``.npy`` header: reading and validating it without numpy's pickle-capable loader.

Both sides need it: packing checks ``.npy``/``.npz`` inputs, and random access reads the header
of a stored ``.npy`` member before it reads only some of its rows.
"""

from __future__ import annotations

import ast
import warnings
from typing import IO

import numpy as np

from shardkit.errors import SourceError
from shardkit.format.streams import read_exact

__all__ = ["MAX_HEADER", "parse_npy_header"]

_MAGIC = b"\x93NUMPY"
#: A header longer than this is not something np.save writes; it is refused, not read.
MAX_HEADER = 1 << 20


def parse_npy_header(fp: IO[bytes], *, name: str) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """Read and validate a ``.npy`` header from ``fp`` (positioned at its start).

    Reads only the header, never the data.

    Args:
        fp: a binary file object at the first byte of the ``.npy`` bytes.
        name: what the bytes are, for error messages (a path, a sample and field).

    Returns:
        ``(dtype, shape, fortran_order, header_len)``: ``header_len`` is the byte offset of
        the first data byte.

    Raises:
        SourceError: naming ``name`` if the magic, version or header dict is bad, the header is
            larger than :data:`MAX_HEADER`, or the dtype holds Python objects (pickled payloads
            are refused).
    """
    magic = read_exact(fp, 8)
    if len(magic) < 8 or magic[:6] != _MAGIC:
        raise SourceError(f"{name}: not a .npy file (bad magic)")
    major = magic[6]
    if major == 1:
        len_bytes = read_exact(fp, 2)
        prefix = 10
    elif major in (2, 3):
        len_bytes = read_exact(fp, 4)
        prefix = 12
    else:
        raise SourceError(f"{name}: unsupported .npy format version {major}.{magic[7]}")
    if len(len_bytes) < prefix - 8:
        raise SourceError(f"{name}: truncated .npy header")
    hlen = int.from_bytes(len_bytes, "little")
    if hlen > MAX_HEADER:
        raise SourceError(f"{name}: .npy header of {hlen} bytes is implausibly large")
    raw = read_exact(fp, hlen)
    if len(raw) < hlen:
        raise SourceError(f"{name}: truncated .npy header")
    try:
        text = raw.decode("utf8" if major == 3 else "latin1")
        d = ast.literal_eval(text)
        if not isinstance(d, dict) or set(d) != {"descr", "fortran_order", "shape"}:
            raise ValueError("header keys")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dtype = np.lib.format.descr_to_dtype(d["descr"])
        shape = tuple(int(n) for n in d["shape"])
        fortran = bool(d["fortran_order"])
        if any(n < 0 for n in shape):
            raise ValueError("negative dimension")
    except (ValueError, SyntaxError, TypeError, UnicodeDecodeError, MemoryError) as exc:
        raise SourceError(f"{name}: bad .npy header: {exc}") from exc
    if dtype.hasobject:
        raise SourceError(f"{name}: .npy holds pickled Python objects (dtype {dtype}); refused")
    return dtype, shape, fortran, prefix + hlen
