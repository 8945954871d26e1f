"""Raw batches from cached shards: plan the offsets once, then copy each member once.

A batch of raw bytes is, per field, one uint8 array holding every sample's member back to
back plus an int64 ``offsets`` array (n+1 boundaries). :func:`plan_batch` works out where
every member sits (vectorised per shard); :func:`fill` copies them.

With a :class:`shardkit.ring.BatchRing`, a DataLoader worker fills the batch straight into
shared memory the main process reads without a copy (see ring.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .batching import OFFSETS
from .reader import verify_sample

Run = tuple[int, np.ndarray]
_GATHER_BELOW = 512  # mean member bytes under which a field is gathered, not copied member by member


@dataclass
class BatchPlan:
    """Where each member of a batch lives: enough to fill the batch in any process.

    ``members`` maps shard -> (indices into the batch, positions in the shard).
    ``starts``/``sizes`` are (n, fields) shard byte offsets and lengths of member bodies.
    """

    keys: list[str]
    index: np.ndarray
    names: tuple[str, ...]
    members: dict[int, tuple[np.ndarray, np.ndarray]]
    starts: np.ndarray
    sizes: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)


def plan_batch(source: Any, pieces: Sequence[Run], first_sample: np.ndarray) -> BatchPlan | None:
    """The plan of a batch made of ``pieces`` (runs of (shard, positions)), or None when its
    samples do not all have the same fields (then the caller collates per sample)."""
    layouts = {s: source.layout(s) for s, _ in pieces}
    first = next(iter(layouts.values()))
    names = first.names if first is not None else None
    if names is None or any(lay is None or lay.names != names for lay in layouts.values()):
        return None
    pos = np.concatenate([p for _, p in pieces]) if len(pieces) > 1 else pieces[0][1]
    shard_of = np.repeat(np.fromiter((s for s, _ in pieces), np.int64, len(pieces)),
                         np.fromiter((len(p) for _, p in pieces), np.int64, len(pieces)))
    n, nf = len(pos), len(names)
    sizes = np.empty((n, nf), np.int64)
    starts = np.empty((n, nf), np.int64)
    keys: list[str] = [""] * n
    members: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for s, lay in layouts.items():
        idx = np.flatnonzero(shard_of == s)
        mine = pos[idx]
        members[s] = (idx, mine)
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


def fill(source: Any, plan: BatchPlan, window: Sequence[Run], verify: bool,
         outs: list[np.ndarray] | None = None) -> dict[str, Any]:
    """Copy every member of ``plan`` out of the shards ``source`` holds into one batch dict,
    into ``outs`` (one uint8 array per field, of :func:`field_bytes` sizes) when given."""
    if outs is None:
        outs = [np.empty(n, np.uint8) for n in field_bytes(plan)]
    infos = source.ds.shard_list
    for s, (idx, mine) in plan.members.items():
        held = source.get(s, mine, window)
        if held.verify and verify:
            rows = source.rows(s)
            for k in mine.tolist():
                verify_sample(held.view, held.base, rows, k, f"shard {s} ({infos[s].path})")
        for j, out in enumerate(outs):
            copy_members(out, plan.offsets[j][idx], held.array, plan.starts[idx, j] - held.base, plan.sizes[idx, j])
    batch: dict[str, Any] = {"__key__": plan.keys, "__index__": plan.index}
    for j, name in enumerate(plan.names):
        batch[name] = outs[j]
        batch[name + OFFSETS] = plan.offsets[j]
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
