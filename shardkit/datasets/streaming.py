"""StreamingDataset: the torch-facing reader for DDP training.

Each rank and DataLoader worker computes its own exact share from the pure partition in
:mod:`shardkit.read.partition`, reads it through the node cache (or straight from storage), and
yields WebDataset-style sample dicts (or, with ``batch_size``, whole batches built inside
the worker by :class:`shardkit.batch.builders.BatchBuilder`). Epoch and resume state live in a
small control file next to the statistics, so persistent DataLoader workers see ``set_epoch``
and ``load_state_dict`` made in the main process.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Iterator

from shardkit.batch import worker_slots
from shardkit.batch.buffers import BufferPool
from shardkit.batch.builders import BatchBuilder
from shardkit.read.decode import make_decoder
from shardkit.batch.lookahead import LOOKAHEAD, Lookahead
from shardkit.batch.ring import BatchRing, RingBatch
from shardkit.config import checked_cache_dir, human_bytes, int_arg, parse_size
from shardkit.datasets.epoch_control import ControlDir
from shardkit.datasets.fetch_size import fetcher_batch_size
from shardkit.datasets.metrics import stream_metrics
from shardkit.datasets.source_setup import default_prefetch, fill_threads, open_source, pin_budget, readers_per_node
from shardkit.datasets.state import check_state, make_state, resume_point
from shardkit.datasets.stats import StreamStats, summed_stats
from shardkit.datasets.tensors import in_main_process, to_torch
from shardkit.errors import ConfigError
from shardkit.read.dataset import Dataset
from shardkit.storage import ranged
from shardkit.read.manifest_copies import manifest_copies_dir
from shardkit.read.epoch_order import DEFAULT_BLOCK_SHARDS
from shardkit.read.partition import EpochOrder, Range, rank_ranges, samples_per_rank, schedule_shards, worker_ranges, worker_schedule
from shardkit.read.selection import SELECTION_GAPS, select
from shardkit.datasets.selected import selection_state, with_annotations
from shardkit.read.segments import SHARE_EDGE, SPREAD_OVER_WORKERS, SegmentPlanner
from shardkit.read.cache_refs import cache_namespace
from shardkit.read.shard_source import STREAM_RUN, ShardSource
from shardkit.read.topology import FromParent, Topology, current

__all__ = ["READERS", "StreamingDataset"]

try:  # torch is optional: without it the dataset is a plain iterable
    from torch.utils.data import IterableDataset as _IterableBase
except ImportError:  # pragma: no cover - exercised only without torch
    _IterableBase = object  # type: ignore[misc,assignment]

# Buffers of threaded raw batches, shared by every stream in this process: a buffer is reused
# once the training loop drops the last batch over it, so its pages are already mapped (a
# fresh one costs a zero-filled page fault per 4 KiB before the copy itself).
_BATCH_BUFFERS = BufferPool(keep=8, largest=256 << 20)
#: (accepts url, subclass) pairs: ``StreamingDataset(url)`` makes the first subclass whose test
#: accepts ``url`` (see ``__new__``).
READERS: list[tuple[Callable[[Any], bool], type[StreamingDataset]]] = []


class StreamingDataset(_IterableBase):  # type: ignore[misc,valid-type]
    """Stream a dataset into training with exact per-rank shares.

    Args:
        url: dataset root (``s3://bucket/ds``, a local path, ...), or a list of
            :class:`shardkit.Stream` to mix several datasets with weights (see
            :mod:`shardkit.datasets.mixed`; its ``epoch_size`` keyword sets the samples per epoch).
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
        seed: the shuffle seed (0 to 2**64 - 1): the same seed and epoch give the same order
            on every rank and in every run.
        decode: ``None`` (raw bytes), ``"pil"``, ``"numpy"`` or a callable on the raw sample.
        decode_threads: threads that run ``decode`` in each reading process (0: the reading
            thread does). PIL and libjpeg release the GIL while they decode and resize, so with
            ``num_workers=0`` two threads keep two cores busy without worker processes or
            batches sent between them; in DataLoader workers that already fill the cores they
            add nothing (see docs/guide/streaming.md and benchmarks/RESULTS.md).
        batch_size: yield whole batches built in the worker (use ``DataLoader(batch_size=None)``).
        drop_last: drop the tail so every rank gets floor(N/W) samples; otherwise ranks are
            padded to ceil(N/W) by repeating samples from the start of the epoch.
        storage_options: fsspec/s3fs options for the dataset URL (explicit values beat
            ``AWS_*`` variables).
        shuffle_block: shards per shuffle block: samples are shuffled within a block, and a
            reader holds a block's shards at once (more shards mix more, and need more cache
            room or memory).
        loader_batch_size: the DataLoader's batch size when it batches (not ``batch_size``):
            workers then take turns in whole batches, so resume is exact. Without it, the
            workers of a plain torch DataLoader read the size from its fetcher at their first
            sample (see :mod:`shardkit.datasets.fetch_size`).
        prefetch: shards (without a cache: ~64 MiB segments) fetched ahead of need per worker, at once;
            default 4 when the stream is read in one process (``num_workers=0``), else 2.
        verify: check what is not known good against the manifest checksums: a cached shard
            file without the cache's "verified" stamp is hashed again, and without a cache each
            sample read is checked. ``False`` trusts a cached file of the right size and skips
            the per-sample checks (downloads into the cache are checked either way).
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
        rank: this process's rank (default: torch.distributed's, else the ``RANK`` variable,
            else 0; see :mod:`shardkit.read.topology`).
        world_size: ranks sharing the epoch (default: torch.distributed's, else ``WORLD_SIZE``,
            else 1).
        metrics_port: export this stream's counters (those of :meth:`stats`, per rank and
            worker) to Prometheus on this port, served by the first process of the node that
            takes it (default: ``SHARDKIT_METRICS_PORT``, else off; needs ``prometheus_client``).
            See :mod:`shardkit.datasets.metrics`.
        version: the dataset version to stream (see :mod:`shardkit.read.versions`); None: the
            latest committed when the stream is made. The stream keeps reading that version
            while later ones are appended, and its state loads only on that version.
        where: stream only the samples this SQL condition over the manifest's columns selects
            (``"label < 500 AND width >= 224"``; needs ``shardkit[query]``), evaluated once per
            node (see :mod:`shardkit.read.selection`); ranks, workers, ``len`` and resume then
            cover exactly the selection, and shards holding none of it are never fetched.
        indices: stream only these global sample indices (in any order, each at most once);
            not with ``where``.
        annotations: add the dataset's side columns (``shardkit annotate``) to each sample
            dict as ``sample["__annotations__"]`` (a dict; with ``batch_size``, a dict of
            lists per batch); read once per process, in memory.

    Raises:
        ConfigError: a bad option (a number out of range, a ``rank`` outside ``world_size``,
            ``zero_copy`` without what it needs, an unusable ``cache_dir``, a ``cache_limit``
            smaller than the largest shard).
        DatasetNotFoundError: nothing is at ``url``.
        StorageError: the dataset's metadata could not be read.
    """

    def __new__(cls, url: Any = None, *args: Any, **kwargs: Any) -> StreamingDataset:
        # Another kind of url (a list of Streams: a mixture) is read by a subclass that
        # registered for it (shardkit.datasets.mixed, imported with the package).
        if cls is StreamingDataset:
            for accepts, kind in READERS:
                if accepts(url):
                    return super().__new__(kind)
        return super().__new__(cls)

    def __init__(self, url: str, cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | str = "200GB",
                 shuffle: bool = False, seed: int = 0, decode: str | Callable[[dict[str, Any]], Any] | None = None,
                 batch_size: int | None = None, drop_last: bool = False,
                 storage_options: dict[str, Any] | None = None, *, shuffle_block: int = DEFAULT_BLOCK_SHARDS,
                 loader_batch_size: int | None = None, prefetch: int | None = None, verify: bool = True,
                 read_threads: int = 2, zero_copy: bool = False, rank: int | None = None,
                 world_size: int | None = None, metrics_port: int | None = None, version: int | None = None,
                 where: str | None = None, indices: Any = None, annotations: bool = False,
                 decode_threads: int = 0) -> None:
        # Numbers checked before any I/O, each with its own name (a str from an argument
        # parser would otherwise fail as a bare TypeError, a float in an internal name later).
        batch_size = None if batch_size is None else int_arg("batch_size", batch_size, 1)
        loader_batch_size = None if loader_batch_size is None else int_arg("loader_batch_size", loader_batch_size, 1)
        prefetch = None if prefetch is None else int_arg("prefetch", prefetch, 0)
        read_threads = int_arg("read_threads", read_threads, 0)
        decode_threads = int_arg("decode_threads", decode_threads, 0)
        seed, shuffle_block = int_arg("seed", seed, 0, 2**64 - 1), int_arg("shuffle_block", shuffle_block, 1)
        world_size = None if world_size is None else int_arg("world_size", world_size, 1)
        rank = None if rank is None else int_arg("rank", rank, 0)
        if rank is not None and world_size is not None and rank >= world_size:  # else told at the first epoch
            raise ConfigError(f"rank {rank} is outside world_size {world_size}: ranks are 0 to {world_size - 1}")
        cache_limit = parse_size(cache_limit, "cache_limit")  # nan, inf or "-5MB": a ConfigError naming it
        self.ds = Dataset(url, storage_options, version=version)  # the version is fixed for the stream's life
        ranged.prepare(self.ds.store)  # here, before DataLoader workers fork: their first reads come sooner
        self.url = self.ds.url
        self.cache_dir = checked_cache_dir(cache_dir)
        # Node-local manifest copies (the temp dir, outside the shard cache) even when shards
        # stream without a cache: they bound the manifest each worker holds (read.dataset.Dataset).
        self.ds.manifest_cache = manifest_copies_dir(cache_namespace(self.ds))
        self.selection = select(self.ds, where=where, indices=indices)
        self.annotations = bool(annotations)
        self.cache_limit = cache_limit
        biggest = max(self.ds.shard_list, key=lambda i: i.bytes, default=None)
        if self.cache_dir is not None and biggest is not None and biggest.bytes > self.cache_limit:
            # Said here, not at the first batch of every worker: the shard table is known.
            raise ConfigError(f"cache_limit {human_bytes(self.cache_limit)} is smaller than shard {biggest.path} "
                              f"({human_bytes(biggest.bytes)}) of {self.ds.url}; raise cache_limit")
        self.shuffle, self.seed, self.shuffle_block = bool(shuffle), seed, shuffle_block
        self.decode, self.decode_threads = decode, decode_threads
        self.batch_size, self.drop_last = batch_size, bool(drop_last)
        self.chunk = batch_size or loader_batch_size or 1
        # Unbatched and not told the DataLoader's batch size: learn it from a plain DataLoader's
        # fetcher at the first sample of each epoch (see fetch_size; StreamingDataLoader says it).
        self.chunk_from_loader = batch_size is None and loader_batch_size is None
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
        self._stats = StreamStats(self._control.path)
        self.metrics_port = stream_metrics(metrics_port, self._control.path, url=self.url, cache_dir=self.cache_dir,
                                           cache_limit=self.cache_limit)
        self._live: tuple[ShardSource, Topology] | None = None
        # Set by StreamingDataLoader before it forks its workers: raw batches are then written
        # into this shared ring and only small descriptors cross the worker pipe.
        self.ring: BatchRing | None = None
        self.loader_workers = 0  # the DataLoader's num_workers, when StreamingDataLoader knows it
        # Set by StreamingDataLoader: it turns numpy batches into tensors itself, so a worker
        # may send a batch that lies in its shared slots as it is (see batch.worker_slots).
        self.tensors_in_main = False
        self._write_control()

    def __getstate__(self) -> dict[str, Any]:
        # The worker's open source stays home; the ring only reaches forked workers.
        state = dict(self.__dict__)
        state["_live"] = None
        state["ring"] = None
        return state

    # ---- epoch and resume state -----------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (keeps a resumed position if it is the resumed epoch).

        Args:
            epoch: the epoch number (0 to 2**32 - 1); it seeds the epoch's shuffle.

        Raises:
            ConfigError: ``epoch`` is not an int in range.
        """
        epoch = int_arg("epoch", epoch, 0, 2**32 - 1)
        if epoch != self.epoch:
            self._remaining = None
        self.epoch = epoch
        self._yielded = 0
        self._write_control()

    def _remaining_now(self) -> list[Range]:
        return self._remaining if self._remaining is not None else [(0, self._num_samples())]

    def _num_samples(self) -> int:
        """Samples an epoch holds: the selected ones with ``where``/``indices``."""
        return len(self.selection) if self.selection is not None else self.ds.num_samples

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The resumable position, to save with a checkpoint.

        Args:
            consumed: samples this rank has consumed this epoch. Without it, the count of
                samples this object yielded in this process is used, which is right when
                iterating without DataLoader workers; with workers, pass the count (steps x
                batch size) or use :class:`shardkit.StreamingDataLoader`, which tracks it.

        Returns:
            A JSON-able dict for :meth:`load_state_dict` (see :mod:`shardkit.datasets.state`).
        """
        topo = current(self.rank, self.world_size, self._parent)
        return make_state(self.ds, epoch=self.epoch, seed=self.seed, shuffle=self.shuffle,
                          shuffle_block=self.shuffle_block, drop_last=self.drop_last, world_size=topo.world_size,
                          remaining=self._remaining_now(), consumed=self._yielded if consumed is None else consumed,
                          **selection_state(self.selection))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a stopped epoch, possibly with another world size or worker count.

        Args:
            state: a dict :meth:`state_dict` returned (on this data, with this seed and
                shuffle options).

        Raises:
            ConfigError: the state is malformed, from another version, saved on other data,
                or made with another seed, shuffle, shuffle_block or selection (``where``/``indices``).
        """
        check_state(state, self.ds, seed=self.seed, shuffle=self.shuffle, shuffle_block=self.shuffle_block,
                    **selection_state(self.selection))
        self.epoch, self._remaining = resume_point(state)
        self._yielded = 0
        self._write_control()

    def _write_control(self) -> None:
        self._control.write({"epoch": self.epoch, "remaining": self._remaining})

    def _read_control(self) -> tuple[int, list[Range]]:
        # Persistent workers hold an old copy of this object: the control file is the truth.
        state = self._control.read()
        if state is None:
            return self.epoch, self._remaining_now()
        remaining = state["remaining"]
        return int(state["epoch"]), ([(int(a), int(b)) for a, b in remaining] if remaining is not None
                                     else [(0, self._num_samples())])

    # ---- sizes ----------------------------------------------------------------------------

    def samples_per_rank(self) -> int:
        """Samples this rank yields this epoch.

        Returns:
            ceil(R/W) of the R samples left in the epoch over W ranks (floor with ``drop_last``).
        """
        topo = current(self.rank, self.world_size, self._parent)
        return samples_per_rank(self._remaining_now(), topo.world_size, self.drop_last)

    def __len__(self) -> int:
        """Samples (or batches, with ``batch_size``) this rank yields this epoch."""
        n = self.samples_per_rank()
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    # ---- reading --------------------------------------------------------------------------

    def _prefetch(self, topo: Topology) -> int:
        """``prefetch``, or its default for this process (see :func:`default_prefetch`)."""
        return default_prefetch(self.prefetch, topo, self.cache_dir is not None)

    def _pin_budget(self, topo: Topology) -> int:
        """Shards one process may keep open (see :func:`pin_budget`)."""
        return pin_budget(self.ds, self.cache_limit, readers_per_node(topo, self.loader_workers))

    def __iter__(self) -> Iterator[Any]:
        """This reader's samples (or batches) of the epoch, in order.

        Yields:
            Sample dicts (fields decoded as ``decode`` says), or with ``batch_size`` batch
            dicts of tensors (in a DataLoader worker with a ring: ring batch descriptors,
            which :class:`shardkit.StreamingDataLoader` turns back into batches).

        Raises:
            ConfigError: ``zero_copy`` in a DataLoader worker.
            IntegrityError: a shard or sample fails its checksum even after a fresh fetch.
            StorageError: reading from storage failed.
        """
        self._learn_chunk()
        topo = current(self.rank, self.world_size, self._parent)
        epoch, remaining = self._read_control()
        order = (EpochOrder(self.ds.shard_sizes(), epoch=epoch, seed=self.seed, shuffle=self.shuffle,
                            block_shards=self.shuffle_block) if self.selection is None
                 else self.selection.order(epoch, self.seed, self.shuffle, self.shuffle_block))
        mine = rank_ranges(remaining, topo.rank, topo.world_size, self.drop_last)
        ranges = worker_ranges(mine, topo.worker, topo.num_workers, self.chunk)
        in_worker = not in_main_process()
        in_main = topo.num_workers == 1 and not in_worker
        if self.zero_copy and in_worker:
            raise ConfigError("zero_copy=True: iterate in the main process (DataLoader num_workers=0); "
                              "a batch of views into mapped files cannot be sent from a worker")
        if in_worker:  # batches collated here (by the DataLoader too) go out through shared memory
            worker_slots.activate()
        if in_main:
            self._yielded = 0
        self._stats.begin()  # a fresh worker: counters start at zero
        source = open_source(self.ds, topo, cache_dir=self.cache_dir, cache_limit=self.cache_limit,
                             prefetch=self._prefetch(topo), verify=self.verify, shuffle=self.shuffle,
                             shuffle_block=self.shuffle_block, readers=readers_per_node(topo, self.loader_workers),
                             zero_copy=self.zero_copy, landing=self.batch_size is not None and self.decode is None,
                             say_once=self._control.say_once)
        self._live = (source, topo)
        # A DataLoader worker waits, between batches, until the loader asks for more; in a
        # cache too small for every reader to keep a shard, pins held while waiting could
        # stall the other readers for good (a worker of another rank, or this worker's
        # sibling the loader is waiting for). Then shards are unpinned at every batch end.
        tight = self.cache_dir is not None and self._pin_budget(topo) < 1
        threads = (fill_threads(self.read_threads, source, self._pin_budget(topo))
                   if in_main and self.batch_size and self.decode is None else 0)
        batches: Iterator[Any] | None = None
        try:
            sched = schedule_shards(order, ranges)
            source.plan(sched)
            # Runs of at most STREAM_RUN samples (or a batch): a reader waits for one run's
            # samples of a shard still landing, not for the rest of the shard.
            planned = worker_schedule(order, ranges, max_run=max(self.chunk, STREAM_RUN))
            if source.cache is None:  # read only the segments of shards this reader needs
                why = (SELECTION_GAPS if self.selection is not None else SPREAD_OVER_WORKERS if topo.num_workers > 1
                       else SHARE_EDGE)
                source.segment_plan = SegmentPlanner(order, ranges, source.rows,
                                                     functools.partial(self._control.say_once, "waste"), why)
                planned = source.segment_plan.split(planned)
            builder = BatchBuilder(self.ds, source, Lookahead(planned, LOOKAHEAD, source, sched),
                                   batch_size=self.batch_size, drop_last=self.drop_last, chunk=self.chunk,
                                   decode=self.decode, tight=tight, tick=functools.partial(self._tick, source),
                                   ring=self.ring, worker=topo.worker, in_worker=in_worker, buffers=_BATCH_BUFFERS,
                                   decode_threads=self.decode_threads)
            side = with_annotations(self.ds) if self.annotations else None
            if self.batch_size is None:
                for s in builder.samples():
                    if in_main:
                        self._yielded += 1
                    yield s if side is None else side(s)
            else:
                batches = (builder.decoded_batches() if self.decode is not None
                           else builder.view_batches() if self.zero_copy
                           else builder.threaded_batches(threads) if threads
                           else builder.raw_batches())
                for b in batches:
                    if isinstance(b, RingBatch):  # in a worker's ring: the loader reads it there
                        yield b
                        continue
                    if in_main:
                        self._yielded += len(b["__key__"])
                    b = b if side is None else side(b)
                    # A batch in this worker's shared slots goes as numpy arrays (the loader
                    # makes the tensors): a tensor would be copied into new shared memory.
                    yield b if in_worker and self.tensors_in_main and worker_slots.holds(b) else to_torch(b)
        finally:
            self._live = None
            if batches is not None:
                # Before the source closes: the batch generator stops its copy and map threads,
                # which read files the source holds open.
                batches.close()  # type: ignore[attr-defined]
            source.close()  # first: it waits for a prefetch in flight, which the final stats count
            self._stats.save(source, topo, final=True)

    def _learn_chunk(self) -> None:
        """Take the batch size of the plain DataLoader pulling the first sample, if one is
        (the first thing ``__iter__`` runs, so the fetcher is the caller's caller)."""
        if self.chunk_from_loader and self.batch_size is None:
            self.chunk = fetcher_batch_size() or self.chunk

    def _tick(self, source: ShardSource, samples: int, nbytes: int) -> None:
        if self._stats.count(samples, nbytes) and self._live is not None:
            self._stats.save(source, self._live[1], final=False)

    # ---- statistics -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters of this rank since the dataset was made, summed over its processes.

        Workers write snapshots about once a second and at the end of each epoch.

        Returns:
            ``bytes_fetched`` (from storage), ``hits``/``misses`` (foreground cache opens
            that found / had to download the shard: a shard prefetched in time is a hit, so a
            cold epoch that prefetches well shows hits, and its downloads under
            ``prefetched``), ``prefetched`` (background downloads), ``prefetch_skipped``,
            ``landed`` (downloads through a landing buffer, see :mod:`shardkit.cache.landing`),
            ``streamed`` (opens that read a shard while it landed, see :mod:`shardkit.cache.streamed`),
            ``evictions``, ``corrupt_refetches``, ``direct_reads`` (ranged reads without
            cache), ``uncached_reads`` (shards read from storage into memory because pins of
            other readers on the node held the cache's room for ``SHARDKIT_ROOM_WAIT``
            seconds, default 5: cache_limit is too small), ``samples`` and ``bytes_served``
            (samples yielded to the training loop and the bytes of their fields), ``wait_seconds``
            (time blocked on data), ``cache_wait_seconds`` (time the cache waited for another
            process's download of a shard, or for room, in the foreground or in prefetch
            threads), ``retries`` and ``retries_<kind>`` (storage calls retried while reading,
            by kind: see :mod:`shardkit.storage.retry_counts`) and ``wait_seconds_per_worker``.
            The Prometheus exporter (``metrics_port``) serves the same counters.
        """
        return summed_stats(self._control.path)

