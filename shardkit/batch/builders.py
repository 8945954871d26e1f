"""One reader's samples and batches, cut from its run stream: the five ways a stream yields data.

:class:`BatchBuilder` turns the runs of a reader's share into what the stream yields: single
sample dicts, batches of decoded samples, raw batches filled by one copy (in this thread, by
read threads, or into a shared ring slot in a DataLoader worker), or zero-copy batches of views
into the cached files. Batches are numpy arrays and bytes; the torch side (``shardkit.datasets``)
turns them into tensors.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generator, Iterator

import numpy as np

from shardkit.batch.buffers import BufferPool
from shardkit.read.decode import Decoder, make_decoder
from shardkit.batch.collate import collate
from shardkit.batch.lookahead import Later, Lookahead
from shardkit.batch.map_warmer import MapWarmer
from shardkit.batch.raw import (BatchPlan, MemberCopy, assemble, copy_into, done, field_bytes, fill,
                                plan_batch, prepare, view_batch)
from shardkit.batch.ring import BatchRing, RingBatch
from shardkit.read.dataset import Dataset, sample_dicts
from shardkit.read.samples import sample_from
from shardkit.read.shard_source import Run, ShardSource

__all__ = ["BatchBuilder", "Pieces"]

#: One batch cut from the run stream: its runs, the rest of the last run, its sample count,
#: and whether it is the reader's last batch.
Pieces = tuple[list[Run], "Run | None", int, bool]


class BatchBuilder:
    """Cuts one reader's run stream into samples or batches, reading them through ``source``.

    Each path unpins the shards it holds before a yield after which the reader may wait
    (``tight``: at every batch end) or after which nothing more is read (the last batch): the
    training loop may hold that batch for as long as it likes, waiting in a collective for a
    rank whose reader needs that cache room.

    Args:
        ds: the dataset being read.
        source: the open shard source of this reader.
        runs: the reader's run stream.
        batch_size: samples per batch (``None``: the stream yields single samples).
        drop_last: no short last batch.
        chunk: samples per DataLoader batch, for the unpin points of single samples.
        decode: the stream's ``decode`` option (``None``: raw bytes).
        tight: unpin at every batch end (a cache too small for every reader to keep a shard).
        tick: called with the sample count and the bytes of their fields after each yielded
            batch (or run of samples).
        ring: the shared ring raw batches go into in a DataLoader worker, if any.
        worker: this reader's DataLoader worker id (its ring slots).
        in_worker: this reader runs in a DataLoader worker (the ring is used only there).
        buffers: the reused buffers threaded raw batches are filled into.
        decode_threads: threads that run ``decode`` (0: the reading thread does).
    """

    def __init__(self, ds: Dataset, source: ShardSource, runs: Lookahead, *, batch_size: int | None,
                 drop_last: bool, chunk: int, decode: str | Decoder | None, tight: bool,
                 tick: Callable[[int, int], None], ring: BatchRing | None, worker: int, in_worker: bool,
                 buffers: BufferPool, decode_threads: int = 0) -> None:
        self.ds, self.source, self.runs = ds, source, runs
        self.batch_size, self.drop_last, self.chunk = batch_size, drop_last, chunk
        self.decode, self.tight, self.tick = decode, tight, tick
        self.ring, self.worker, self.in_worker = ring, worker, in_worker
        self.buffers = buffers
        self.decode_threads = decode_threads

    def samples(self) -> Generator[Any, None, None]:
        """Single samples, decoded, in this reader's order (by ``decode_threads`` threads, if set).

        Returns:
            An iterator of the decoded sample of each position (a dict of fields for the
            built-in decoders); close it to stop early.
        """
        if self.decode_threads and self.decode not in (None, "raw"):
            return self._decoded_ahead(self._samples("raw"), make_decoder(self.decode))
        return self._samples(self.decode)

    def _decoded_ahead(self, raw: Generator[dict[str, Any], None, None],
                       decoder: Decoder) -> Generator[Any, None, None]:
        """The samples of ``raw`` (bytes copies: nothing pinned) decoded by ``decode_threads``
        threads, a few per thread ahead, yielded in order. With a tight cache nothing is read
        past a DataLoader batch's end before its samples are out: ``raw`` would pin the next
        shard while the worker waits on the loader."""
        pool = ThreadPoolExecutor(self.decode_threads, thread_name_prefix="shardkit-decode")
        window: deque[Future[Any]] = deque()
        ahead, chunk, pulled = 4 * self.decode_threads, max(1, self.chunk), 0
        try:
            while True:
                while len(window) < ahead and not (self.tight and window and pulled % chunk == 0):
                    sample = next(raw, None)
                    if sample is None:
                        break
                    window.append(pool.submit(decoder, sample))
                    pulled += 1
                if not window:
                    return
                yield window.popleft().result()
        finally:
            for fut in window:
                fut.cancel()
            pool.shutdown(wait=True)
            raw.close()

    def _samples(self, decode: str | Decoder | None) -> Generator[Any, None, None]:
        source, runs = self.source, self.runs
        decoder = make_decoder(decode if self.batch_size is None else (decode or "raw"))
        raw = decode is None or decode == "raw"  # bytes copies made as the dict is: no decoder call
        first_sample = self.ds.first_samples
        infos = self.ds.shard_list
        chunk, tight, n = max(1, self.chunk), self.tight, 0
        while (run := runs.pop()) is not None:
            shard, positions = run
            rows = source.rows(shard)
            first, path = int(first_sample[shard]), infos[shard].path
            todo = positions.tolist()
            i = 0
            while i < len(todo):
                # Asked for a chunk at a time: a shard still landing then serves its first
                # samples once they are verified, not once the rest of this reader's share
                # (often the whole shard) is; a cached shard is read on to the run's end.
                step = min(len(todo), i + chunk - n % chunk)
                held = source.get(shard, positions[i:step], runs.buf)
                view, base = held.view, held.base
                stop = step if tight or held.landing is not None else len(todo)
                keys, names, offs, sizes = rows.spans(positions[i:stop])
                for k, p in enumerate(todo[i:stop]):
                    sample = sample_from(view, base, keys[k], first + p, path, names[k], offs[k], sizes[k], raw)
                    if not raw:
                        sample = decoder(sample)
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
            self.tick(len(positions), rows.payload_bytes(positions))

    def decoded_batches(self) -> Iterator[dict[str, Any]]:
        """Batches of decoded samples (``decode`` set), collated in this process.

        Yields:
            Batch dicts (see :func:`shardkit.batch.collate.collate`).
        """
        source = self.source
        decoder = make_decoder(self.decode)
        pool = (ThreadPoolExecutor(self.decode_threads, thread_name_prefix="shardkit-decode")
                if self.decode_threads else None)
        try:
            for pieces, carry, n, last in self._batch_pieces():
                batch = collate(self._piece_samples(pieces, carry, decoder, pool))
                if last or self.tight:  # decoded and collated: copies, nothing refers to the shards
                    source.release_all()
                yield batch
                self.tick(n, self._served(pieces))
        finally:
            if pool is not None:
                pool.shutdown(wait=True)

    def raw_batches(self) -> Iterator[dict[str, Any] | RingBatch]:
        """Raw batches built with numpy from the manifest offsets: one copy of the bytes.

        Yields:
            Batch dicts of packed fields, or (in a DataLoader worker with a ring) RingBatch
            descriptors of batches written into the ring.
        """
        source = self.source
        for pieces, carry, n, last in self._batch_pieces():
            built = self._build(pieces, carry)
            if self.tight or last:  # the worker may now wait on the DataLoader / nothing more is read
                source.release_all()
            yield built
            self.tick(n, self._served(pieces))

    def view_batches(self) -> Iterator[dict[str, Any]]:
        """Zero-copy batches (``zero_copy=True``): per field, a list of views into the maps.

        Yields:
            Batch dicts (see :func:`shardkit.batch.raw.view_batch`).
        """
        source = self.source
        first_sample = self.ds.first_samples
        warm = MapWarmer()
        try:
            for pieces, carry, n, last in self._batch_pieces():
                plan = plan_batch(source, pieces, first_sample)
                window = Later(pieces, 0, carry, self.runs)
                batch = (view_batch(source, plan, window, opened=warm) if plan is not None
                         else self._ragged_views(pieces, carry))
                if self.tight or last:
                    # Only the pins go: the views keep their maps, and a map stays valid after
                    # the cache evicts (unlinks) its file; the cache never truncates or rewrites
                    # a published file (a new copy arrives under a new inode by rename).
                    source.release_all()
                yield batch
                self.tick(n, self._served(pieces))
        finally:
            warm.close()

    def threaded_batches(self, threads: int) -> Iterator[dict[str, Any]]:
        """Raw batches filled by ``threads`` threads, up to ``2 * threads`` batches ahead, and
        yielded in order.

        This thread plans each batch and opens (pins) its shards; the copy threads only read
        the open files into the batch's buffers.

        Args:
            threads: copy threads (at least 1).

        Yields:
            Batch dicts of packed fields, their arrays slices of reused buffers.
        """
        source = self.source
        first_sample = self.ds.first_samples
        pending: deque[tuple[Future[None], BatchPlan, list[np.ndarray], list[MemberCopy], int, int]] = deque()

        def finish() -> dict[str, Any]:
            fut, plan, outs, copies, _, _ = pending[0]
            t0 = time.perf_counter()
            try:
                fut.result()
            finally:
                source.wait_seconds += time.perf_counter() - t0
                pending.popleft()
                done(source, copies)
            return assemble(plan, outs)

        def drain(count: int | None = None, final: bool = False) -> Iterator[dict[str, Any]]:
            while pending and (count is None or count > 0):
                n, nbytes = pending[0][4], pending[0][5]
                batch = finish()
                if final and not pending:  # the last batch, copied: nothing more is read
                    source.release_all()
                yield batch
                self.tick(n, nbytes)
                count = None if count is None else count - 1

        pool = ThreadPoolExecutor(threads, thread_name_prefix="shardkit-fill")
        first = True
        try:
            for pieces, carry, n, last in self._batch_pieces():
                plan = plan_batch(source, pieces, first_sample)
                if plan is None:  # ragged fields: collate per sample, after the batches before it
                    yield from drain()
                    batch = self._build_slow(pieces, carry)
                    if last:
                        source.release_all()
                    yield batch
                    self.tick(n, self._served(pieces))
                    continue
                copies = list(prepare(source, plan, Later(pieces, 0, carry, self.runs)))
                outs = [self.buffers.take(nbytes) for nbytes in field_bytes(plan)]
                pending.append((pool.submit(copy_into, copies, outs), plan, outs, copies, n, self._served(pieces)))
                del outs  # the pool sees a buffer as free once only the batch refers to it
                # The first batch goes out once it is copied, not once the batches behind it are
                # planned too: their shards may still be landing (a cold epoch's first batch).
                if len(pending) > 2 * threads or first:
                    first = False
                    yield from drain(1)
            yield from drain(final=True)
        finally:
            for fut, *_ in pending:
                fut.cancel()
            pool.shutdown(wait=True)  # no copy may still read a file the source closes next
            for _, _, _, copies, _, _ in pending:
                done(source, copies)
            pending.clear()

    # ---- cutting and building ---------------------------------------------------------------

    def _served(self, pieces: list[Run]) -> int:
        """The bytes of the fields of a batch's samples (the ``bytes_served`` counter)."""
        return sum(self.source.rows(shard).payload_bytes(p) for shard, p in pieces)

    def _batch_pieces(self) -> Iterator[Pieces]:
        """Cut the run stream into batches: (pieces, the rest of the last run, samples, whether
        it is the last batch). After the last batch nothing more is read, so callers unpin its
        shards before they yield it."""
        runs = self.runs
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

    def _build(self, pieces: list[Run], carry: Run | None) -> dict[str, Any] | RingBatch:
        """One raw batch: a dict of arrays, or (in a worker with a ring) a RingBatch."""
        source = self.source
        plan = plan_batch(source, pieces, self.ds.first_samples)
        if plan is None:
            return self._build_slow(pieces, carry)  # ragged fields: per-sample collate
        window = Later(pieces, 0, carry, self.runs)  # the whole batch stays pinned while it is built
        ring = self.ring
        if ring is not None and self.in_worker:
            sizes = field_bytes(plan)
            slot = ring.acquire(self.worker)
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

    def _build_slow(self, pieces: list[Run], carry: Run | None) -> dict[str, Any]:
        return collate(self._piece_samples(pieces, carry, make_decoder("raw")))

    def _ragged_views(self, pieces: list[Run], carry: Run | None) -> dict[str, Any]:
        # Samples with different fields: the same lists, None where a sample lacks a field.
        samples = self._piece_samples(pieces, carry)
        names = list(dict.fromkeys(f for smp in samples for f in smp if not f.startswith("__")))
        batch: dict[str, Any] = {"__key__": [smp["__key__"] for smp in samples],
                                 "__index__": np.array([smp["__index__"] for smp in samples], np.int64)}
        for f in names:
            batch[f] = [np.frombuffer(smp[f], np.uint8) if f in smp else None for smp in samples]
        return batch

    def _piece_samples(self, pieces: list[Run], carry: Run | None, decoder: Decoder | None = None,
                       pool: ThreadPoolExecutor | None = None) -> list[Any]:
        """The sample dicts of a batch's ``pieces``, their fields views of the held shards, or
        each passed through ``decoder`` (by ``pool``'s threads, if given) while its shard is
        held (a batch may span shards that a small cache cannot hold at once)."""
        source = self.source
        first_sample = self.ds.first_samples
        infos = self.ds.shard_list
        samples: list[dict[str, Any]] = []
        for i, (shard, p) in enumerate(pieces):
            rows = source.rows(shard)
            held = source.get(shard, p, Later(pieces, i + 1, carry, self.runs))
            got = sample_dicts(held.view, held.base, rows, p, int(first_sample[shard]), infos[shard].path)
            samples += got if decoder is None else pool.map(decoder, got) if pool is not None else map(decoder, got)
        return samples
