"""Raw batches from cached shards: plan the offsets once, then copy each member once.

A batch of raw bytes is, per field, one uint8 array holding every sample's member back to
back plus an int64 ``offsets`` array (n+1 boundaries). :func:`plan_batch` works out where
every member sits (vectorised per shard); :func:`fill` copies them: from a cached file with
``os.preadv`` (:func:`read_members`: one call per run of nearby members, each member's bytes
routed straight to its field), from bytes in memory with slicing.

With a :class:`shardkit.batch.ring.BatchRing`, a DataLoader worker fills the batch straight into
shared memory the main process reads without a copy (see ring.py).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from shardkit.batch.collate import OFFSETS
from shardkit.util.libc import libc_function
from shardkit.errors import IntegrityError
from shardkit.read.shard_source import Held, ShardSource

Run = tuple[int, np.ndarray]
_GATHER_BELOW = 512  # mean member bytes under which a field is gathered, not copied member by member
# One preadv covers members whose gaps (tar headers, padding, members of samples not in the
# batch) are at most _GAP_MAX bytes; the gap bytes land in a scratch buffer. Shorter than a
# syscall's worth of copying (~1 us ~ 10 KB here) is not worth splitting a call for.
_GAP_MAX = 64 * 1024
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
_SCRATCH = memoryview(bytearray(_GAP_MAX))


@dataclass
class BatchPlan:
    """Where each member of a batch lives: enough to fill the batch in any process.

    ``members`` maps shard -> (indices into the batch, positions in the shard).
    ``starts``/``sizes`` are (n, fields) shard byte offsets and lengths of member bodies.
    """

    keys: list[str]
    index: np.ndarray
    names: tuple[str, ...]
    # (shard, batch indices, positions in the shard) per held unit: a shard, or without a
    # cache a segment of it (one shard's samples in a batch may lie in several segments).
    members: list[tuple[int, np.ndarray, np.ndarray]]
    starts: np.ndarray
    sizes: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)


def plan_batch(source: ShardSource, pieces: Sequence[Run], first_sample: np.ndarray) -> BatchPlan | None:
    """The plan of a batch made of ``pieces`` (runs of (shard, positions)), or None when its
    samples do not all have the same fields (then the caller collates per sample)."""
    found = {s: source.layout(s) for s, _ in pieces}
    layouts = {s: lay for s, lay in found.items() if lay is not None}
    names = next(iter(layouts.values())).names if layouts else None
    if names is None or len(layouts) < len(found) or any(lay.names != names for lay in layouts.values()):
        return None
    pos = np.concatenate([p for _, p in pieces]) if len(pieces) > 1 else pieces[0][1]
    shard_of = np.repeat(np.fromiter((s for s, _ in pieces), np.int64, len(pieces)),
                         np.fromiter((len(p) for _, p in pieces), np.int64, len(pieces)))
    n, nf = len(pos), len(names)
    sizes = np.empty((n, nf), np.int64)
    starts = np.empty((n, nf), np.int64)
    keys: list[str] = [""] * n
    members: list[tuple[int, np.ndarray, np.ndarray]] = []
    for s, lay in layouts.items():
        idx = np.flatnonzero(shard_of == s)
        mine = pos[idx]
        members += [(s, idx[g], mine[g]) for g in source.held_groups(s, mine)]
        sizes[idx] = lay.sizes[mine]
        starts[idx] = lay.offs[mine]
        for k, p in zip(idx.tolist(), mine.tolist()):
            keys[k] = lay.keys[p]
    offsets = np.zeros((nf, n + 1), np.int64)
    np.cumsum(sizes.T, axis=1, out=offsets[:, 1:])
    return BatchPlan(keys, pos + first_sample[shard_of], names, members, starts, sizes, offsets)


def field_bytes(plan: BatchPlan) -> list[int]:
    """Bytes of each field of the batch ``plan`` describes."""
    return [int(plan.offsets[j, -1]) for j in range(len(plan.names))]


@dataclass
class MemberCopy:
    """The members of one batch that one held shard provides: ``(k, fields)`` arrays of
    destinations in the batch's field arrays, shard offsets and sizes. ``held`` stays open
    (and pinned) while the copy may run; ``where`` names the shard in errors."""

    held: Held
    dsts: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    where: str


def prepare(source: ShardSource, plan: BatchPlan, window: Sequence[Run]) -> Iterator[MemberCopy]:
    """Open (pin) the shards ``plan`` needs, one at a time (their bytes come verified), and
    yield the copies to make. Touches the source, so it runs in the source's
    thread. Each held shard counts the copy as a user (the source keeps it open) until
    :func:`done`. Lazy on purpose: :func:`fill` copies from a shard before opening the next,
    so a reader with a one-shard pin budget never holds two."""
    infos = source.ds.shard_list
    dsts_all = plan.offsets[:, :-1].T  # (n, fields): where each member goes
    for s, idx, mine in plan.members:
        where = f"shard {s} ({infos[s].path})"
        held = source.get(s, mine, window)
        held.users += 1  # before the next get(), which may let go of the shards before it
        yield MemberCopy(held, dsts_all[idx], plan.starts[idx] - held.base, plan.sizes[idx], where)


def copy_into(copies: Sequence[MemberCopy], outs: Sequence[np.ndarray]) -> None:
    """Make the ``copies`` into ``outs`` (one uint8 array per field). Safe in another thread
    while the held shards stay open: a cached file is read with ``os.preadv``, which releases
    the GIL (see shardio.Held for why it is not mapped); a shard this process just fetched is
    copied from its landing buffer instead (see landing), which the open shard keeps pinned."""
    for c in copies:
        src = c.held.hot
        if src is None and c.held.fd >= 0:
            read_members(c.held.fd, outs, c.dsts, c.starts, c.sizes, c.where)
            continue
        src = c.held.array if src is None else src
        for j, out in enumerate(outs):
            copy_members(out, c.dsts[:, j], src, c.starts[:, j], c.sizes[:, j])


def done(source: ShardSource, copies: Sequence[MemberCopy]) -> None:
    """The copies have finished (or will never run): their shards may close."""
    for c in copies:
        c.held.users -= 1
    source.settle()


def assemble(plan: BatchPlan, outs: Sequence[np.ndarray]) -> dict[str, Any]:
    """The batch dict over the filled field arrays ``outs``."""
    batch: dict[str, Any] = {"__key__": plan.keys, "__index__": plan.index}
    for j, name in enumerate(plan.names):
        batch[name] = outs[j]
        batch[name + OFFSETS] = plan.offsets[j]
    return batch


def fill(source: ShardSource, plan: BatchPlan, window: Sequence[Run], outs: list[np.ndarray] | None = None) -> dict[str, Any]:
    """Copy every member of ``plan`` out of the shards ``source`` holds into one batch dict,
    into ``outs`` (one uint8 array per field, of :func:`field_bytes` sizes) when given."""
    if outs is None:
        outs = [np.empty(n, np.uint8) for n in field_bytes(plan)]
    for copy in prepare(source, plan, window):
        try:
            copy_into([copy], outs)
        finally:
            done(source, [copy])
    return assemble(plan, outs)


def view_batch(source: ShardSource, plan: BatchPlan, window: Sequence[Run],
               opened: Callable[[Held], None] | None = None) -> dict[str, Any]:
    """The batch ``plan`` describes with no copy of the large fields: per field, a list of
    read-only uint8 arrays over the mapped shard files (one per sample, in batch order).

    A field whose members average under ``_GATHER_BELOW`` bytes in this batch (labels, short
    text) comes packed instead (``<field>`` + ``<field>.offsets``, as in copied batches): one
    vectorised gather of a few bytes costs less than a view per sample, for this function and
    for the loop that reads them. :func:`shardkit.unpack` reads both forms.

    Each array keeps its shard's map alive, so it stays valid after the source lets go of the
    shard, even if the cache then evicts the file: Linux keeps an unlinked file's pages (and
    its disk space) until the last map of it goes.
    """
    n = len(plan)
    packed = {j: np.empty(size, np.uint8) for j, size in enumerate(field_bytes(plan)) if size < _GATHER_BELOW * n}
    fields: list[list[Any]] = [[None] * n for _ in plan.names]
    for s, idx, mine in plan.members:
        held = source.get(s, mine, window)
        arr, at = held.array, idx.tolist()
        if opened is not None:
            opened(held)
        for j, out in enumerate(fields):
            starts = plan.starts[idx, j] - held.base
            if j in packed:
                copy_members(packed[j], plan.offsets[j, idx], arr, starts, plan.sizes[idx, j])
                continue
            for k, a, ln in zip(at, starts.tolist(), plan.sizes[idx, j].tolist()):
                out[k] = arr[a:a + ln]
    batch: dict[str, Any] = {"__key__": plan.keys, "__index__": plan.index}
    for j, name in enumerate(plan.names):
        if j in packed:
            batch[name], batch[name + OFFSETS] = packed[j], plan.offsets[j]
        else:
            batch[name] = fields[j]
    return batch


def copy_members(out: np.ndarray, dst: np.ndarray, src: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> None:
    """``out[dst[k]:dst[k]+sizes[k]] = src[starts[k]:starts[k]+sizes[k]]`` for every k."""
    total = int(sizes.sum())
    if total <= _GATHER_BELOW * len(sizes):
        # Small members (labels, metadata): one vectorised gather instead of a Python loop.
        rel = np.arange(total) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        out[np.repeat(dst, sizes) + rel] = src[np.repeat(starts, sizes) + rel]
        return
    # Large members: memcpy each (memoryview slicing costs less per call than numpy's).
    mo, ms = memoryview(out.data), memoryview(src.data)  # type: ignore[arg-type]
    for d, a, ln in zip(dst.tolist(), starts.tolist(), sizes.tolist()):
        mo[d:d + ln] = ms[a:a + ln]


def read_members(fd: int, outs: Sequence[np.ndarray], dsts: np.ndarray, starts: np.ndarray, sizes: np.ndarray,
                 where: str) -> None:
    """``outs[j][dsts[k, j]:+sizes[k, j]] = file[starts[k, j]:+sizes[k, j]]`` for every member.

    Members are taken in file order; each ``os.preadv`` reads one stretch of the file whose
    members go straight to their place in ``outs`` and whose gaps go to a scratch buffer, so
    a batch of consecutive samples is a few calls and every byte is copied once, by the kernel.
    """
    order = np.argsort(starts, axis=None, kind="stable")
    nf = starts.shape[1]
    mvs = [memoryview(o.data) for o in outs]  # type: ignore[arg-type]
    iov: list[memoryview] = []
    call_at = pos = -1
    for a, n, j, d in zip(starts.reshape(-1)[order].tolist(), sizes.reshape(-1)[order].tolist(),
                          (order % nf).tolist(), dsts.reshape(-1)[order].tolist()):
        if n == 0:
            continue
        if pos >= 0 and (a < pos or a - pos > _GAP_MAX or len(iov) >= _IOV_MAX - 1):
            _preadv_all(fd, iov, call_at, pos - call_at, where)
            iov, pos = [], -1
        if pos < 0:
            call_at = pos = a
        elif a > pos:
            iov.append(_SCRATCH[:a - pos])
        iov.append(mvs[j][d:d + n])
        pos = a + n
    if iov:
        _preadv_all(fd, iov, call_at, pos - call_at, where)


def _preadv_all(fd: int, iov: list[memoryview], offset: int, want: int, where: str) -> None:
    # A regular file gives short reads only at its end (a cached file changed under us) or
    # past Linux's 2 GiB per call: carry on from where the kernel stopped.
    while True:
        got = os.preadv(fd, iov, offset)
        want -= got
        if want == 0:
            return
        if got == 0:
            raise IntegrityError(f"{where}: cached file ends early ({want} bytes missing at offset {offset})")
        offset += got
        while got >= len(iov[0]):
            got -= len(iov[0])
            iov = iov[1:]
        iov[0] = iov[0][got:]


class MapWarmer:
    """Maps in the pages of each shard zero-copy batches read from, on another thread.

    Touching a fresh map of a file takes a page fault per few pages (~0.4 us per 4 KiB page
    on this VM for pages written through a map, about what copying them costs). One
    ``MADV_POPULATE_READ`` call per shard, made by a thread (ctypes releases the GIL), takes
    those faults on another core while the training loop reads the batches before it.
    Linux 5.14+; elsewhere a no-op.
    """

    _ADVICE = 22  # MADV_POPULATE_READ

    # Maps already populated, across streams: a kept map (keptmaps) stays populated from one
    # epoch to the next; weak, so a map that goes is forgotten with it.
    _done: weakref.WeakSet[object] = weakref.WeakSet()

    def __init__(self) -> None:
        self._madvise = _libc_madvise()
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, held: Held) -> None:
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
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _libc_madvise() -> Any:
    return libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
