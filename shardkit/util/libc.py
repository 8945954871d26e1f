"""Functions of the C library that Python does not wrap, looked up once where they exist."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

__all__ = ["libc_function"]


def libc_function(name: str, argtypes: list[Any] | None = None, restype: Any = ctypes.c_int) -> Any:
    """A function of the C library, looked up by name.

    Args:
        name: the symbol (``"fallocate"``...).
        argtypes: its ctypes argument types, if it should be typed.
        restype: its ctypes result type.

    Returns:
        The ctypes function, or None off Linux or where the symbol is missing (callers then
        do without it).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    if argtypes is not None:
        fn.argtypes = argtypes
    fn.restype = restype
    return fn
