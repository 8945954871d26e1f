"""Which file backs an address of this process: for tests that show a view is no copy."""

from __future__ import annotations

import os

__all__ = ["mapped_file"]


def mapped_file(addr: int) -> str:
    """The file mapped at address ``addr`` in this process ('' for anonymous memory).

    Args:
        addr: an address (e.g. ``array.ctypes.data``).

    Returns:
        The mapped file's path as /proc/self/maps names it, '' when none is.
    """
    with open(f"/proc/{os.getpid()}/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5] if len(parts) > 5 else ""
    return ""
