"""Shared-memory batch ring: DataLoader workers fill batches in place, the main process
reads them without a copy.

A torch DataLoader moves a worker's batch to the main process by pickling it: each tensor is
copied into a fresh shared-memory file, whose new pages the kernel zero-fills and faults in
on both sides (see benchmarks/RESULTS.md for what that costs). A :class:`BatchRing` is one anonymous shared mapping
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

__all__ = ["BatchRing", "RingBatch"]

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

    Args:
        workers: DataLoader workers (worker ``w`` owns its own slots).
        slots_per_worker: batches each worker may have in flight in the ring.
        slot_bytes: room per batch (rounded up to whole pages).

    Raises:
        ConfigError: a count or size below 1.
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
        """A free slot of ``worker``, now marked busy.

        Args:
            worker: the DataLoader worker id.
            wait: seconds to wait for one of its slots to come free.

        Returns:
            The slot, or None when none came free within ``wait``.
        """
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
        """Arrays of ``sizes`` bytes laid out in ``slot``.

        Args:
            slot: a slot this process acquired.
            sizes: bytes of each field.

        Returns:
            One uint8 array per field over the slot, or None if they do not fit in it.
        """
        starts = self._starts(sizes)
        if starts[-1] > self.slot_bytes:
            return None
        self._map_in(slot, starts[-1])
        base = self._slot(slot)
        return [base[a:a + n] for a, n in zip(starts, sizes)]

    def _map_in(self, slot: int, nbytes: int) -> None:
        # A forked worker starts without page-table entries for the ring: writing a batch
        # would take one fault per 4 KiB page. One MADV_POPULATE_WRITE call maps the range
        # instead, once per slot and process.
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
        """Mark ``slot`` free (its batch was dropped, or never sent).

        Args:
            slot: the slot.
        """
        self._flags[slot] = _FREE

    def batch(self, slot: int, sizes: list[int], names: list[str], meta: dict[str, Any]) -> RingBatch:
        """The descriptor a worker sends for the batch it wrote into ``slot``.

        Args:
            slot: the slot written.
            sizes: bytes of each field.
            names: the fields, in the order of ``sizes``.
            meta: the rest of the batch dict (the fields' own entries ``None``, for order).

        Returns:
            A small picklable descriptor.
        """
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
        """Slots in use now.

        Returns:
            Slots a worker holds or wrote and the training loop has not dropped yet.
        """
        return int(np.count_nonzero(self._flags))


@dataclass
class RingBatch:
    """A batch that sits in a ring slot. In the main process, :meth:`arrays` wraps it.

    Pickles as its fields; where it is unpickled (the main process), the slot is freed when
    the descriptor, or the arrays made from it, are dropped.
    """

    ring_id: str
    slot: int
    sizes: list[int]
    names: list[str]
    meta: dict[str, Any]
    _finalizer: Any = field(default=None, repr=False, compare=False)  # set where it arrives

    def __reduce__(self) -> tuple[Callable[..., RingBatch], tuple[Any, ...]]:
        return _arrived, (self.ring_id, self.slot, self.sizes, self.names, self.meta)

    def to_dict(self) -> dict[str, Any]:
        """The batch dict, its fields as uint8 arrays over the slot (see :meth:`arrays`).

        Returns:
            The batch as the worker built it.

        Raises:
            ConfigError: the ring is gone (its loader was collected).
        """
        arrays = self.arrays()
        return {k: arrays[k] if k in arrays else v for k, v in self.meta.items()}

    def arrays(self) -> dict[str, np.ndarray]:
        """The batch's fields as arrays over the slot; the slot is freed when all are gone.

        Returns:
            One uint8 array per field name.

        Raises:
            ConfigError: the ring is gone (its loader was collected).
        """
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
