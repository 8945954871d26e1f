"""StreamingDataset: the torch-facing reader for DDP training.

Each rank and DataLoader worker computes its own exact share from the pure partition in
:mod:`shardkit.partition`, reads it through the node cache (or straight from storage), and
yields WebDataset-style sample dicts (or, with ``batch_size``, whole batches built inside
the worker). Epoch and resume state live in a small control file next to the statistics, so
persistent DataLoader workers see ``set_epoch`` and ``load_state_dict`` made in the main
process.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import weakref
from collections import deque
from typing import Any, Callable, Iterator

from .cache import ShardCache
from .codecs import make_decoder
from .config import parse_size
from .errors import ConfigError
from .partition import (DEFAULT_BLOCK_SHARDS, EpochOrder, Range, consumed_remaining, rank_ranges,
                        samples_per_rank, schedule_shards, worker_ranges, worker_schedule)
from .reader import Dataset, sample_dict
from .shardio import ShardSource, cache_namespace
from .topology import current

try:  # torch is optional: without it the dataset is a plain iterable
    from torch.utils.data import IterableDataset as _IterableBase
except ImportError:  # pragma: no cover - exercised only without torch
    _IterableBase = object  # type: ignore[misc,assignment]

STATE_VERSION = 1
_LOOKAHEAD = 4


def _remove_dir(path: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


class StreamingDataset(_IterableBase):  # type: ignore[misc,valid-type]
    """Stream a dataset into training with exact per-rank shares.

    Args:
        url: dataset root (``s3://bucket/ds``, a local path, ...).
        cache_dir: node-local cache directory shared by all ranks/workers of the node;
            ``None`` streams shards without caching (ranged reads, read-ahead).
        cache_limit: bound on the cache size (``"200GB"``), held at all times.
        shuffle: shuffle shard order and samples within blocks of ``shuffle_block`` shards,
            differently each epoch, reproducibly from ``seed``.
        decode: ``None`` (raw bytes), ``"pil"``, ``"numpy"`` or a callable on the raw sample.
        batch_size: yield whole batches built in the worker (use ``DataLoader(batch_size=None)``).
        drop_last: drop the tail so every rank gets floor(N/W) samples; otherwise ranks are
            padded to ceil(N/W) by repeating samples from the start of the epoch.
        loader_batch_size: the DataLoader's batch size when it batches (not ``batch_size``):
            workers then take turns in whole batches, so resume is exact.
        prefetch: shards (or spans) fetched ahead of need per worker.
    """

    def __init__(self, url: str, cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | str = "200GB",
                 shuffle: bool = False, seed: int = 0, decode: str | Callable[[dict[str, Any]], Any] | None = None,
                 batch_size: int | None = None, drop_last: bool = False,
                 storage_options: dict[str, Any] | None = None, *, shuffle_block: int = DEFAULT_BLOCK_SHARDS,
                 loader_batch_size: int | None = None, prefetch: int = 2, verify: bool = True,
                 rank: int | None = None, world_size: int | None = None) -> None:
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch_size: must be >= 1, got {batch_size}")
        if loader_batch_size is not None and loader_batch_size < 1:
            raise ConfigError(f"loader_batch_size: must be >= 1, got {loader_batch_size}")
        self.ds = Dataset(url, storage_options)
        self.url = self.ds.url
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
        self.cache_limit = parse_size(cache_limit, "cache_limit")
        self.shuffle, self.seed, self.shuffle_block = bool(shuffle), int(seed), int(shuffle_block)
        self.decode = decode
        self.batch_size, self.drop_last = batch_size, bool(drop_last)
        self.chunk = batch_size or loader_batch_size or 1
        self.prefetch, self.verify = prefetch, verify
        self.rank, self.world_size = rank, world_size
        make_decoder(decode)  # validate now, in the main process
        self._control = tempfile.mkdtemp(prefix="shardkit-stream-")
        weakref.finalize(self, _remove_dir, self._control, os.getpid())
        self.epoch = 0
        self._remaining: list[Range] | None = None  # None: the whole epoch
        self._yielded = 0
        self._write_control()

    # ---- epoch and resume state -----------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (keeps a resumed position if it is the resumed epoch)."""
        if epoch != self.epoch:
            self._remaining = None
        self.epoch = int(epoch)
        self._yielded = 0
        self._write_control()

    def _remaining_now(self) -> list[Range]:
        return self._remaining if self._remaining is not None else [(0, self.ds.num_samples)]

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Resumable position. ``consumed``: samples this rank has consumed this epoch.

        Without it, the count of samples this object yielded in this process is used, which
        is right when iterating without DataLoader workers; with workers, pass the count
        (steps x batch size) or use :class:`shardkit.StreamingDataLoader`, which tracks it.
        """
        topo = current(self.rank, self.world_size)
        return {
            "version": STATE_VERSION, "dataset": self.url, "created": self.ds.info.get("created"),
            "num_samples": self.ds.num_samples, "epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle,
            "shuffle_block": self.shuffle_block, "drop_last": self.drop_last, "world_size": topo.world_size,
            "remaining": [list(r) for r in self._remaining_now()],
            "consumed_per_rank": int(self._yielded if consumed is None else consumed),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a stopped epoch, possibly with another world size or worker count."""
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"state_dict: unsupported version {state.get('version')!r}")
        for name in ("num_samples", "seed", "shuffle", "shuffle_block"):
            mine = self.ds.num_samples if name == "num_samples" else getattr(self, name)
            if state[name] != mine:
                raise ConfigError(f"state_dict: {name}={state[name]!r} does not match this dataset/stream ({mine!r})")
        remaining = [(int(a), int(b)) for a, b in state["remaining"]]
        self.epoch = int(state["epoch"])
        self._remaining = consumed_remaining(remaining, int(state["world_size"]), bool(state["drop_last"]),
                                             int(state["consumed_per_rank"]))
        self._yielded = 0
        self._write_control()

    def _write_control(self) -> None:
        state = {"epoch": self.epoch, "remaining": self._remaining}
        tmp = os.path.join(self._control, f"control.json.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, os.path.join(self._control, "control.json"))

    def _read_control(self) -> tuple[int, list[Range]]:
        # Persistent workers hold an old copy of this object: the control file is the truth.
        try:
            with open(os.path.join(self._control, "control.json")) as f:
                state = json.load(f)
        except FileNotFoundError:
            return self.epoch, self._remaining_now()
        remaining = state["remaining"]
        return int(state["epoch"]), ([(int(a), int(b)) for a, b in remaining] if remaining is not None
                                     else [(0, self.ds.num_samples)])

    # ---- sizes ----------------------------------------------------------------------------

    def samples_per_rank(self) -> int:
        topo = current(self.rank, self.world_size)
        return samples_per_rank(self._remaining_now(), topo.world_size, self.drop_last)

    def __len__(self) -> int:
        """Samples (or batches, with ``batch_size``) this rank yields this epoch."""
        n = self.samples_per_rank()
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    # ---- iteration ------------------------------------------------------------------------

    def _open_source(self) -> ShardSource:
        cache = None
        if self.cache_dir is not None:
            cache = ShardCache(self.cache_dir, self.cache_limit, namespace=cache_namespace(self.ds), verify=self.verify)
        return ShardSource(self.ds, cache, self.prefetch)

    def __iter__(self) -> Iterator[Any]:
        topo = current(self.rank, self.world_size)
        epoch, remaining = self._read_control()
        order = EpochOrder(self.ds.shard_sizes(), epoch=epoch, seed=self.seed, shuffle=self.shuffle,
                           block_shards=self.shuffle_block)
        mine = rank_ranges(remaining, topo.rank, topo.world_size, self.drop_last)
        ranges = worker_ranges(mine, topo.worker, topo.num_workers, self.chunk)
        in_main = topo.num_workers == 1 and _in_main_process()
        if in_main:
            self._yielded = 0
        source = self._open_source()
        try:
            source.plan(schedule_shards(order, ranges))
            samples = self._samples(source, order, ranges)
            if self.batch_size is None:
                for s in samples:
                    if in_main:
                        self._yielded += 1
                    yield s
            else:
                yield from self._batches(samples, in_main)
        finally:
            self._save_stats(source, topo.worker)
            source.close()

    def _samples(self, source: ShardSource, order: EpochOrder, ranges: list[Range]) -> Iterator[dict[str, Any]]:
        decoder = make_decoder(self.decode if self.batch_size is None else (self.decode or "raw"))
        runs = worker_schedule(order, ranges)
        window: deque[tuple[int, Any]] = deque()
        first_sample = self.ds.shards.column("first_sample").to_numpy()
        infos = self.ds.shard_list
        done_shards = 0
        while True:
            while len(window) < _LOOKAHEAD:
                nxt = next(runs, None)
                if nxt is None:
                    break
                window.append(nxt)
            if not window:
                return
            shard, positions = window.popleft()
            rows = source.rows(shard)
            with source.open_run(shard, positions, list(window)) as (view, base, check):
                for p in positions.tolist():
                    sample = sample_dict(view, base, rows, p, int(first_sample[shard]) + p, infos[shard].path,
                                         verify=check and self.verify)
                    source.counters.samples += 1
                    yield decoder(sample)
            done_shards += 1
            source.advance([s for s, _ in window])

    def _batches(self, samples: Iterator[dict[str, Any]], in_main: bool) -> Iterator[dict[str, Any]]:
        from .batching import collate

        size = self.batch_size or 1
        pending: list[dict[str, Any]] = []
        for s in samples:
            pending.append(s)
            if len(pending) == size:
                if in_main:
                    self._yielded += size
                yield _to_torch(collate(pending))
                pending = []
        if pending and not self.drop_last:
            if in_main:
                self._yielded += len(pending)
            yield _to_torch(collate(pending))

    # ---- statistics -----------------------------------------------------------------------

    def _save_stats(self, source: ShardSource, worker: int) -> None:
        path = os.path.join(self._control, f"stats-{os.getpid()}-{worker}.json")
        try:
            with open(path, "w") as f:
                json.dump(source.stats(), f)
        except OSError:
            pass  # statistics are best effort; never fail a training step over them

    def stats(self) -> dict[str, Any]:
        """Counters summed over this rank's processes: bytes fetched, cache hits/misses,
        evictions, samples, and seconds spent waiting for data (also per worker)."""
        total: dict[str, Any] = {}
        per_worker: dict[str, float] = {}
        for path in sorted(glob.glob(os.path.join(self._control, "stats-*.json"))):
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                continue
            for k, v in data.items():
                total[k] = total.get(k, 0) + v
            per_worker[os.path.basename(path)[6:-5]] = data.get("wait_seconds", 0.0)
        total["wait_seconds_per_worker"] = per_worker
        return total


def _in_main_process() -> bool:
    try:
        from torch.utils.data import get_worker_info
    except ImportError:
        return True
    return get_worker_info() is None


def _to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    try:
        import numpy as np
        import torch
    except ImportError:
        return batch
    return {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in batch.items()}
