"""Reading a weighted mixture of datasets: ``StreamingDataset([Stream(...), Stream(...)], ...)``.

``StreamingDataset`` given a list of :class:`~shardkit.read.stream.Stream` (or one Stream) makes a
:class:`MixedStreamingDataset`. Each epoch is the mixture sequence ``M`` of
:mod:`shardkit.read.mixture`, split over ranks and DataLoader workers exactly as one dataset's
``G`` is; each reader keeps one shard source per stream, all in the same node cache (each
dataset has its namespace in it, and ``cache_limit`` bounds them together), and reads each
stream's runs in ``M``'s order (:mod:`shardkit.read.mix_schedule`). Samples carry ``__stream__``
(the stream's index) beside ``__key__``; batches are collated from samples (raw fields packed
as in one dataset's raw batches). ``zero_copy`` is refused (a batch would need views into
several datasets' files).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Iterator, Sequence, cast


from shardkit.batch import worker_slots
from shardkit.batch.builders import BatchBuilder
from shardkit.batch.collate import collate
from shardkit.batch.lookahead import LOOKAHEAD, Lookahead
from shardkit.config import human_bytes
from shardkit.datasets.mix_state import check_mix_state, make_mix_state, options_of
from shardkit.datasets.source_setup import open_source, pin_budget, readers_per_node
from shardkit.datasets.streaming import _BATCH_BUFFERS, READERS, StreamingDataset
from shardkit.datasets.tensors import in_main_process, to_torch
from shardkit.errors import ConfigError
from shardkit.read.cache_refs import cache_namespace
from shardkit.read.dataset import Dataset
from shardkit.read.manifest_copies import manifest_copies_dir
from shardkit.read.mix_schedule import MixtureWalk, NeededSegments, mixture_schedule
from shardkit.read.mixture import MixtureOrder, Stage, changed_mixture, mixture_counts
from shardkit.read.partition import Range, consumed_remaining, rank_ranges, worker_ranges
from shardkit.read.segments import SHARE_EDGE, SPREAD_OVER_WORKERS
from shardkit.read.selection import select
from shardkit.read.shard_source import ShardSource
from shardkit.read.stream import Stream
from shardkit.read.topology import Topology, current

__all__ = ["MixedStreamingDataset", "as_streams"]

_END = object()  # a stream's samples ran out (never, unless the walk is wrong)


def as_streams(url: Any) -> list[Stream] | None:
    """The streams a ``StreamingDataset`` url argument names, or None for one dataset URL.

    Args:
        url: a URL or path, a :class:`Stream`, or a list of Streams (or URLs).

    Returns:
        The streams, or None when ``url`` is one URL.

    Raises:
        ConfigError: an empty list, or an entry that is neither a Stream nor a URL.
    """
    if isinstance(url, Stream):
        return [url]
    if not isinstance(url, (list, tuple)):
        return None
    if not url:
        raise ConfigError("StreamingDataset: an empty list of streams; give at least one Stream")
    out = []
    for i, s in enumerate(url):
        if isinstance(s, (str, os.PathLike)):
            s = Stream(s)
        if not isinstance(s, Stream):
            raise ConfigError(f"StreamingDataset: entry {i} is a {type(s).__name__}, not a shardkit.Stream or URL")
        out.append(s)
    return out


class _Sources:
    """The shard sources of one mixture reader, as one for the statistics."""

    def __init__(self, sources: Sequence[ShardSource]) -> None:
        self.sources = list(sources)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for src in self.sources:
            for k, v in src.stats().items():
                out[k] = out.get(k, 0.0) + v
        return out


class MixedStreamingDataset(StreamingDataset):
    """A :class:`StreamingDataset` over a mixture of streams (made by ``StreamingDataset(streams)``).

    Takes the arguments of :class:`StreamingDataset`, with ``url`` a list of
    :class:`~shardkit.read.stream.Stream`, and ``epoch_size`` (samples per epoch; see
    :mod:`shardkit.read.mixture`). ``storage_options`` is the default of streams that give none.

    Args:
        url: the streams.
        *args: StreamingDataset's positional arguments after ``url``.
        epoch_size: samples per epoch (default: the sum of the streams' sizes with weights,
            the sum of their counts otherwise).
        **kwargs: StreamingDataset's keyword arguments.

    Raises:
        ConfigError: as StreamingDataset, ``zero_copy=True``, or bad mixture options.
        DatasetNotFoundError: nothing is at a stream's URL.
        StorageError: a dataset's metadata could not be read.
    """

    def __init__(self, url: Any, *args: Any, epoch_size: int | None = None, **kwargs: Any) -> None:
        streams = as_streams(url)
        assert streams is not None
        if kwargs.get("zero_copy"):
            raise ConfigError("zero_copy=True: not supported for a mixture of streams (a batch would view several "
                              "datasets' files); use batch_size without zero_copy")
        names = ("cache_dir", "cache_limit", "shuffle", "seed", "decode", "batch_size", "drop_last",
                 "storage_options")
        kwargs.update(zip(names, args))
        default_opts = kwargs.pop("storage_options", None)
        first = streams[0]
        super().__init__(first.url, storage_options=first.storage_options or default_opts, **kwargs)
        self.streams = streams
        self.dss: list[Dataset] = [self.ds]
        for s in streams[1:]:
            ds = Dataset(s.url, s.storage_options or default_opts)
            ds.manifest_cache = manifest_copies_dir(cache_namespace(ds))
            self.dss.append(ds)
        for ds in self.dss[1:]:
            biggest = max(ds.shard_list, key=lambda i: i.bytes, default=None)
            if self.cache_dir is not None and biggest is not None and biggest.bytes > self.cache_limit:
                raise ConfigError(f"cache_limit {human_bytes(self.cache_limit)} is smaller than shard {biggest.path} "
                                  f"({human_bytes(biggest.bytes)}) of {ds.url}; raise cache_limit")
        self.url = ", ".join(ds.url for ds in self.dss)
        self.epoch_size = epoch_size
        self._shares = [s.share for s in streams]
        # A stream with where=/indices= is its selection: counts per shard, a map back to samples.
        self.selections = [select(ds, where=s.where, indices=s.indices) for ds, s in zip(self.dss, streams)]
        self._shard_sizes = [ds.shard_sizes() if sel is None else sel.counts
                             for ds, sel in zip(self.dss, self.selections)]
        self._selected = [None if sel is None else (sel.indices, sel.first_samples) for sel in self.selections]
        self._full = tuple(mixture_counts([ds.num_samples if sel is None else len(sel)
                                           for ds, sel in zip(self.dss, self.selections)], self._shares, epoch_size))
        self._counts: tuple[int, ...] = self._full
        self._history: tuple[Stage, ...] = ()
        self._write_control()

    # ---- epoch, mixture and resume state --------------------------------------------------

    @property
    def counts(self) -> tuple[int, ...]:
        """Samples each stream gives in the epoch's current mixture (all ranks together)."""
        return self._counts

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (keeps a resumed position and mixture if it is the resumed epoch).

        Args:
            epoch: the epoch number (0 to 2**32 - 1).

        Raises:
            ConfigError: ``epoch`` is not an int in range.
        """
        if epoch != self.epoch:
            self._counts, self._history = self._full, ()
        super().set_epoch(epoch)

    def _remaining_now(self) -> list[Range]:
        return self._remaining if self._remaining is not None else [(0, sum(self._counts))]

    def _write_control(self) -> None:
        if not hasattr(self, "_counts"):
            return  # StreamingDataset.__init__ writes before the mixture is known
        self._control.write({"epoch": self.epoch, "remaining": self._remaining, "counts": list(self._counts),
                             "history": [[list(h.counts), [list(r) for r in h.remaining]] for h in self._history]})

    def _read_mix(self) -> tuple[int, list[Range], tuple[int, ...], tuple[Stage, ...]]:
        state = self._control.read()  # persistent workers hold an old copy: the file is the truth
        if state is None:
            return self.epoch, self._remaining_now(), self._counts, self._history
        counts = tuple(int(c) for c in state["counts"])
        history = tuple(Stage(tuple(c), tuple((int(a), int(b)) for a, b in r)) for c, r in state["history"])
        remaining = state["remaining"]
        return (int(state["epoch"]), [(int(a), int(b)) for a, b in remaining] if remaining is not None
                else [(0, sum(counts))], counts, history)

    def _digests(self) -> list[str | None]:
        """Per stream, the digest of its selection (None: the whole dataset)."""
        return [None if sel is None else sel.digest for sel in self.selections]

    def _epoch_ranges(self) -> tuple[Topology, MixtureOrder, list[Range]]:
        """This reader's topology, the epoch's mixture order and the positions of it this reader reads."""
        topo = current(self.rank, self.world_size, self._parent)
        epoch, remaining, counts, history = self._read_mix()
        order = MixtureOrder(self._shard_sizes, counts, epoch=epoch, seed=self.seed, shuffle=self.shuffle,
                             block_shards=self.shuffle_block, history=history, selected=self._selected)
        ranges = worker_ranges(rank_ranges(remaining, topo.rank, topo.world_size, self.drop_last),
                               topo.worker, topo.num_workers, self.chunk)
        return topo, order, ranges

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The resumable position, with the mixture it ran (see :mod:`shardkit.datasets.mix_state`).

        Args:
            consumed: samples this rank has consumed this epoch (as for StreamingDataset).

        Returns:
            A JSON-able dict for :meth:`load_state_dict`.
        """
        topo = current(self.rank, self.world_size, self._parent)
        return make_mix_state(self.dss, options_of(self._shares, self.epoch_size), counts=self._counts,
                              history=self._history, epoch=self.epoch, seed=self.seed, shuffle=self.shuffle,
                              shuffle_block=self.shuffle_block, drop_last=self.drop_last,
                              world_size=topo.world_size, remaining=self._remaining_now(),
                              selections=self._digests(),
                              consumed=self._yielded if consumed is None else consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a stopped epoch, with any world size or worker count, and any weights.

        With the options the state was saved with, the epoch continues exactly. With other
        weights (or repeat/choose/epoch_size), the rest of the epoch is a new mixture over the
        samples not yet seen this epoch, following the new options as far as those allow (see
        :mod:`shardkit.read.mixture`).

        Args:
            state: a dict :meth:`state_dict` of a mixture of the same streams returned.

        Raises:
            ConfigError: the state is malformed, from another version, not a mixture's, saved
                on other streams, or made with another seed, shuffle or shuffle_block.
        """
        counts, history, options = check_mix_state(state, self.dss, seed=self.seed, shuffle=self.shuffle,
                                                    shuffle_block=self.shuffle_block, selections=self._digests())
        remaining = [(int(a), int(b)) for a, b in state["remaining"]]
        left = consumed_remaining(remaining, int(state["world_size"]), bool(state["drop_last"]),
                                  int(state["consumed_per_rank"]))
        epoch = int(state["epoch"])
        opts = {"epoch": epoch, "seed": self.seed, "shuffle": self.shuffle, "block_shards": self.shuffle_block}
        try:  # the saved mixture must be one these streams can make (its counts fit their samples)
            MixtureOrder(self._shard_sizes, counts, history=history, **opts)  # type: ignore[arg-type]
            if options == options_of(self._shares, self.epoch_size):
                self._counts, self._history, self._remaining = counts, history, left
            else:
                new, stages = changed_mixture(self._shard_sizes, self._shares, self.epoch_size, counts, history,
                                              left, **opts)  # type: ignore[arg-type]
                self._counts, self._history, self._remaining = tuple(new), stages, None
        except ConfigError as exc:
            raise ConfigError(f"state_dict: its mixture does not fit these streams ({exc})") from None
        self.epoch = epoch
        self._yielded = 0
        self._write_control()

    # ---- reading --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """This reader's samples (or batches) of the epoch's mixture, in order.

        Yields:
            Sample dicts with ``__stream__`` (when the decoded sample is a dict), or with
            ``batch_size`` collated batch dicts of tensors (``__stream__`` an int64 tensor).

        Raises:
            IntegrityError: a shard or sample fails its checksum even after a fresh fetch.
            StorageError: reading from storage failed.
        """
        self._learn_chunk()
        topo, order, ranges = self._epoch_ranges()
        in_worker = not in_main_process()
        in_main = topo.num_workers == 1 and not in_worker
        if in_main:
            self._yielded = 0
        if in_worker:  # batches collated here (by the DataLoader too) go out through shared memory
            worker_slots.activate()
        self._stats.begin()
        cached = self.cache_dir is not None
        sched, items, needed = mixture_schedule(order, ranges, needed=not cached)
        walk = MixtureWalk(order, ranges, items)
        # Every stream's source pins shards: budget them as that many more readers.
        readers = readers_per_node(topo, self.loader_workers) * len(self.dss)
        sources: list[ShardSource] = []
        both = _Sources(sources)
        samples: list[Iterator[Any]] = []
        try:
            for i, ds in enumerate(self.dss):
                src = open_source(ds, topo, cache_dir=self.cache_dir, cache_limit=self.cache_limit,
                                  prefetch=self._prefetch(topo), verify=self.verify, shuffle=self.shuffle,
                                  shuffle_block=self.shuffle_block, readers=readers, zero_copy=False,
                                  landing=False, say_once=self._control.say_once)
                sources.append(src)
                src.plan(sched[i])
                runs: Iterator[Any] = walk.runs(i)
                if not cached:
                    why = SPREAD_OVER_WORKERS if topo.num_workers > 1 else SHARE_EDGE
                    src.segment_plan = NeededSegments(needed[i], src.rows,
                                                      functools.partial(self._control.say_once, "waste"), why)
                    runs = src.segment_plan.split(runs)
                tight = cached and pin_budget(ds, self.cache_limit, readers) < 1
                builder = BatchBuilder(ds, src, Lookahead(runs, LOOKAHEAD, src, sched[i]), batch_size=None,
                                       drop_last=self.drop_last, chunk=self.chunk, decode=self.decode, tight=tight,
                                       tick=functools.partial(self._tick, cast(ShardSource, both)), ring=None,
                                       worker=topo.worker, in_worker=in_worker, buffers=_BATCH_BUFFERS,
                                       decode_threads=self.decode_threads)
                samples.append(builder.samples())
            self._live = (cast(ShardSource, both), topo)
            mixed = _interleave(walk.labels(), samples)
            if self.batch_size is None:
                for s in mixed:
                    if in_main:
                        self._yielded += 1
                    yield s
                return
            batch: list[Any] = []
            for s in mixed:
                batch.append(s)
                if len(batch) == self.batch_size:
                    yield self._collated(batch, in_main)
                    batch = []
            if batch and not self.drop_last:
                yield self._collated(batch, in_main)
        finally:
            self._live = None
            for it in samples:  # before the sources: a sample generator may hold a shard open
                it.close()  # type: ignore[attr-defined]
            for src in sources:
                src.close()
            self._stats.save(cast(ShardSource, both), topo, final=True)

    def _collated(self, batch: list[Any], in_main: bool) -> Any:
        if in_main:
            self._yielded += len(batch)
        if not all(isinstance(s, dict) for s in batch):
            return batch  # a decoder's own objects: the DataLoader's collate_fn deals with them
        out = collate(batch)
        # A batch in this worker's shared slots goes as numpy arrays (StreamingDataLoader makes
        # the tensors in the main process): a tensor would be copied into new shared memory.
        return out if self.tensors_in_main and not in_main_process() and worker_slots.holds(out) else to_torch(out)


def _interleave(labels: Iterator[int], samples: list[Iterator[Any]]) -> Iterator[Any]:
    """The streams' samples in the order ``labels`` says, each dict tagged with ``__stream__``."""
    for i in labels:
        s = next(samples[i], _END)
        if s is _END:  # the walk gave stream i fewer runs than positions: a bug, never silent
            raise AssertionError(f"shardkit: stream {i} ran out of samples before the mixture did")
        if isinstance(s, dict):
            s["__stream__"] = i
        yield s




READERS.append((lambda url: as_streams(url) is not None, MixedStreamingDataset))
