"""Shared-memory batch ring: DataLoader workers fill batches in place, the main process
reads them without a copy.

A torch DataLoader moves a worker's batch to the main process by pickling it: each tensor is
copied into a fresh shared-memory file, whose new pages the kernel zero-fills and faults in
on both sides (PERF.md: ~1.3 GB/s here). A :class:`BatchRing` is one anonymous shared mapping
made by the main process before the workers fork, so every worker inherits it. Worker ``w``
owns slots ``[w*k, (w+1)*k)``; it copies a batch straight from the (cached) shard into a free
slot and sends a :class:`RingBatch` of a few hundred bytes: the slot, the field sizes and
offsets, the keys. The main process wraps the slot's bytes as arrays (no copy). When the last
array over a slot is dropped, a finalizer marks the slot free, and its owner reuses pages that
are already mapped.

A worker that finds no free slot (the training loop is keeping batches) waits a moment and
then sends an ordinary batch: the ring never blocks the loader.
"""

from __future__ import annotations

import mmap
import os
import secrets
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from shardkit.errors import ConfigError

_FREE, _BUSY = 0, 1
_ALIGN = 64  # each field starts on a cache line
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not named by Python's mmap module before 3.13
_WAIT = 0.05  # seconds a worker waits for one of its slots before sending a plain batch
_RINGS: weakref.WeakValueDictionary[str, BatchRing] = weakref.WeakValueDictionary()


def _up(n: int, align: int) -> int:
    return -(-n // align) * align


class BatchRing:
    """``workers x slots_per_worker`` slots of ``slot_bytes`` in one shared mapping.

    Make it in the main process before the DataLoader forks its workers; pages are only
    backed by memory once a batch is written to them.
    """

    def __init__(self, workers: int, slots_per_worker: int, slot_bytes: int) -> None:
        if workers < 1 or slots_per_worker < 1 or slot_bytes < 1:
            raise ConfigError(f"BatchRing: bad geometry {workers} x {slots_per_worker} x {slot_bytes}")
        self.workers, self.per_worker = workers, slots_per_worker
        self.slot_bytes = _up(slot_bytes, mmap.PAGESIZE)
        n = workers * slots_per_worker
        self._header = _up(n, mmap.PAGESIZE)
        self._mm = mmap.mmap(-1, self._header + n * self.slot_bytes, flags=mmap.MAP_SHARED)
        self._flags = np.frombuffer(self._mm, np.uint8, count=n)
        self.id = secrets.token_hex(8)
        self.owner = os.getpid()
        self._mapped: dict[int, int] = {}  # slot -> bytes this process has mapped in
        self._mapped_pid = self.owner
        _RINGS[self.id] = self

    # ---- worker side ----------------------------------------------------------------------

    def acquire(self, worker: int, wait: float = _WAIT) -> int | None:
        """A free slot of ``worker`` (now marked busy), or None after ``wait`` seconds."""
        lo = (worker % self.workers) * self.per_worker
        flags = self._flags
        deadline = time.monotonic() + wait
        while True:
            for slot in range(lo, lo + self.per_worker):
                if flags[slot] == _FREE:
                    flags[slot] = _BUSY
                    return slot
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.0005)

    def fields(self, slot: int, sizes: list[int]) -> list[np.ndarray] | None:
        """Arrays of ``sizes`` bytes laid out in ``slot``, or None if they do not fit."""
        starts = self._starts(sizes)
        if starts[-1] > self.slot_bytes:
            return None
        self._map_in(slot, starts[-1])
        base = self._slot(slot)
        return [base[a:a + n] for a, n in zip(starts, sizes)]

    def _map_in(self, slot: int, nbytes: int) -> None:
        # A forked worker starts without page-table entries for the ring: writing a batch
        # would take one fault per 4 KiB page (40k per epoch for 20 MB batches). One
        # MADV_POPULATE_WRITE call maps the range instead, once per slot and process.
        if self._mapped_pid != os.getpid():
            self._mapped, self._mapped_pid = {}, os.getpid()
        have = self._mapped.get(slot, 0)
        if nbytes <= have or not sys.platform.startswith("linux"):  # the advice number is Linux's
            return
        start = self._header + slot * self.slot_bytes
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE, start + have, _up(nbytes, mmap.PAGESIZE) - have)
        except OSError:  # kernels before 5.14: the pages fault in as they are written
            pass
        self._mapped[slot] = _up(nbytes, mmap.PAGESIZE)

    def release(self, slot: int) -> None:
        self._flags[slot] = _FREE

    def batch(self, slot: int, sizes: list[int], names: list[str], meta: dict[str, Any]) -> RingBatch:
        """The descriptor a worker sends for the batch it wrote into ``slot``: fields
        ``names`` of ``sizes`` bytes, and ``meta``, the rest of the batch dict (the fields'
        own entries ``None``, for order)."""
        return RingBatch(self.id, slot, sizes, names, meta)

    # ---- main side ------------------------------------------------------------------------

    def _slot(self, slot: int) -> np.ndarray:
        return np.frombuffer(self._mm, np.uint8, count=self.slot_bytes, offset=self._header + slot * self.slot_bytes)

    @staticmethod
    def _starts(sizes: list[int]) -> list[int]:
        out, pos = [], 0
        for n in sizes:
            out.append(pos)
            pos = _up(pos + n, _ALIGN)
        out.append(pos)
        return out

    def busy(self) -> int:
        """Slots in use now (written by a worker and not yet dropped by the training loop)."""
        return int(np.count_nonzero(self._flags))


@dataclass
class RingBatch:
    """A batch that sits in a ring slot. In the main process, :meth:`arrays` wraps it."""

    ring_id: str
    slot: int
    sizes: list[int]
    names: list[str]
    meta: dict[str, Any]
    _finalizer: Any = field(default=None, repr=False, compare=False)  # set where it arrives

    def __reduce__(self) -> tuple[Callable[..., RingBatch], tuple[Any, ...]]:
        return _arrived, (self.ring_id, self.slot, self.sizes, self.names, self.meta)

    def to_dict(self) -> dict[str, Any]:
        """The batch dict, its fields as uint8 arrays over the slot (see :meth:`arrays`)."""
        arrays = self.arrays()
        return {k: arrays[k] if k in arrays else v for k, v in self.meta.items()}

    def arrays(self) -> dict[str, np.ndarray]:
        """The batch's fields as arrays over the slot; the slot is freed when all are gone."""
        ring = _RINGS.get(self.ring_id)
        if ring is None:
            raise ConfigError(f"ring batch {self.ring_id}/{self.slot}: its loader is gone")
        base = ring._slot(self.slot)
        if self._finalizer is not None:  # ownership of the slot moves to the arrays
            self._finalizer.detach()
            self._finalizer = None
        weakref.finalize(base, ring.release, self.slot)
        starts = ring._starts(self.sizes)
        return {name: base[a:a + n] for name, a, n in zip(self.names, starts, self.sizes)}


def _arrived(ring_id: str, slot: int, sizes: list[int], names: list[str], meta: dict[str, Any]) -> RingBatch:
    # Runs where the descriptor is unpickled (the main process): from now on the slot is
    # freed when this descriptor, or the arrays made from it, are dropped. A descriptor the
    # loader discards (a reset epoch, an error) therefore frees its slot too.
    rb = RingBatch(ring_id, slot, sizes, names, meta)
    ring = _RINGS.get(ring_id)
    if ring is not None:
        rb._finalizer = weakref.finalize(rb, ring.release, slot)
    return rb
