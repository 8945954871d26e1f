"""Who reads what: the split of an epoch's sample order (:class:`~shardkit.read.epoch_order.EpochOrder`)
over ranks and workers, and the runs of shard samples each of them walks.

Everything here is a pure function of (shard sizes, epoch, seed, topology), so every rank and
DataLoader worker computes its own share without talking to the others, and a checkpoint only
needs the list of remaining ranges to resume exactly, even with a different world size.

Three coordinate systems appear here and in :mod:`shardkit.read.epoch_order`:

* **global sample index**: shard ``s``'s samples are ``first_sample[s] ..
  first_sample[s] + size[s] - 1`` (the manifest's global order);
* **G position**: the place of a sample in the epoch sequence ``G`` (a permutation of the
  global indices when shuffling, the identity otherwise). Remaining work, rank shares and
  worker shares are lists of half-open ``(start, stop)`` ranges of G positions;
* **virtual position**: the place in the concatenation of such a list of ranges.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from numpy.typing import NDArray

from shardkit.config import int_arg
from shardkit.errors import ConfigError
from shardkit.read.epoch_order import EpochOrder

__all__ = ["Range", "consumed_remaining", "rank_ranges", "samples_per_rank", "schedule_shards", "worker_ranges",
           "worker_schedule"]

Range = tuple[int, int]
IntArray = NDArray[np.int64]

# Work is processed in pieces of this many samples so that a 20 M-sample epoch never needs
# more than a few MB at once.
_PIECE = 65_536


def _as_ranges(ranges: Sequence[Range], name: str, ascending: bool) -> tuple[IntArray, IntArray]:
    """Validate ranges; return (starts, stops) with empty ranges dropped."""
    try:
        arr = np.asarray(ranges) if len(ranges) else np.zeros((0, 2), np.int64)
    except ValueError:  # ragged input
        arr = np.zeros(0)
    if arr.ndim != 2 or arr.shape[1] != 2 or (arr.size and arr.dtype.kind not in "iu"):
        raise ConfigError(f"{name} must be a list of (start, stop) integer pairs")
    starts, stops = arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64)
    if starts.size and (starts.min() < 0 or bool(np.any(stops < starts))):
        raise ConfigError(f"{name} must hold (start, stop) pairs with 0 <= start <= stop")
    keep = stops > starts
    starts, stops = starts[keep], stops[keep]
    # Remaining work must be "G minus what was consumed", in G order: ascending, disjoint.
    if ascending and bool(np.any(starts[1:] < stops[:-1])):
        raise ConfigError(f"{name} must be ascending and non-overlapping")
    return starts, stops


def _merge(starts: IntArray, stops: IntArray) -> list[Range]:
    """Join ranges where one starts exactly where the previous stopped; keep the order."""
    if starts.size == 0:
        return []
    cuts = np.flatnonzero(starts[1:] != stops[:-1]) + 1
    firsts = np.concatenate(([0], cuts))
    lasts = np.concatenate((cuts, [starts.size])) - 1
    return list(zip(starts[firsts].tolist(), stops[lasts].tolist()))


def _map_virtual(starts: IntArray, stops: IntArray, vlo: IntArray,
                 vhi: IntArray) -> tuple[IntArray, IntArray]:
    """Map ordered virtual intervals (each within [0, total), non-empty) to G ranges."""
    cum = np.concatenate(([0], np.cumsum(stops - starts)))
    first = np.searchsorted(cum, vlo, side="right") - 1
    last = np.searchsorted(cum, vhi, side="left")  # exclusive
    counts = last - first
    which = np.repeat(np.arange(vlo.size), counts)
    k = first[which] + (np.arange(which.size) - np.repeat(np.cumsum(counts) - counts, counts))
    lo = np.maximum(cum[k], vlo[which])
    hi = np.minimum(cum[k + 1], vhi[which])
    return starts[k] + (lo - cum[k]), starts[k] + (hi - cum[k])


def _per_rank(total: int, world_size: int, drop_last: bool) -> int:
    return total // world_size if drop_last else -(-total // world_size)


def samples_per_rank(remaining: Sequence[Range], world_size: int,
                     drop_last: bool = False) -> int:
    """Samples each rank gets from ``remaining``: ceil(R/W), or floor(R/W) with drop_last.

    Args:
        remaining: Ascending, disjoint ``(start, stop)`` G ranges still to read (R positions).
        world_size: Number of ranks (W).
        drop_last: Drop the tail instead of padding.

    Returns:
        The samples per rank.

    Raises:
        ConfigError: A bad argument.
    """
    world_size = int_arg("world_size", world_size, 1)
    starts, stops = _as_ranges(remaining, "remaining", ascending=True)
    return _per_rank(int((stops - starts).sum()), world_size, drop_last)


def rank_ranges(remaining: Sequence[Range], rank: int, world_size: int,
                drop_last: bool = False) -> list[Range]:
    """The G ranges of one rank's share of the remaining work, in order.

    The remaining ranges are read as one virtual sequence of length R; rank r takes its
    positions ``[r*n, (r+1)*n)``. Without ``drop_last`` the sequence repeats from its start
    to pad every rank to ``n = ceil(R/W)`` (padding shows as ranges that repeat earlier
    positions); with it, ``n = floor(R/W)`` and the last ``R % W`` positions go to nobody.

    Args:
        remaining: Ascending, disjoint ``(start, stop)`` G ranges still to read.
        rank: This rank, ``0 <= rank < world_size``.
        world_size: Number of ranks.
        drop_last: Drop the tail instead of padding.

    Returns:
        G ranges totalling exactly ``samples_per_rank(remaining, world_size, drop_last)``.

    Raises:
        ConfigError: A bad argument.
    """
    world_size = int_arg("world_size", world_size, 1)
    rank = int_arg("rank", rank, 0, world_size - 1)
    starts, stops = _as_ranges(remaining, "remaining", ascending=True)
    total = int((stops - starts).sum())
    n = _per_rank(total, world_size, drop_last)
    lo, hi = rank * n, (rank + 1) * n
    vlo: list[int] = []
    vhi: list[int] = []
    while lo < hi:  # split where the padding wraps around to the start
        base = lo - lo % total
        end = min(hi, base + total)
        vlo.append(lo - base)
        vhi.append(end - base)
        lo = end
    return _merge(*_map_virtual(starts, stops, np.array(vlo, np.int64),
                                np.array(vhi, np.int64)))


def worker_ranges(rank_ranges: Sequence[Range], worker: int, num_workers: int,
                  chunk: int = 1) -> list[Range]:
    """The G ranges one DataLoader worker reads, in the order it must yield them.

    The rank's positions are cut into chunks of ``chunk`` (the DataLoader batch size) and
    chunk c goes to worker ``c % num_workers``: the DataLoader takes batches from workers
    round-robin, so it yields exactly the rank's order.

    Args:
        rank_ranges: The rank's share, as returned by :func:`rank_ranges`.
        worker: This worker, ``0 <= worker < num_workers``.
        num_workers: Workers per rank (1 when the DataLoader has none).
        chunk: Positions per chunk.

    Returns:
        G ranges in yield order (one per chunk at most, fewer where chunks join up).

    Raises:
        ConfigError: A bad argument.
    """
    num_workers = int_arg("num_workers", num_workers, 1)
    worker = int_arg("worker", worker, 0, num_workers - 1)
    chunk = int_arg("chunk", chunk, 1)
    # Padding repeats make a rank's ranges non-ascending, so order is not checked here.
    starts, stops = _as_ranges(rank_ranges, "rank_ranges", ascending=False)
    n = int((stops - starts).sum())
    vlo = np.arange(worker * chunk, n, num_workers * chunk, dtype=np.int64)
    vhi = np.minimum(vlo + chunk, n)
    return _merge(*_map_virtual(starts, stops, vlo, vhi))


def consumed_remaining(remaining: Sequence[Range], world_size: int, drop_last: bool,
                       consumed_per_rank: int) -> list[Range]:
    """Remaining work after every rank consumed the first k samples of its share.

    The result is ``remaining`` minus the consumed positions, in G order. A padding repeat
    is never remaining work, and with ``drop_last`` the unassigned tail stays remaining, so
    any world size and worker count can finish the epoch with each unread sample once.
    Resuming with the same world size continues exactly where the ranks stopped.

    Args:
        remaining: The ascending, disjoint G ranges the ranks were split from.
        world_size: World size they were split with.
        drop_last: ``drop_last`` they were split with.
        consumed_per_rank: Samples each rank consumed (k; the same on every rank in DDP).

    Returns:
        Ascending, disjoint, merged G ranges.

    Raises:
        ConfigError: A bad argument, or k larger than a rank's share.
    """
    world_size = int_arg("world_size", world_size, 1)
    k = int_arg("consumed_per_rank", consumed_per_rank, 0)
    starts, stops = _as_ranges(remaining, "remaining", ascending=True)
    total = int((stops - starts).sum())
    n = _per_rank(total, world_size, drop_last)
    if k > n:
        raise ConfigError(f"consumed_per_rank={k} exceeds the {n} samples each of "
                          f"{world_size} ranks was given")
    # Consumed virtual intervals [r*n, r*n+k), cut at R because beyond it is padding; what
    # remains are the gaps between them (and the tail) in [0, R).
    # Only ranks whose share starts before R matter: at most R of them, however large the
    # world size (a state's world_size must not size an allocation).
    starting = min(world_size, -(-total // n)) if n else min(world_size, 1 if total else 0)
    rank_lo = np.arange(starting, dtype=np.int64) * n
    gap_lo = np.concatenate(([0], np.minimum(rank_lo + k, total)))
    gap_hi = np.concatenate((rank_lo, [total]))
    keep = gap_hi > gap_lo
    return _merge(*_map_virtual(starts, stops, gap_lo[keep], gap_hi[keep]))


def _position_pieces(ranges: Sequence[Range], order: EpochOrder,
                     piece: int) -> Iterator[IntArray]:
    """Yield the G positions of ``ranges`` in order, at most ``piece`` at a time."""
    piece = int_arg("piece", piece, 1)
    starts, stops = _as_ranges(ranges, "ranges", ascending=False)
    if stops.size and int(stops.max()) > len(order):
        raise ConfigError(f"ranges must lie in [0, {len(order)}]")
    total = int((stops - starts).sum())
    for lo in range(0, total, piece):
        gs, ge = _map_virtual(starts, stops, np.array([lo], np.int64),
                              np.array([min(lo + piece, total)], np.int64))
        lengths = ge - gs
        yield (np.arange(int(lengths.sum()), dtype=np.int64)
               + np.repeat(gs - (np.cumsum(lengths) - lengths), lengths))


def worker_schedule(order: EpochOrder, ranges: Sequence[Range], *, max_run: int = _PIECE,
                    piece: int = _PIECE) -> Iterator[tuple[int, IntArray]]:
    """Walk G ranges in order and yield runs ``(shard_id, positions_in_shard)``.

    Consecutive samples of one shard form one run, so the reader opens a shard once per run;
    a shard may appear in several runs. To bound memory, a run longer than ``max_run`` is
    yielded as several consecutive runs of ``max_run`` (the last one shorter).
    Concatenating the runs gives exactly the samples of ``ranges`` in order.

    Args:
        order: The epoch sequence.
        ranges: G ranges, e.g. from :func:`worker_ranges`.
        max_run: Longest run yielded.
        piece: Positions processed at once (memory bound; does not change the output).

    Yields:
        ``(shard_id, positions)`` with positions an int64 array of indices within the shard.

    Raises:
        ConfigError: A bad argument or a range beyond the epoch.
    """
    max_run = int_arg("max_run", max_run, 1)
    current = -1
    pending: list[IntArray] = []
    pending_len = 0
    for positions in _position_pieces(ranges, order, piece):
        shards, in_shard = order.shard_of(order.take(positions))
        cuts = np.flatnonzero(shards[1:] != shards[:-1]) + 1
        firsts = np.concatenate(([0], cuts))
        # Plain slicing over Python ints: runs average ~1 sample when a block mixes shards,
        # so per-run numpy overhead (np.split) would dominate.
        for shard, lo, hi in zip(shards[firsts].tolist(), firsts.tolist(),
                                 cuts.tolist() + [in_shard.size]):
            run = in_shard[lo:hi]
            if shard != current:
                if pending:
                    yield current, _join(pending)
                current, pending, pending_len = shard, [run], hi - lo
            else:  # the same run continues across a piece boundary
                pending.append(run)
                pending_len += hi - lo
            while pending_len >= max_run:
                joined = _join(pending)
                yield current, joined[:max_run]
                pending = [joined[max_run:]] if joined.size > max_run else []
                pending_len = joined.size - max_run
    if pending:
        yield current, _join(pending)


def _join(parts: list[IntArray]) -> IntArray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def schedule_shards(order: EpochOrder, ranges: Sequence[Range], *,
                    piece: int = _PIECE) -> list[int]:
    """Distinct shards of ``ranges`` in first-need order (the prefetch order).

    Args:
        order: The epoch sequence.
        ranges: G ranges, e.g. from :func:`worker_ranges`.
        piece: Positions processed at once (memory bound; does not change the output).

    Returns:
        Shard ids, each once.

    Raises:
        ConfigError: A bad argument or a range beyond the epoch.
    """
    seen = np.zeros(order.num_shards, dtype=bool)
    result: list[int] = []
    for positions in _position_pieces(ranges, order, piece):
        shards, _ = order.shard_of(order.take(positions))
        unique, first = np.unique(shards, return_index=True)
        new = ~seen[unique]
        fresh = unique[new][np.argsort(first[new], kind="stable")]
        seen[fresh] = True
        result.extend(fresh.tolist())
    return result
