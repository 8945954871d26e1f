"""Raw batches from cached shards: plan the offsets once, then copy each member once.

A batch of raw bytes is, per field, one uint8 array holding every sample's member back to
back plus an int64 ``offsets`` array (n+1 boundaries). :func:`plan_batch` works out where
every member sits (vectorised per shard); :func:`fill` copies them: from a cached file with
``os.preadv`` (:func:`shardkit.batch.copying.read_members`: one call per run of nearby members,
each member's bytes routed straight to its field), from bytes in memory with slicing.

With a :class:`shardkit.batch.ring.BatchRing`, a DataLoader worker fills the batch straight into
shared memory the main process reads without a copy (see ring.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from shardkit.batch.collate import OFFSETS
from shardkit.batch.copying import GATHER_BELOW, copy_members, read_members
from shardkit.read.held import Held
from shardkit.read.shard_source import Run, ShardSource

__all__ = ["BatchPlan", "MemberCopy", "assemble", "copy_into", "done", "field_bytes", "fill", "plan_batch",
           "prepare", "view_batch"]


@dataclass
class BatchPlan:
    """Where each member of a batch lives: enough to fill the batch in any process.

    ``members`` lists (shard, indices into the batch, positions in the shard);
    ``starts``/``sizes`` are (n, fields) shard byte offsets and lengths of member bodies;
    ``offsets`` (fields, n + 1) each field's member boundaries in the batch.
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
        """Samples in the batch."""
        return len(self.keys)


def plan_batch(source: ShardSource, pieces: Sequence[Run], first_sample: np.ndarray) -> BatchPlan | None:
    """Where every member of the batch made of ``pieces`` lies.

    Args:
        source: the reader's shard source (it knows each shard's field layout).
        pieces: the batch's runs of ``(shard, positions)``, in batch order.
        first_sample: the global index of each shard's first sample.

    Returns:
        The plan, or None when the samples do not all have the same fields (the caller then
        collates per sample).
    """
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
    """Bytes of each field of the batch ``plan`` describes.

    Args:
        plan: a batch plan.

    Returns:
        One size per field, in ``plan.names`` order.
    """
    return [int(plan.offsets[j, -1]) for j in range(len(plan.names))]


@dataclass
class MemberCopy:
    """The members of one batch that one held shard provides.

    ``dsts``, ``starts`` and ``sizes`` are ``(k, fields)`` arrays of destinations in the
    batch's field arrays, offsets in the held bytes and sizes. ``held`` stays open (and
    pinned) while the copy may run; ``where`` names the shard in errors.
    """

    held: Held
    dsts: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    where: str


def prepare(source: ShardSource, plan: BatchPlan, window: Sequence[Run]) -> Iterator[MemberCopy]:
    """Open (pin) the shards ``plan`` needs, one at a time (their bytes come verified), and
    yield the copies to make.

    Touches the source, so it runs in the source's thread. Each held shard counts the copy as
    a user (the source keeps it open) until :func:`done`. Lazy on purpose: :func:`fill` copies
    from a shard before opening the next, so a reader with a one-shard pin budget never holds two.

    Args:
        source: the reader's shard source.
        plan: the batch plan.
        window: the runs still to come (the source keeps those shards open).

    Yields:
        One copy per held shard (or, without a cache, segment) of the batch.
    """
    infos = source.ds.shard_list
    dsts_all = plan.offsets[:, :-1].T  # (n, fields): where each member goes
    for s, idx, mine in plan.members:
        where = f"shard {s} ({infos[s].path})"
        held = source.get(s, mine, window)
        held.users += 1  # before the next get(), which may let go of the shards before it
        yield MemberCopy(held, dsts_all[idx], plan.starts[idx] - held.base, plan.sizes[idx], where)


def copy_into(copies: Sequence[MemberCopy], outs: Sequence[np.ndarray]) -> None:
    """Make the ``copies`` into ``outs``.

    Safe in another thread while the held shards stay open: a cached file is read with
    ``os.preadv``, which releases the GIL (see :class:`shardkit.read.shard_source.Held` for why
    it is not mapped); a shard this process just fetched is copied from its landing buffer
    instead (see :mod:`shardkit.cache.landing`), which the open shard keeps pinned.

    Args:
        copies: from :func:`prepare`.
        outs: one uint8 array per field, of :func:`field_bytes` sizes.

    Raises:
        IntegrityError: a cached file ends before a member does.
    """
    for c in copies:
        src = c.held.hot
        if src is None and c.held.fd >= 0:
            read_members(c.held.fd, outs, c.dsts, c.starts, c.sizes, c.where)
            continue
        src = c.held.array if src is None else src
        for j, out in enumerate(outs):
            copy_members(out, c.dsts[:, j], src, c.starts[:, j], c.sizes[:, j])


def done(source: ShardSource, copies: Sequence[MemberCopy]) -> None:
    """The copies have finished (or will never run): their shards may close.

    Args:
        source: the reader's shard source.
        copies: copies :func:`prepare` yielded.
    """
    for c in copies:
        c.held.users -= 1
    source.settle()


def assemble(plan: BatchPlan, outs: Sequence[np.ndarray]) -> dict[str, Any]:
    """The batch dict over the filled field arrays ``outs``.

    Args:
        plan: the batch plan.
        outs: one filled uint8 array per field.

    Returns:
        ``__key__``, ``__index__``, and per field ``<field>`` and ``<field>.offsets``.
    """
    batch: dict[str, Any] = {"__key__": plan.keys, "__index__": plan.index}
    for j, name in enumerate(plan.names):
        batch[name] = outs[j]
        batch[name + OFFSETS] = plan.offsets[j]
    return batch


def fill(source: ShardSource, plan: BatchPlan, window: Sequence[Run], outs: list[np.ndarray] | None = None) -> dict[str, Any]:
    """Copy every member of ``plan`` out of the shards ``source`` holds into one batch dict.

    Args:
        source: the reader's shard source.
        plan: the batch plan.
        window: the runs still to come (the source keeps those shards open).
        outs: one uint8 array per field, of :func:`field_bytes` sizes, to fill (default: new ones).

    Returns:
        The batch dict (see :func:`assemble`).

    Raises:
        IntegrityError: a shard fails its checksum, or a cached file ends before a member does.
    """
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

    A field whose members average under ``GATHER_BELOW`` bytes in this batch (labels, short
    text) comes packed instead (``<field>`` + ``<field>.offsets``, as in copied batches): one
    vectorised gather of a few bytes costs less than a view per sample, for this function and
    for the loop that reads them. :func:`shardkit.unpack` reads both forms.

    Each array keeps its shard's map alive, so it stays valid after the source lets go of the
    shard, even if the cache then evicts the file: Linux keeps an unlinked file's pages (and
    its disk space) until the last map of it goes.

    Args:
        source: the reader's shard source (with a cache: the shards are mapped files).
        plan: the batch plan.
        window: the runs still to come (the source keeps those shards open).
        opened: called with each shard as it is opened (a :class:`~shardkit.batch.map_warmer.MapWarmer`).

    Returns:
        The batch dict: ``__key__``, ``__index__`` and per field a list of arrays, or packed.
    """
    n = len(plan)
    packed = {j: np.empty(size, np.uint8) for j, size in enumerate(field_bytes(plan)) if size < GATHER_BELOW * n}
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


