"""StreamingDataset: the torch-facing reader for DDP training.

Each rank and DataLoader worker computes its own exact share from the pure partition in
:mod:`shardkit.read.partition`, reads it through the node cache (or straight from storage), and
yields WebDataset-style sample dicts (or, with ``batch_size``, whole batches built inside
the worker). Epoch and resume state live in a small control file next to the statistics, so
persistent DataLoader workers see ``set_epoch`` and ``load_state_dict`` made in the main
process.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from shardkit.batch.collate import collate
from shardkit.cache.shard_cache import ShardCache
from shardkit.cache.files import write_replace
from shardkit.read.decode import make_decoder
from shardkit.config import checked_cache_dir, human_bytes, int_arg, keep_maps_budget, parse_size, room_wait
from shardkit.datasets.epoch_control import ControlDir
from shardkit.errors import ConfigError
from shardkit.read.epoch_order import DEFAULT_BLOCK_SHARDS, EpochOrder
from shardkit.read.partition import (Range, consumed_remaining, rank_ranges, samples_per_rank, schedule_shards,
                                     worker_ranges, worker_schedule)
from shardkit.read.dataset import Dataset
from shardkit.read.manifest_copies import manifest_copies_dir
from shardkit.read.samples import sample_dicts, sample_from
from shardkit.batch.buffers import BufferPool
from shardkit.batch.raw import (BatchPlan, MapWarmer, MemberCopy, assemble, copy_into, done, field_bytes, fill, plan_batch,
                       prepare, view_batch)
from shardkit.batch.ring import BatchRing, RingBatch
from shardkit.read.segments import SHARE_EDGE, SPREAD_OVER_WORKERS, SegmentPlanner
from shardkit.read.shard_source import Run, ShardSource, cache_namespace
from shardkit.read.topology import FromParent, Topology, current

log = logging.getLogger(__name__)

try:  # torch is optional: without it the dataset is a plain iterable
    from torch.utils.data import IterableDataset as _IterableBase
except ImportError:  # pragma: no cover - exercised only without torch
    _IterableBase = object  # type: ignore[misc,assignment]

STATE_VERSION = 1
# What load_state_dict needs; "dataset", "created" and "fingerprint" name the data (optional:
# states before the fingerprint lack it).
_STATE_KEYS = ("num_samples", "epoch", "seed", "shuffle", "shuffle_block", "drop_last", "world_size",
               "remaining", "consumed_per_rank")
_LOOKAHEAD = 256  # runs looked ahead: which shards to keep open, what to read ahead
_STATS_EVERY = 1.0  # seconds between statistics snapshots while iterating
# Buffers of threaded raw batches, shared by every stream in this process: a buffer is reused
# once the training loop drops the last batch over it, so its pages are already mapped (a
# fresh one costs a zero-filled page fault per 4 KiB, half the speed of the copy itself).
_BATCH_BUFFERS = BufferPool(keep=8, largest=256 << 20)


class StreamingDataset(_IterableBase):  # type: ignore[misc,valid-type]
    """Stream a dataset into training with exact per-rank shares.

    Args:
        url: dataset root (``s3://bucket/ds``, a local path, ...).
        cache_dir: node-local cache directory shared by all ranks/workers of the node;
            ``None`` streams without caching: each reader fetches only segments (~64 MiB) of
            the byte ranges its own samples occupy, reads them ahead, and holds the segments
            in use (with ``shuffle``, those of a shuffle block's shards). Shuffled small
            samples split over DataLoader workers are the exception: each worker fetches
            most of every shard (a warning says so), as does any reader for the shuffle block
            where its share starts or ends; a cache fetches each shard once per node.
        cache_limit: bound on the cache size (``"200GB"``), held at all times.
        shuffle: shuffle shard order and samples within blocks of ``shuffle_block`` shards,
            differently each epoch, reproducibly from ``seed``.
        decode: ``None`` (raw bytes), ``"pil"``, ``"numpy"`` or a callable on the raw sample.
        batch_size: yield whole batches built in the worker (use ``DataLoader(batch_size=None)``).
        drop_last: drop the tail so every rank gets floor(N/W) samples; otherwise ranks are
            padded to ceil(N/W) by repeating samples from the start of the epoch.
        loader_batch_size: the DataLoader's batch size when it batches (not ``batch_size``):
            workers then take turns in whole batches, so resume is exact.
        prefetch: shards (without a cache: ~64 MiB segments) fetched ahead of need per worker, at once;
            default 4 when the stream is read in one process (``num_workers=0``), else 2.
        read_threads: threads that fill raw batches from the node cache ahead of the training
            loop when the stream is read in the process that owns it (DataLoader
            ``num_workers=0``, or plain iteration); ``0`` fills each batch when it is asked
            for. The copies are ``os.preadv`` calls that release the GIL, so no worker
            processes (and no pickling between them) are needed for raw bytes. Not used in
            DataLoader workers, for decoded batches, without a cache, or when the cache is
            too small to pin the batches in flight.
        zero_copy: raw batches without any copy: each field is a list of read-only uint8
            arrays over the mapped cached shard files, one per sample (``None`` where a
            sample lacks the field); in a batch whose samples have the same fields, a field
            whose members average under 512 bytes (labels, short text) comes packed instead,
            as in copied batches (``shardkit.unpack`` reads both). Needs ``batch_size``, ``cache_dir``, ``decode=None`` and
            iteration in the main process (``num_workers=0``): a map cannot cross processes.
            For GPU decoders and readers of raw arrays that take one buffer per sample. The
            arrays keep their shard's map (and, once evicted, its disk space) alive while
            the training loop holds them. When the whole dataset fits in ``cache_limit``,
            the process also keeps each shard's map from one epoch to the next (up to
            ``SHARDKIT_KEEP_MAPS`` bytes, default 16 GiB; ``0``: off), so later epochs take
            no page faults. A kept map of a file the cache evicts is dropped at once (an
            eviction by this process) or at this process's next shard open (by another).
    """

    def __init__(self, url: str, cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | str = "200GB",
                 shuffle: bool = False, seed: int = 0, decode: str | Callable[[dict[str, Any]], Any] | None = None,
                 batch_size: int | None = None, drop_last: bool = False,
                 storage_options: dict[str, Any] | None = None, *, shuffle_block: int = DEFAULT_BLOCK_SHARDS,
                 loader_batch_size: int | None = None, prefetch: int | None = None, verify: bool = True,
                 read_threads: int = 2, zero_copy: bool = False, rank: int | None = None,
                 world_size: int | None = None) -> None:
        # Numbers checked before any I/O, each with its own name (a str from an argument
        # parser would otherwise fail as a bare TypeError, a float in an internal name later).
        batch_size = None if batch_size is None else int_arg("batch_size", batch_size, 1)
        loader_batch_size = None if loader_batch_size is None else int_arg("loader_batch_size", loader_batch_size, 1)
        prefetch = None if prefetch is None else int_arg("prefetch", prefetch, 0)
        read_threads = int_arg("read_threads", read_threads, 0)
        seed, shuffle_block = int_arg("seed", seed, 0, 2**64 - 1), int_arg("shuffle_block", shuffle_block, 1)
        world_size = None if world_size is None else int_arg("world_size", world_size, 1)
        rank = None if rank is None else int_arg("rank", rank, 0)
        self.ds = Dataset(url, storage_options)
        self.url = self.ds.url
        self.cache_dir = checked_cache_dir(cache_dir)
        # Node-local manifest copies (the temp dir, outside the shard cache) even when shards
        # stream without a cache: they bound the manifest each worker holds (reader.Dataset).
        self.ds.manifest_cache = manifest_copies_dir(cache_namespace(self.ds))
        self.cache_limit = parse_size(cache_limit, "cache_limit")
        biggest = max(self.ds.shard_list, key=lambda i: i.bytes, default=None)
        if self.cache_dir is not None and biggest is not None and biggest.bytes > self.cache_limit:
            # Said here, not at the first batch of every worker: the shard table is known.
            raise ConfigError(f"cache_limit {human_bytes(self.cache_limit)} is smaller than shard {biggest.path} "
                              f"({human_bytes(biggest.bytes)}) of {self.ds.url}; raise cache_limit")
        self.shuffle, self.seed, self.shuffle_block = bool(shuffle), seed, shuffle_block
        self.decode = decode
        self.batch_size, self.drop_last = batch_size, bool(drop_last)
        self.chunk = batch_size or loader_batch_size or 1
        self.prefetch, self.verify = prefetch, verify
        self.read_threads = read_threads
        self.zero_copy = bool(zero_copy)
        if self.zero_copy and (batch_size is None or decode is not None or cache_dir is None):
            raise ConfigError("zero_copy=True: needs batch_size, cache_dir and decode=None "
                              "(batches of views into the node cache's files)")
        self.rank, self.world_size = rank, world_size
        self._parent = FromParent()  # the rank, for DataLoader workers that are not forked
        make_decoder(decode)  # validate now, in the main process
        self._control = ControlDir("shardkit-stream-")
        self.epoch = 0
        self._remaining: list[Range] | None = None  # None: the whole epoch
        self._yielded = 0
        self._acc: dict[str, float] = {}
        self._acc_pid = os.getpid()
        self._samples_done = 0
        self._live: tuple[ShardSource, Topology] | None = None
        # Set by StreamingDataLoader before it forks its workers: raw batches are then written
        # into this shared ring and only small descriptors cross the worker pipe.
        self.ring: BatchRing | None = None
        self.loader_workers = 0  # the DataLoader's num_workers, when StreamingDataLoader knows it
        self._worker = 0
        self._tight = False
        self._next_stats = 0.0
        self._write_control()

    def __getstate__(self) -> dict[str, Any]:
        # The worker's open source stays home; the ring only reaches forked workers.
        state = dict(self.__dict__)
        state["_live"] = None
        state["ring"] = None
        return state

    # ---- epoch and resume state -----------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (keeps a resumed position if it is the resumed epoch)."""
        epoch = int_arg("epoch", epoch, 0, 2**32 - 1)
        if epoch != self.epoch:
            self._remaining = None
        self.epoch = epoch
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
        topo = current(self.rank, self.world_size, self._parent)
        return {
            "version": STATE_VERSION, "dataset": self.url, "created": self.ds.info.get("created"),
            "fingerprint": self.ds.fingerprint,
            "num_samples": self.ds.num_samples, "epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle,
            "shuffle_block": self.shuffle_block, "drop_last": self.drop_last, "world_size": topo.world_size,
            "remaining": [list(r) for r in self._remaining_now()],
            "consumed_per_rank": int(self._yielded if consumed is None else consumed),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a stopped epoch, possibly with another world size or worker count."""
        if not isinstance(state, dict):
            raise ConfigError(f"state_dict: expected a dict, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"state_dict: unsupported version {state.get('version')!r}")
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ConfigError(f"state_dict: missing {', '.join(map(repr, missing))} (a truncated checkpoint, "
                              "or not one from StreamingDataset.state_dict)")
        self._check_same_data(state)
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

    def _check_same_data(self, state: dict[str, Any]) -> None:
        """Refuse a state saved on other data: the same sample count in another shard layout
        would resume silently, repeating some samples and skipping others. The data's
        fingerprint decides, not the URL (a copy in another bucket is the same data); a state
        saved before states had one is compared by its dataset's ``created`` time."""
        if "fingerprint" in state:
            same = state["fingerprint"] == self.ds.fingerprint
        else:
            same = state.get("created") in (None, self.ds.info.get("created"))
        if same:
            return
        saved_on = state.get("dataset")
        which = (f"another pack of {self.url}: its shards differ" if saved_on in (None, self.url)
                 else f"saved on {saved_on}, another dataset than {self.url}")
        raise ConfigError(f"state_dict: the checkpoint is from {which}; resume on the data it was saved on, "
                          "or start this epoch afresh without load_state_dict")

    def _write_control(self) -> None:
        self._control.write({"epoch": self.epoch, "remaining": self._remaining})

    def _first_to_say(self, what: str) -> bool:
        """True for the first reader of this dataset object (the rank's main process or any of
        its DataLoader workers, in any epoch) to ask about ``what``, False for the others: a
        warning every worker would give is said once per rank. A marker in the control dir,
        which the rank's processes share, is created exclusively by the first."""
        try:
            os.close(os.open(os.path.join(self._control.path, f"said-{what}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:  # the control dir is gone: better a line per worker than none
            return True
        return True

    def _read_control(self) -> tuple[int, list[Range]]:
        # Persistent workers hold an old copy of this object: the control file is the truth.
        state = self._control.read()
        if state is None:
            return self.epoch, self._remaining_now()
        remaining = state["remaining"]
        return int(state["epoch"]), ([(int(a), int(b)) for a, b in remaining] if remaining is not None
                                     else [(0, self.ds.num_samples)])

    # ---- sizes ----------------------------------------------------------------------------

    def samples_per_rank(self) -> int:
        """Samples this rank yields this epoch (ceil(R/W), or floor with ``drop_last``)."""
        topo = current(self.rank, self.world_size, self._parent)
        return samples_per_rank(self._remaining_now(), topo.world_size, self.drop_last)

    def __len__(self) -> int:
        """Samples (or batches, with ``batch_size``) this rank yields this epoch."""
        n = self.samples_per_rank()
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    # ---- iteration ------------------------------------------------------------------------

    def _prefetch(self, topo: Topology) -> int:
        """``prefetch``; by default 4 where one process reads all of its shards
        (``num_workers=0``), else 2 per DataLoader worker.

        Such a process also downloads its prefetched shards at once (``ShardSource.at_once``):
        one at a time left the GETs idle while each shard's last part, hash and rename
        finished. Measured (RESULTS.md; 1.27 GB cold epochs, 2 read threads, landing fills, 2
        cores shared with SeaweedFS, rounds interleaved): 1.41-1.57 s with 2 shards at a time,
        1.18-1.36 s with 4. DataLoader workers keep one download each: two workers already
        download two shards at once, and a second thread each measured 3-10% slower."""
        if self.prefetch is not None:
            return self.prefetch
        return 4 if topo.num_workers == 1 and self.cache_dir is not None else 2

    def _open_source(self, topo: Topology) -> ShardSource:
        prefetch = self._prefetch(topo)
        window = self.shuffle_block + prefetch if self.shuffle else 2
        if self.cache_dir is None:
            source = ShardSource(self.ds, None, prefetch, max_open=window)
            source.verify = self.verify
            source.ahead_segments = window if self.shuffle else prefetch
            return source
        # room_wait: a reader never waits long for room other readers' pins hold (they may be
        # waiting for it, in a collective): it reads that shard around the cache instead.
        cache = ShardCache(self.cache_dir, self.cache_limit, namespace=cache_namespace(self.ds), verify=self.verify,
                           room_wait=room_wait())
        budget = self._pin_budget(topo)
        fits = sum(i.bytes for i in self.ds.shard_list) <= self.cache_limit  # then nothing is fetched twice
        if not fits and not _warned_small_cache:
            self._warn_if_cache_too_small(topo)
        return ShardSource(self.ds, cache, prefetch, max_open=max(1, min(window, budget)))

    def _pin_budget(self, topo: Topology) -> int:
        """Shards one process may keep open. Every reading process on the node pins what it
        holds; with a small cache_limit a process holds one shard at a time, so that pins
        alone can never fill the cache."""
        biggest = max((i.bytes for i in self.ds.shard_list), default=1) or 1
        return int(self.cache_limit // (biggest * self._readers_per_node(topo)) - 1)

    def _readers_per_node(self, topo: Topology) -> int:
        return _local_world(topo) * (self.loader_workers or topo.num_workers)

    def _warn_if_cache_too_small(self, topo: Topology) -> None:
        """Say (once per rank) if readers will evict shards they still need: it works, within
        the limit, but shards come back, a cold epoch's traffic several times over.

        What they need at once (measured: 2 workers in order fetched 1.42x with room for 2.5
        shards, 1.00x with 3): in order, a lone reader its shard; readers taking turns in a
        shard one each, and one more for the download that moves on. Shuffled, each reader
        reads from a shuffle block's shards at once."""
        global _warned_small_cache
        readers = self._readers_per_node(topo)
        biggest = max((i.bytes for i in self.ds.shard_list), default=0)
        if self.shuffle:
            need = (readers * self.shuffle_block + 1) * biggest
            what = f"shuffled, a shuffle block ({self.shuffle_block} shards) each, and a download"
        else:
            need = (readers + 1 if readers > 1 else 1) * biggest
            what = "in order, a shard each, and a download" if readers > 1 else "in order, one shard"
        if self.cache_limit >= need:
            return
        _warned_small_cache = True
        if not self._first_to_say("small-cache"):
            return
        log.warning("cache_limit %s is less than the %s that %d reading process(es) on this node (ranks x "
                    "DataLoader workers) read from at once (%s, shards of up to %s): shards may be fetched "
                    "several times per epoch; raise cache_limit to %s or more%s", human_bytes(self.cache_limit),
                    human_bytes(need), readers, what, human_bytes(biggest), human_bytes(need),
                    " (or lower shuffle_block)" if self.shuffle else "")

    def __iter__(self) -> Iterator[Any]:
        topo = current(self.rank, self.world_size, self._parent)
        epoch, remaining = self._read_control()
        order = EpochOrder(self.ds.shard_sizes(), epoch=epoch, seed=self.seed, shuffle=self.shuffle,
                           block_shards=self.shuffle_block)
        mine = rank_ranges(remaining, topo.rank, topo.world_size, self.drop_last)
        ranges = worker_ranges(mine, topo.worker, topo.num_workers, self.chunk)
        in_main = topo.num_workers == 1 and _in_main_process()
        if self.zero_copy and not _in_main_process():
            raise ConfigError("zero_copy=True: iterate in the main process (DataLoader num_workers=0); "
                              "a batch of views into mapped files cannot be sent from a worker")
        if in_main:
            self._yielded = 0
        if self._acc_pid != os.getpid():  # a fresh worker: counters start at zero
            self._acc, self._acc_pid = {}, os.getpid()
        source = self._open_source(topo)
        # Kept maps pay off only if the files stay: a dataset bigger than the cache would
        # cycle through them, each kept map holding an evicted file's disk space.
        source.keep_maps = self.zero_copy and (sum(i.bytes for i in self.ds.shard_list)
                                               <= min(self.cache_limit, keep_maps_budget()))
        # Landing fills (see landing) only where this process is the one reader of its shards:
        # DataLoader workers take turns in every shard, and a shard one worker landed would be
        # read back from disk by the others, where a fill through the page cache serves them all.
        source.landing = (self.batch_size is not None and self.decode is None and not self.zero_copy
                          and topo.num_workers == 1)
        source.at_once = source.prefetch if topo.num_workers == 1 else 1
        self._live = (source, topo)
        self._worker = topo.worker
        # A DataLoader worker waits, between batches, until the loader asks for more; in a
        # cache too small for every reader to keep a shard, pins held while waiting could
        # stall the other readers for good (a worker of another rank, or this worker's
        # sibling the loader is waiting for). Then shards are unpinned at every batch end.
        self._tight = self.cache_dir is not None and self._pin_budget(topo) < 1
        threads = self._fill_threads(topo, source, in_main)
        self._next_stats = time.monotonic() + _STATS_EVERY
        batches: Iterator[Any] | None = None
        try:
            sched = schedule_shards(order, ranges)
            source.plan(sched)
            planned = worker_schedule(order, ranges)
            if source.cache is None:  # read only the segments of shards this reader needs
                why = SPREAD_OVER_WORKERS if topo.num_workers > 1 else SHARE_EDGE
                source.segment_plan = SegmentPlanner(order, ranges, source.rows,
                                                     functools.partial(self._first_to_say, "waste"), why)
                planned = source.segment_plan.split(planned)
            runs = _Lookahead(planned, _LOOKAHEAD, source, sched)
            if self.batch_size is None:
                for s in self._samples(source, runs):
                    if in_main:
                        self._yielded += 1
                    yield s
            else:
                batches = (self._decoded_batches(source, runs) if self.decode is not None
                           else self._view_batches(source, runs) if self.zero_copy
                           else self._threaded_batches(source, runs, threads) if threads
                           else self._raw_batches(source, runs))
                for b in batches:
                    if in_main:
                        self._yielded += len(b["__key__"])
                    yield b
        finally:
            self._live = None
            if batches is not None:
                # Before the source closes: the batch generator stops its copy and map threads,
                # which read files the source holds open.
                batches.close()  # type: ignore[attr-defined]
            source.close()  # first: it waits for a prefetch in flight, which the final stats count
            self._save_stats(source, topo, final=True)

    def _tick(self, source: ShardSource, samples: int) -> None:
        self._samples_done += samples
        if time.monotonic() >= self._next_stats:
            self._next_stats = time.monotonic() + _STATS_EVERY
            if self._live is not None:
                self._save_stats(source, self._live[1], final=False)

    def _samples(self, source: ShardSource, runs: _Lookahead) -> Iterator[dict[str, Any]]:
        """Yield decoded sample dicts in this worker's order."""
        decoder = make_decoder(self.decode if self.batch_size is None else (self.decode or "raw"))
        first_sample = self.ds.first_samples
        infos = self.ds.shard_list
        chunk, tight, n = max(1, self.chunk), self._tight, 0
        while (run := runs.pop()) is not None:
            shard, positions = run
            rows = source.rows(shard)
            first, path = int(first_sample[shard]), infos[shard].path
            todo = positions.tolist()
            i = 0
            while i < len(todo):
                held = source.get(shard, positions[i:], runs.buf)
                view, base = held.view, held.base
                stop = min(len(todo), i + chunk - n % chunk) if tight else len(todo)
                keys, names, offs, sizes = rows.spans(positions[i:stop])
                for k, p in enumerate(todo[i:stop]):
                    sample = decoder(sample_from(view, base, keys[k], first + p, path, names[k], offs[k], sizes[k]))
                    n += 1
                    # Unpin before a yield after which the worker may wait on the DataLoader
                    # (tight: at every chunk end) or after which nothing is read (the last
                    # sample): pins held while the training loop waits in a collective for
                    # another rank can starve that rank's reader of cache room for good.
                    if (tight and n % chunk == 0) or (i + k + 1 == len(todo) and runs.fewer_than(1)):
                        if isinstance(sample, dict):  # raw fields: copies, not views of what we unpin
                            sample = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}
                        del view
                        source.release_all()
                    yield sample
                i = stop
            self._tick(source, len(positions))

    def _decoded_batches(self, source: ShardSource, runs: _Lookahead) -> Iterator[dict[str, Any]]:
        """Batches of decoded samples (``decode`` set), collated in this process."""
        decoder = make_decoder(self.decode)
        for pieces, carry, n, last in self._batch_pieces(runs):
            batch = _to_torch(collate(self._piece_samples(source, pieces, carry, runs, decoder)))
            if last or self._tight:  # decoded and collated: copies, nothing refers to the shards
                source.release_all()
            yield batch
            self._tick(source, n)

    def _batch_pieces(self, runs: _Lookahead) -> Iterator[tuple[list[Run], Run | None, int, bool]]:
        """Cut the run stream into batches: (pieces, the rest of the last run, samples, whether
        it is the last batch). After the last batch nothing more is read, so callers unpin its
        shards before they yield it: the training loop may hold it for as long as it likes
        (in a collective, waiting for a rank whose reader needs that cache room)."""
        size = self.batch_size or 1
        need = size if self.drop_last else 1  # fewer samples left than this: no batch follows
        carry: Run | None = None
        while True:
            pieces: list[Run] = []
            n = 0
            while n < size:
                if carry is None:
                    carry = runs.pop()
                    if carry is None:
                        break
                shard, p = carry
                take = size - n
                if len(p) > take:
                    pieces.append((shard, p[:take]))
                    carry = (shard, p[take:])
                    n += take
                else:
                    pieces.append(carry)
                    carry = None
                    n += len(p)
            if n == 0 or (n < size and self.drop_last):
                return
            rest = len(carry[1]) if carry is not None else 0
            last = rest < need and runs.fewer_than(need - rest)
            yield pieces, carry, n, last
            if last:
                return  # not even a dropped tail: popping it would prefetch its shards

    def _raw_batches(self, source: ShardSource, runs: _Lookahead) -> Iterator[Any]:
        """Raw batches built with numpy from the manifest offsets: one copy of the bytes."""
        for pieces, carry, n, last in self._batch_pieces(runs):
            built = self._build(source, pieces, carry, runs)
            if self._tight or last:  # the worker may now wait on the DataLoader / nothing more is read
                source.release_all()
            yield built if isinstance(built, RingBatch) else _to_torch(built)
            self._tick(source, n)

    def _view_batches(self, source: ShardSource, runs: _Lookahead) -> Iterator[dict[str, Any]]:
        """Zero-copy batches (``zero_copy=True``): per field, a list of views into the maps."""
        first_sample = self.ds.first_samples
        warm = MapWarmer()
        try:
            for pieces, carry, n, last in self._batch_pieces(runs):
                plan = plan_batch(source, pieces, first_sample)
                window = _Later(pieces, 0, carry, runs)
                batch = (view_batch(source, plan, window, opened=warm) if plan is not None
                         else self._ragged_views(source, pieces, carry, runs))
                if self._tight or last:
                    # Only the pins go: the views keep their maps, and a map stays valid after
                    # the cache evicts (unlinks) its file; the cache never truncates or rewrites
                    # a published file (a new copy arrives under a new inode by rename).
                    source.release_all()
                yield _to_torch(batch)
                self._tick(source, n)
        finally:
            warm.close()

    def _ragged_views(self, source: ShardSource, pieces: list[Run], carry: Run | None,
                      runs: _Lookahead) -> dict[str, Any]:
        # Samples with different fields: the same lists, None where a sample lacks a field.
        samples = self._piece_samples(source, pieces, carry, runs)
        names = list(dict.fromkeys(f for smp in samples for f in smp if not f.startswith("__")))
        batch: dict[str, Any] = {"__key__": [smp["__key__"] for smp in samples],
                                 "__index__": np.array([smp["__index__"] for smp in samples], np.int64)}
        for f in names:
            batch[f] = [np.frombuffer(smp[f], np.uint8) if f in smp else None for smp in samples]
        return batch

    def _fill_threads(self, topo: Topology, source: ShardSource, in_main: bool) -> int:
        """Threads to fill raw batches with (0: fill each batch when asked for it)."""
        if not (in_main and self.read_threads and self.batch_size and self.decode is None and source.cache):
            return 0
        # Batches in flight keep their shards pinned: with less room than that (plus one
        # download) a fill could wait for space that only the waiting loop would free.
        in_flight = 2 * self.read_threads
        return self.read_threads if self._pin_budget(topo) >= source.max_open + in_flight + 1 else 0

    def _threaded_batches(self, source: ShardSource, runs: _Lookahead, threads: int) -> Iterator[Any]:
        """Raw batches filled by ``threads`` threads, up to ``2 * threads`` batches ahead, and
        yielded in order. This thread plans each batch and opens (pins) its shards; the copy
        threads only read the open files into the batch's buffers."""
        first_sample = self.ds.first_samples
        pending: deque[tuple[Future[None], BatchPlan, list[np.ndarray], list[MemberCopy], int]] = deque()

        def finish() -> dict[str, Any]:
            fut, plan, outs, copies, _ = pending[0]
            t0 = time.perf_counter()
            try:
                fut.result()
            finally:
                source.wait_seconds += time.perf_counter() - t0
                pending.popleft()
                done(source, copies)
            return _to_torch(assemble(plan, outs))

        def drain(count: int | None = None, final: bool = False) -> Iterator[Any]:
            while pending and (count is None or count > 0):
                n = pending[0][4]
                batch = finish()
                if final and not pending:  # the last batch, copied: nothing more is read
                    source.release_all()
                yield batch
                self._tick(source, n)
                count = None if count is None else count - 1

        pool = ThreadPoolExecutor(threads, thread_name_prefix="shardkit-fill")
        try:
            for pieces, carry, n, last in self._batch_pieces(runs):
                plan = plan_batch(source, pieces, first_sample)
                if plan is None:  # ragged fields: collate per sample, after the batches before it
                    yield from drain()
                    batch = _to_torch(self._build_slow(source, pieces, carry, runs))
                    if last:
                        source.release_all()
                    yield batch
                    self._tick(source, n)
                    continue
                copies = list(prepare(source, plan, _Later(pieces, 0, carry, runs)))
                outs = [_BATCH_BUFFERS.take(nbytes) for nbytes in field_bytes(plan)]
                pending.append((pool.submit(copy_into, copies, outs), plan, outs, copies, n))
                del outs  # the pool sees a buffer as free once only the batch refers to it
                if len(pending) > 2 * threads:
                    yield from drain(1)
            yield from drain(final=True)
        finally:
            for fut, *_ in pending:
                fut.cancel()
            pool.shutdown(wait=True)  # no copy may still read a file the source closes next
            for _, _, _, copies, _ in pending:
                done(source, copies)
            pending.clear()

    def _build(self, source: ShardSource, pieces: list[Run], carry: Run | None, runs: _Lookahead) -> Any:
        """One raw batch: a dict of arrays, or (in a worker with a ring) a RingBatch."""
        plan = plan_batch(source, pieces, self.ds.first_samples)
        if plan is None:
            return self._build_slow(source, pieces, carry, runs)  # ragged fields: per-sample collate
        window = _Later(pieces, 0, carry, runs)  # the whole batch stays pinned while it is built
        ring = self.ring
        if ring is not None and not _in_main_process():
            sizes = field_bytes(plan)
            slot = ring.acquire(self._worker)
            outs = ring.fields(slot, sizes) if slot is not None else None
            if slot is not None and outs is None:
                ring.release(slot)  # an unusually large batch: send it the ordinary way
            if slot is not None and outs is not None:
                try:
                    batch = fill(source, plan, window, outs)
                except BaseException:
                    ring.release(slot)
                    raise
                return ring.batch(slot, sizes, list(plan.names),
                                  {k: (None if k in plan.names else v) for k, v in batch.items()})
        return fill(source, plan, window)

    def _build_slow(self, source: ShardSource, pieces: list[Run], carry: Run | None, runs: _Lookahead) -> dict[str, Any]:
        return collate(self._piece_samples(source, pieces, carry, runs, make_decoder("raw")))

    def _piece_samples(self, source: ShardSource, pieces: list[Run], carry: Run | None,
                       runs: _Lookahead, decoder: Callable[[dict[str, Any]], Any] | None = None) -> list[Any]:
        """The sample dicts of a batch's ``pieces``, their fields views of the held shards, or
        each passed through ``decoder`` while its shard is held (a batch may span shards that
        a small cache cannot hold at once)."""
        first_sample = self.ds.first_samples
        infos = self.ds.shard_list
        samples: list[dict[str, Any]] = []
        for i, (shard, p) in enumerate(pieces):
            rows = source.rows(shard)
            held = source.get(shard, p, _Later(pieces, i + 1, carry, runs))
            got = sample_dicts(held.view, held.base, rows, p, int(first_sample[shard]), infos[shard].path)
            samples += got if decoder is None else map(decoder, got)
        return samples

    # ---- statistics -----------------------------------------------------------------------

    def _save_stats(self, source: ShardSource, topo: Topology, final: bool) -> None:
        now = source.stats()
        now["samples"] = float(self._samples_done)
        total = {k: self._acc.get(k, 0.0) + v for k, v in now.items()}
        for k, v in self._acc.items():
            total.setdefault(k, v)
        if final:
            self._acc, self._samples_done = total, 0
        name = f"stats-r{topo.rank}w{topo.worker}p{os.getpid()}.json"
        path = os.path.join(self._control.path, name)
        try:
            write_replace(path, json.dumps(total).encode())
        except OSError:
            pass  # statistics are best effort; never fail a training step over them
        except NameError:
            # An iterator left unfinished is closed at interpreter exit, after builtins such
            # as open are gone: Python would print this as "Exception ignored" in every log.
            if not final:
                raise

    def stats(self) -> dict[str, Any]:
        """Counters of this rank since the dataset was made, summed over its processes.

        Keys: ``bytes_fetched`` (from storage), ``hits``/``misses`` (foreground cache opens
        that found / had to download the shard: a shard prefetched in time is a hit, so a cold
        epoch that prefetches well shows hits, and its downloads under ``prefetched``),
        ``prefetched`` (background downloads), ``prefetch_skipped``, ``landed``
        (downloads through a landing buffer, see landing), ``evictions``, ``corrupt_refetches``,
        ``direct_reads`` (ranged reads without cache), ``uncached_reads`` (shards read from
        storage into memory because pins of other readers on the node held the cache's room
        for ``SHARDKIT_ROOM_WAIT`` seconds, default 5: cache_limit is too small),
        ``samples``, ``wait_seconds`` (time blocked on data) and ``wait_seconds_per_worker``.
        Workers write snapshots about once a second and at the end of each epoch.
        """
        total: dict[str, Any] = {}
        per_worker: dict[str, float] = {}
        for path in sorted(glob.glob(os.path.join(self._control.path, "stats-*.json"))):
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                continue
            for k, v in data.items():
                total[k] = total.get(k, 0) + v
            per_worker[os.path.basename(path)[6:-5]] = data.get("wait_seconds", 0.0)
        for k in ("bytes_fetched", "hits", "misses", "prefetched", "prefetch_skipped", "landed", "evictions",
                  "corrupt_refetches", "direct_reads", "uncached_reads", "samples"):
            total[k] = int(total.get(k, 0))
        total.setdefault("wait_seconds", 0.0)
        total["wait_seconds_per_worker"] = per_worker
        return total


class _Lookahead:
    """The run stream with a window of upcoming runs (``buf``), telling the source which
    shards come next in need order so it keeps prefetching."""

    def __init__(self, runs: Iterator[Run], size: int, source: ShardSource, sched: Sequence[int]) -> None:
        self.runs, self.size, self.source = runs, size, source
        self.buf: deque[Run] = deque()
        self.sched, self.cursor, self.seen = sched, 0, set[int]()

    def pop(self) -> Run | None:
        buf = self.buf
        while len(buf) < self.size:
            nxt = next(self.runs, None)
            if nxt is None:
                break
            buf.append(nxt)
        if not buf:
            return None
        run = buf.popleft()
        if run[0] not in self.seen:  # first need of a shard: move the prefetch plan on
            self.seen.add(run[0])
            while self.cursor < len(self.sched) and self.sched[self.cursor] in self.seen:
                self.cursor += 1
            self.source.advance(self.sched[self.cursor:self.cursor + self.source.prefetch + self.source.max_open])
        return run

    def fewer_than(self, k: int) -> bool:
        """Whether the runs not popped yet hold fewer than ``k`` samples. Reads ahead in the
        run stream (pure partition arithmetic) only as far as that takes; opens nothing."""
        have = 0
        for _, p in self.buf:
            have += len(p)
            if have >= k:
                return False
        while have < k and (nxt := next(self.runs, None)) is not None:
            self.buf.append(nxt)
            have += len(nxt[1])
        return have < k


class _Later(Sequence[Run]):
    """The runs after piece ``i`` of a batch, built only if the source asks."""

    def __init__(self, pieces: list[Run], i: int, carry: Run | None, runs: _Lookahead) -> None:
        self.args = (pieces, i, carry, runs)
        self._list: list[Run] | None = None

    def _get(self) -> list[Run]:
        if self._list is None:
            pieces, i, carry, runs = self.args
            self._list = pieces[i:] + ([carry] if carry is not None else []) + list(runs.buf)
        return self._list

    def __len__(self) -> int:
        return len(self._get())

    def __getitem__(self, i: Any) -> Any:
        return self._get()[i]

    def __iter__(self) -> Iterator[Run]:
        return iter(self._get())


_warned_small_cache = False


def _local_world(topo: Topology) -> int:
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else topo.world_size


def _in_main_process() -> bool:
    try:
        from torch.utils.data import get_worker_info
    except ImportError:
        return True
    return get_worker_info() is None


def _to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return batch
    return {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in batch.items()}
