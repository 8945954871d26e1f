"""Shared memory for the batches a DataLoader worker collates: the main process maps them
instead of unpickling a copy.

A DataLoader worker sends each batch to the main process by pickling it through a pipe: a
25 MB numpy array is copied into the pickle, through the pipe and out again, and on the way
lands twice in fresh memory whose pages the kernel zero-fills and faults in (on the machines
measured, slower than the copies themselves; see benchmarks/RESULTS.md). In a worker of a
shardkit stream, :func:`shardkit.batch.collate.collate` instead writes a batch's large arrays
into a slot of this process's :class:`WorkerSlots`: a ``memfd`` mapped once and reused. Each
such array pickles as a few numbers (the worker's pid, the slot's descriptor and inode, where
the array lies in it); the process that unpickles it maps the slot through ``/proc/<pid>/fd``
once and gets a numpy array over it. When the last array over a slot's batch is dropped
there, a finalizer marks the slot free in its first page, and the worker reuses pages that
are already mapped.

Nothing waits for a slot: a worker with none free (the training loop keeps its batches)
allocates ordinary arrays, which pickle as before. An array over a slot that is dropped in the
worker without being sent (a ``collate_fn`` that converts it further) frees its slot there.
Set ``SHARDKIT_WORKER_SLOTS=0`` to send every batch the ordinary way.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from shardkit.errors import ShardkitError

__all__ = ["MAX_BYTES", "MIN_BYTES", "SLOTS", "SLOTS_ENV", "SlotArray", "WorkerSlots", "activate", "current", "holds",
           "received"]

SLOTS_ENV = "SHARDKIT_WORKER_SLOTS"
#: Slots per worker: a DataLoader keeps ``prefetch_factor`` (2) batches per worker in flight,
#: the training loop holds one, and one is being pickled; a fifth goes the ordinary way.
SLOTS = 4
#: Batches whose large arrays total less are pickled as usual: a copy that small is cheap.
MIN_BYTES = 256 << 10
#: Nor are bigger ones (huge samples) parked in shared memory.
MAX_BYTES = 256 << 20
_FREE, _BUSY = 0, 1
_HEADER = mmap.PAGESIZE  # the slot's state byte, on a page of its own
_ALIGN = 64  # each array starts on a cache line
_SPARE = 1.25  # a new slot has room for a somewhat larger batch next time
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not named by Python's mmap module before 3.13
_MAPS_KEPT = 64  # slots of live workers the receiving process keeps mapped


def _up(n: int, align: int) -> int:
    return -(-n // align) * align


class _Ticket:
    """What names one batch in one slot: the slot (pid, fd, inode), the use (gen), its bytes."""

    __slots__ = ("pid", "fd", "ino", "gen", "nbytes", "sent", "__weakref__")

    def __init__(self, pid: int, fd: int, ino: int, gen: int, nbytes: int) -> None:
        self.pid, self.fd, self.ino, self.gen, self.nbytes = pid, fd, ino, gen, nbytes
        self.sent = False


class SlotArray(np.ndarray):  # type: ignore[type-arg]
    """A numpy array in a worker's slot; it pickles as where it lies, not as its bytes.

    Arrays derived from it (slices, results of arithmetic) are ordinary arrays as far as
    pickling goes: only the array :meth:`WorkerSlots.take` handed out travels by reference.
    """

    _ticket: _Ticket | None
    _offset: int

    def __array_finalize__(self, obj: Any) -> None:
        self._ticket = None
        self._offset = 0

    def __reduce_ex__(self, protocol: Any) -> Any:
        ticket = self._ticket
        if ticket is None or ticket.pid != os.getpid():  # a view of it, or a forked child's copy
            return np.asarray(self).__reduce_ex__(protocol)
        ticket.sent = True  # from now on the receiver frees the slot
        return _arrive, (ticket.pid, ticket.fd, ticket.ino, ticket.gen, ticket.nbytes, self._offset,
                         self.dtype.str, self.shape)

    def __copy__(self) -> SlotArray:
        # A copy is ordinary memory (its ticket None): the default would pickle and unpickle
        # it through __reduce_ex__, mapping the slot again and taking it over from the worker.
        return np.array(self).view(SlotArray)

    def __deepcopy__(self, memo: Any) -> SlotArray:
        return self.__copy__()


class _Slot:
    """One ``memfd``: a page with the state byte, then room for one batch's arrays."""

    def __init__(self, room: int) -> None:
        self.fd = os.memfd_create("shardkit-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, _HEADER + room)
            self.mm = mmap.mmap(self.fd, _HEADER + room)
            self.ino = os.fstat(self.fd).st_ino
        except BaseException:
            os.close(self.fd)
            raise
        self.room = room
        self.state = np.frombuffer(self.mm, np.uint8, count=1)
        self.gen = 0
        self.populated = 0  # bytes of the room this process has mapped in

    def populate(self, nbytes: int) -> None:
        # The first write of each page would fault; one MADV_POPULATE_WRITE call maps the range.
        if nbytes <= self.populated or not sys.platform.startswith("linux"):
            return
        try:
            self.mm.madvise(_MADV_POPULATE_WRITE, _HEADER + self.populated,
                            _up(nbytes, mmap.PAGESIZE) - self.populated)
        except OSError:  # kernels before 5.14: pages fault in as they are written
            pass
        self.populated = _up(nbytes, mmap.PAGESIZE)

    def close(self) -> None:
        self.state = np.zeros(1, np.uint8)
        try:
            self.mm.close()
        except BufferError:  # arrays over it still live in this process: the map goes with them
            pass
        os.close(self.fd)


class WorkerSlots:
    """The slots of one DataLoader worker process (made in it, used by its collate).

    Args:
        slots: batches that may be in flight in shared memory at once (default :data:`SLOTS`).
        largest: bigger batches go the ordinary way (default :data:`MAX_BYTES`).
        smallest: so do smaller ones (default :data:`MIN_BYTES`).
    """

    def __init__(self, slots: int | None = None, largest: int | None = None, smallest: int | None = None) -> None:
        self.pid = os.getpid()
        self.count = SLOTS if slots is None else slots
        self.largest = MAX_BYTES if largest is None else largest
        self.smallest = MIN_BYTES if smallest is None else smallest
        self._slots: list[_Slot] = []
        self.sent = 0  # batches handed out in slots (for tests and benchmarks)

    def take(self, specs: Sequence[tuple[tuple[int, ...], Any]]) -> list[np.ndarray] | None:
        """Arrays of these shapes and dtypes, laid out in one free slot.

        Args:
            specs: ``(shape, dtype)`` of each array.

        Returns:
            One :class:`SlotArray` per spec (contents undefined), or None when they are too
            small or too large for a slot, or no slot is free.
        """
        sizes = [math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in specs]
        starts, pos = [], 0
        for n in sizes:
            starts.append(pos)
            pos = _up(pos + n, _ALIGN)
        total = max(pos, 1)
        if sum(sizes) < self.smallest or total > self.largest or os.getpid() != self.pid:
            return None
        slot = self._free(total)
        if slot is None:
            return None
        slot.state[0] = _BUSY
        slot.gen += 1
        slot.populate(total)
        ticket = _Ticket(self.pid, slot.fd, slot.ino, slot.gen, total)
        base = np.frombuffer(slot.mm, np.uint8, count=total, offset=_HEADER)
        weakref.finalize(base, _unsent, ticket, slot.state)
        out: list[np.ndarray] = []
        for (shape, dtype), a, n in zip(specs, starts, sizes):
            arr = base[a:a + n].view(dtype).reshape(shape).view(SlotArray)
            arr._ticket, arr._offset = ticket, a
            out.append(arr)
        self.sent += 1
        return out

    def _free(self, total: int) -> _Slot | None:
        free = [s for s in self._slots if s.state[0] == _FREE]
        fits = [s for s in free if s.room >= total]
        if fits:
            return min(fits, key=lambda s: s.room)
        room = min(_up(int(total * _SPARE), mmap.PAGESIZE), _up(self.largest, mmap.PAGESIZE))
        if len(self._slots) >= self.count:
            if not free:
                return None
            old = max(free, key=lambda s: s.room)  # too small for this batch: made anew, larger
            self._slots.remove(old)
            old.close()
        try:
            slot = _Slot(room)
        except OSError:  # no memfd here, or no memory for it: the ordinary way
            return None
        self._slots.append(slot)
        return slot

    def busy(self) -> int:
        """Slots whose batch is in flight or held by the receiver.

        Returns:
            The count.
        """
        return sum(1 for s in self._slots if s.state[0] != _FREE)

    def close(self) -> None:
        """Close the slots (arrays still over them keep their maps)."""
        for s in self._slots:
            s.close()
        self._slots = []


def _unsent(ticket: _Ticket, state: np.ndarray) -> None:
    # The worker dropped the arrays without sending them: the slot is its own to reuse.
    if not ticket.sent:
        state[0] = _FREE


_ACTIVE: list[WorkerSlots] = []  # this process's slots, once a reader in a worker asked for them


def activate() -> WorkerSlots | None:
    """Give this process (a DataLoader worker) slots for the batches it collates.

    Returns:
        The process's slots (made on the first call), or None where they cannot work: not
        Linux, no ``memfd``, or ``SHARDKIT_WORKER_SLOTS=0``.
    """
    if os.environ.get(SLOTS_ENV, "").strip() == "0" or not hasattr(os, "memfd_create"):
        return None
    if not os.path.isdir("/proc/self/fd"):
        return None
    slots = current()
    if slots is None:
        slots = WorkerSlots()
        _ACTIVE[:] = [slots]
    return slots


def current() -> WorkerSlots | None:
    """The slots :func:`activate` gave this process, if it did.

    Returns:
        The slots, or None (never those of the process this one was forked from).
    """
    return _ACTIVE[0] if _ACTIVE and _ACTIVE[0].pid == os.getpid() else None


def holds(batch: dict[str, Any]) -> bool:
    """Whether some array of ``batch`` lies in this process's slots (and travels by reference).

    Args:
        batch: a batch dict.

    Returns:
        True when a value is a :class:`SlotArray` handed out here.
    """
    pid = os.getpid()
    return any(isinstance(v, SlotArray) and v._ticket is not None and v._ticket.pid == pid for v in batch.values())


# ---- the receiving side (the DataLoader's main process) -----------------------------------

_MAPS: dict[tuple[int, int, int], mmap.mmap] = {}  # (pid, fd, inode) -> the slot, mapped here
# (pid, fd, inode, gen) -> the bytes of one batch in a slot, shared by its arrays
_ARRIVED: weakref.WeakValueDictionary[tuple[int, int, int, int], np.ndarray] = weakref.WeakValueDictionary()


def _arrive(pid: int, fd: int, ino: int, gen: int, nbytes: int, offset: int, dtype: str,
            shape: tuple[int, ...]) -> np.ndarray:
    # Where an array pickled by SlotArray is unpickled: an array over the worker's slot, which
    # is freed when the last array over this batch is dropped here.
    key = (pid, fd, ino)
    base = _ARRIVED.get((*key, gen))
    if base is None:
        mm = _MAPS.get(key)
        if mm is None:
            mm = _map_slot(pid, fd, ino)
        base = np.frombuffer(mm, np.uint8, count=nbytes, offset=_HEADER)
        weakref.finalize(base, _release, np.frombuffer(mm, np.uint8, count=1))
        _ARRIVED[(*key, gen)] = base
    n = math.prod(shape) * np.dtype(dtype).itemsize
    return base[offset:offset + n].view(dtype).reshape(shape)


def _release(state: np.ndarray) -> None:
    state[0] = _FREE


def _map_slot(pid: int, fd: int, ino: int) -> mmap.mmap:
    path = f"/proc/{pid}/fd/{fd}"
    try:
        f = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise ShardkitError(f"a batch from DataLoader worker {pid} lies in its shared memory, which this process "
                            f"cannot open ({path}: {exc.strerror}); set {SLOTS_ENV}=0 to send batches by "
                            "pickling") from exc
    try:
        st = os.fstat(f)
        if st.st_ino != ino:
            raise ShardkitError(f"a batch from DataLoader worker {pid}: {path} is no longer its shared memory "
                                f"(the worker closed it); set {SLOTS_ENV}=0 to send batches by pickling")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # the pages exist: map them in one call
        mm = mmap.mmap(f, st.st_size, flags=flags)
    finally:
        os.close(f)
    _forget_gone()
    _MAPS[(pid, fd, ino)] = mm
    return mm


def _forget_gone() -> None:
    """Drop the maps of workers that have exited (arrays still over them keep them), and the
    oldest beyond :data:`_MAPS_KEPT`."""
    alive: dict[int, bool] = {}
    for key in list(_MAPS):
        pid = key[0]
        if pid not in alive:
            alive[pid] = _alive(pid)
        if not alive[pid]:
            del _MAPS[key]
    while len(_MAPS) >= _MAPS_KEPT:
        del _MAPS[next(iter(_MAPS))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) still answers: it has no open files.
    return os.path.isdir(f"/proc/{pid}/fd") and bool(os.listdir(f"/proc/{pid}/fd")) if sys.platform.startswith(
        "linux") else True


def received(batch: Any, pick: Callable[[Any], bool] | None = None) -> int:
    """How many arrays of ``batch`` (a dict or list, one level deep) lie in a worker's slot.

    Args:
        batch: a batch as the DataLoader's main process received it.
        pick: only count values for which this is true.

    Returns:
        The count (for tests and benchmarks: whether the shared handoff was used).
    """
    values = batch.values() if isinstance(batch, dict) else batch
    found = 0
    for v in values:
        if isinstance(v, np.ndarray) and (pick is None or pick(v)):
            owner: Any = v
            while isinstance(owner, np.ndarray) and owner.base is not None:
                owner = owner.base
            if isinstance(owner, memoryview):
                owner = owner.obj
            found += any(owner is m for m in _MAPS.values())
    return found
