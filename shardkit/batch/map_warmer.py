"""MapWarmer: the page faults of a freshly mapped shard taken on another thread, ahead of the reader.

Zero-copy batches are views into mapped cache files; the first touch of each page of a fresh
map is a page fault, which costs about what copying the page would. One
``MADV_POPULATE_READ`` call per shard, made by a thread (ctypes releases the GIL), takes those
faults on another core while the training loop reads the batches before it.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from shardkit.read.held import Held
from shardkit.util.libc import libc_function

__all__ = ["MapWarmer"]


class MapWarmer:
    """Maps in the pages of each shard zero-copy batches read from, on another thread.

    Call it with each held shard as a batch opens it; close it when the stream ends. Linux
    5.14+; elsewhere a no-op.
    """

    _ADVICE = 22  # MADV_POPULATE_READ

    # Maps already populated, across streams: a kept map (cache.kept_maps) stays populated from one
    # epoch to the next; weak, so a map that goes is forgotten with it.
    _done: weakref.WeakSet[object] = weakref.WeakSet()

    def __init__(self) -> None:
        self._madvise = _libc_madvise()
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, held: Held) -> None:
        """Start populating ``held``'s map, unless it was already (by any stream).

        Args:
            held: a shard the reader holds open and mapped.
        """
        if self._madvise is None:
            return
        arr, owner = held.array, held.mapped
        if owner in self._done:
            return
        self._done.add(owner)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardkit-map")
        # The array keeps the map alive (the source cannot unmap it) until the call returns.
        self._pool.submit(self._populate, arr)

    def _populate(self, arr: np.ndarray) -> None:
        if arr.size and self._madvise is not None:
            page = mmap.PAGESIZE
            start = arr.ctypes.data // page * page
            self._madvise(start, arr.ctypes.data + arr.size - start, self._ADVICE)  # errors: just slower

    def close(self) -> None:
        """Wait for the calls in flight and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _libc_madvise() -> Any:
    return libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
