"""Reusable batch buffers: copy each batch into memory that is already mapped.

A fresh ``np.empty`` per batch is a fresh ``mmap`` from the allocator, and the copy into it
page-faults (and the kernel zero-fills) every 4 KiB page first, which makes the copy much
slower than one into memory already mapped. The pool hands out
slices of a few buffers and takes a buffer back once nothing refers to it any more, which
CPython's reference counts tell exactly: every numpy slice, ``torch.from_numpy`` tensor and
memoryview of a buffer holds a reference to it. A training loop that keeps its batches simply
gets new buffers (as without the pool); nothing ever waits for a buffer.
"""

from __future__ import annotations

import sys
from typing import Callable

import numpy as np

__all__ = ["BufferPool"]

_SPARE = 1.25  # a new buffer has room for a somewhat larger batch next time


def _plain(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, np.uint8)


class BufferPool:
    """Hands out uint8 arrays of the asked size, backed by reused buffers.

    Args:
        keep: buffers kept for reuse (the largest ones win when there are more).
        largest: bigger buffers are never kept (huge samples would pin that much memory).
        allocate: makes a new buffer of ``nbytes`` bytes as a uint8 array (default
            ``np.empty``); the torch side passes one that allocates page-locked (CUDA pinned)
            memory, for a copy-free GPU transfer.
    """

    def __init__(self, keep: int = 6, largest: int | None = None,
                 allocate: Callable[[int], np.ndarray] | None = None) -> None:
        self.keep, self.largest = keep, largest
        self._new = allocate or _plain
        self._bufs: list[np.ndarray] = []

    def _idle(self) -> list[int]:
        # getrefcount(self._bufs[i]) counts the list's reference and its own argument only.
        return [i for i in range(len(self._bufs)) if sys.getrefcount(self._bufs[i]) <= 2]

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array that no other caller holds.

        Args:
            nbytes: its size.

        Returns:
            An array of ``nbytes`` (contents undefined): a slice of a kept buffer that nothing
            refers to, or of a new one.
        """
        fits = [i for i in self._idle() if self._bufs[i].nbytes >= nbytes]
        if fits:
            return self._bufs[min(fits, key=lambda i: self._bufs[i].nbytes)][:nbytes]
        return self._allocate(int(nbytes * _SPARE) + 4096)[:nbytes]

    def _allocate(self, nbytes: int) -> np.ndarray:
        buf = self._new(nbytes)
        if self.largest is not None and nbytes > self.largest:
            return buf
        if len(self._bufs) >= self.keep:
            idle = self._idle()
            if not idle:
                return buf  # every kept buffer is in use: a one-off buffer, not kept
            del self._bufs[min(idle, key=lambda i: self._bufs[i].nbytes)]  # forget the smallest idle one
        self._bufs.append(buf)
        return buf

    def held_bytes(self) -> int:
        """Bytes of the buffers the pool keeps.

        Returns:
            The total size of the kept buffers (in use or idle).
        """
        return sum(b.nbytes for b in self._bufs)
