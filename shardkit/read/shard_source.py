"""Getting shard bytes to a reader: through the node cache, or straight from storage.

Either way a reader gets a memoryview over the bytes of the samples it needs plus the
shard offset that view starts at, so samples are sliced with the manifest's offsets and
never parsed from tar headers. Bytes are verified before any sample is yielded: the cache
checks the whole shard's xxh3-128; a direct read (without a cache) reads a segment of the
shard (the samples this reader needs, see segments) and checks each of those samples' xxh3-64
as the segment arrives.

A :class:`ShardSource` keeps the shards (or segments) of the reader's look-ahead window open,
so a shuffled run of one sample costs a dict lookup, not an open/flock/mmap.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence, Union

import numpy as np
import xxhash

from shardkit.storage import ranged

from shardkit.read import segments
from shardkit.cache.shard_cache import ShardCache, ShardRef
from shardkit.errors import CacheLockedError, IntegrityError, NoRoomError
from shardkit.read.dataset import Dataset
from shardkit.read.cache_fetches import CacheFetches
from shardkit.read.held import Held, open_held
from shardkit.read.rows import FieldLayout, ShardInfo, ShardRows
from shardkit.read.verify import verify_samples
from shardkit.read.segments import SegmentPlanner
from shardkit.storage.retry import backoff_delay
from shardkit.storage.store import Store

__all__ = ["FETCH_CONCURRENCY", "FETCH_PART_SIZE", "HeldKey", "JOIN_BELOW", "Run", "STREAM_RUN", "ShardSource"]

log = logging.getLogger(__name__)

Run = tuple[int, np.ndarray]
# What a source holds open: a cached shard (its id), or a (shard, segment) read without a cache.
HeldKey = Union[int, tuple[int, int]]

# Reads without a cache: segments (see segments) fetched at once per reader, and read ahead.
# Segments can be small (a worker's batch of small samples), so a few run in parallel.
READ_AHEAD_THREADS = 4
MAX_READS_AHEAD = 16
# Reads of a segment whose samples fail their checksums, before it counts as corrupt on storage
# (a byte flipped in transit is gone on the next read).
SEGMENT_READS = 3
# A reader waits config.room_wait() seconds for cache room that shards pinned by other readers
# on the node hold, then reads the shard from storage without caching it. Those readers may not
# let go while it waits: a DDP rank whose reader sits on its shard while the training loop is in
# a collective waits for this rank's step. A few seconds covers a reader finishing its batch;
# anything longer means cache_limit is too small for the node.
_warned_no_room = False
_warned_locked = False
# Cold cache downloads from S3 (boto3 transport): ranged GETs of FETCH_PART_SIZE, up to
# FETCH_CONCURRENCY at a time per shard, read with readinto straight into the map of the temp
# file or a landing buffer (one copy from the socket), faster than one stream written through
# a file (see benchmarks/RESULTS.md). More parts at a time did not help on loopback; real S3
# caps each connection well below the link, so raise FETCH_CONCURRENCY there.
FETCH_PART_SIZE = 16 * 2**20
FETCH_CONCURRENCY = 2
# Past its first samples, a streaming reader follows a shard's download only while less than this
# part of it has landed; else it waits for the whole shard (see ShardCache.open's join_below).
JOIN_BELOW = 0.5
# Samples a reader asks for at once (a run of its schedule) when it reads samples one by one:
# those of a shard still landing are waited for together.
STREAM_RUN = 256


class ShardSource(CacheFetches):
    """Opens shards (or the byte span of the samples needed) for one reader process.

    Args:
        ds: the dataset.
        cache: the node cache, or None to read from storage directly.
        prefetch: shards fetched ahead of need (cache downloads or read-ahead spans).
        max_open: shards held open at once (pins count against the cache limit).
    """

    def __init__(self, ds: Dataset, cache: ShardCache | None, prefetch: int = 2, max_open: int = 8) -> None:
        self.ds = ds
        self.store: Store = ds.store
        self.cache = cache
        self.prefetch = prefetch
        self.max_open = max(1, max_open)
        self.bytes_fetched = 0  # read around the cache, or without one
        self._fetched_mu = threading.Lock()
        self.downloads = ranged.ByteCounter()  # what cache downloads moved (the prefetch thread's too)
        self._ranged: bool | None = None  # S3 through boto3: cache downloads use ranged GETs
        self.direct_reads = 0
        self.segment_rereads = 0  # segments read again after a failed check (see _read_segment)
        self.uncached_reads = 0  # shards read around a cache that had no room (see read_uncached)
        self.wait_seconds = 0.0
        self._held: dict[HeldKey, Held] = {}  # by shard, or (shard, segment) without a cache
        self._closing: list[Held] = []  # let go of, but a copy in another thread still reads it
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[tuple[int, int], Future[memoryview]] = {}  # segments read ahead (no cache)
        # Without a cache: which byte segments of each shard this reader reads (set by the reader).
        self.segment_plan: SegmentPlanner | None = None
        self.verify = True  # check each sample read without a cache (the cache checks its shards)
        # Segments' worth of bytes read ahead without a cache: ``prefetch``, or with a shuffle
        # the block's shards too (a shuffle needs all of them at once: reading them a few at a
        # time left the reader waiting on each in turn; set by the reader).
        self.ahead_segments = prefetch
        # Keep cached shards' maps across epochs (zero-copy reads; see keptmaps).
        self.keep_maps = False
        # The reader only copies members out of held shards (raw batches): cold downloads may
        # land in memory first and be copied from there (see landing).
        self.landing = False
        # Cache downloads running at once (prefetch threads): more than one only where this
        # process is the node's one reader of its shards (see StreamingDataset._prefetch).
        self.at_once = 1
        # Read a cold shard's samples as they land and check out, not once the whole shard did
        # (see cache.streamed); not for zero-copy batches, whose views outlive the reader's waits.
        self.stream = False
        # Until the reader's first samples are out, only their shard is fetched (see plan).
        self._head_start = False
        self._first_in = False  # the first get() has returned
        self._upcoming: Sequence[int] = ()

    # ---- manifest rows --------------------------------------------------------------------

    def rows(self, shard: int) -> ShardRows:
        """The manifest rows of ``shard`` (:meth:`Dataset.cached_rows`).

        Args:
            shard: the shard id.

        Returns:
            The shard's rows.

        Raises:
            IndexError: there is no such shard.
            ManifestError: its rows are unreadable, or another number than shards.parquet lists.
            StorageError: its samples fragment could not be read.
        """
        # Kept per process and dataset, not per source: persistent workers open a new source
        # every epoch, and the manifest rows of a shard never change.
        return self.ds.cached_rows(shard)

    def layout(self, shard: int) -> FieldLayout | None:
        """The field layout of ``shard`` (:attr:`ShardRows.layout`).

        Args:
            shard: the shard id.

        Returns:
            Its :class:`FieldLayout`, or None when it has none (its samples' fields differ).

        Raises:
            ManifestError: its rows are unreadable (see :meth:`rows`).
            StorageError: its samples fragment could not be read.
        """
        return self.rows(shard).layout

    # ---- cache downloads (the plan: see CacheFetches) ---------------------------------------

    def fetch(self, ref: ShardRef) -> ranged.RangeReader:
        """The reader the cache downloads ``ref`` with (a :data:`~shardkit.cache.shard_cache.ReaderFor`).

        S3 with the boto3 transport: a parallel reader, ranged GETs of ``FETCH_PART_SIZE``,
        ``FETCH_CONCURRENCY`` at a time, each part resumed on its own after a transient fault.
        Anything else: one sequential stream, resumed by the cache from what landed.

        Args:
            ref: the shard.

        Returns:
            A new reader of the shard's object; both count into :attr:`downloads`.
        """
        if self._ranged is None:
            self._ranged = ranged.choose_transport(self.store) == "boto3"
        if self._ranged:
            return ranged.RangedReader(self.store, ref.name, part_size=FETCH_PART_SIZE, concurrency=FETCH_CONCURRENCY,
                                       transport="boto3", counter=self.downloads)
        return ranged.StreamReader(self.store, ref.name, ref.size, counter=self.downloads)

    # ---- holding bytes --------------------------------------------------------------------

    def get(self, shard: int, positions: np.ndarray, window: Sequence[Run]) -> Held:
        """Bytes covering samples ``positions`` of ``shard``; ``window`` is the runs after it.
        Without a cache, the runs come from ``SegmentPlanner.split``: each lies inside one segment.

        Held bytes the window no longer needs are let go of first (and, with a cache, the
        oldest beyond ``max_open``); without a cache, the window's next segments are read ahead.

        Args:
            shard: the shard id.
            positions: in-shard positions of the samples wanted (one segment's, without a cache).
            window: the runs that follow, in need order.

        Returns:
            The bytes, held until a later call lets go of them (as above), or
            :meth:`release_all` or :meth:`close` does.

        Raises:
            IntegrityError: the bytes disagree with the manifest (a cache download, twice in a
                row; a shard read around a full cache; a sample read without a cache).
            StorageError: storage faults outlasted the retries.
            CacheFullError: readers kept the node cache pinned too long (see
                :meth:`shardkit.cache.shard_cache.ShardCache.open`).
            CacheGoneError: the cache directory was removed while in use.
            ConfigError: the shard is larger than the cache limit.
            AssertionError: without a cache: no segment plan, or ``positions`` from several
                segments (a caller's bug).
        """
        if self._head_start and self._first_in:
            self.started()  # asked for more than the first samples: they are out by now
        key = self._key(shard, positions)
        held = self._held.get(key)
        if held is not None:
            if held.landing is None:
                return held
            t0 = time.perf_counter()
            try:
                landed = held.landing.wait(positions)
            except NoRoomError as exc:  # another process's download stalled: read around the cache
                self._drop(key)
                held = self._held[key] = Held(0, self.ds.shard_list[shard].bytes, data=self.read_uncached(shard, exc))
                return held
            finally:
                self.wait_seconds += time.perf_counter() - t0
            if landed:
                return held
            self._drop(key)  # its download's attempt ended: open the shard again
        upcoming = self._keys(window)  # once: release and read-ahead both walk it
        self.release(upcoming)
        t0 = time.perf_counter()
        if self.cache is not None:
            held = self._open_cached(shard, positions)
        else:
            assert isinstance(key, tuple)
            held = self._direct(key)
        self.wait_seconds += time.perf_counter() - t0
        self._held[key] = held
        if self.cache is None:
            self._read_ahead(upcoming)
        self._first_in = True
        return held

    def _open_cached(self, shard: int, positions: np.ndarray) -> Held:
        """Shard ``shard`` from the cache (see :func:`open_held`), or read around it."""
        ref = self._ref(shard)
        first = int(ref.samples.offsets[positions].min()) if ref.samples is not None and len(positions) else 0
        try:
            assert self.cache is not None
            # Past its first samples a reader joins only downloads that have most of the way to go
            # (see ShardCache.open's join_below): it would wait for the rest anyway.
            return open_held(self.cache, ref, self.fetch, positions, first, landing=self.landing,
                             stream=self.stream, keep_map=self.keep_maps,
                             join_below=1.0 if self._head_start or not self._first_in else JOIN_BELOW)
        except NoRoomError as exc:
            return Held(0, ref.size, data=self.read_uncached(shard, exc))

    def _keys(self, window: Sequence[Run]) -> Sequence[HeldKey]:
        """What the runs of ``window`` need held, in need order (see :meth:`_key`)."""
        if self.segment_plan is not None:
            return self.segment_plan.segments_of(window)
        return [s for s, _ in window]

    def _key(self, shard: int, positions: np.ndarray) -> HeldKey:
        """What is held: a cached shard, or a (shard, segment) read without the cache."""
        if self.cache is not None:
            return shard
        seg = self._segments(shard, positions)
        if (seg != seg[0]).any():  # a caller's bug; slicing the wrong segment would give wrong bytes
            raise AssertionError(f"shardkit: samples of shard {shard} from several segments asked for as one")
        return shard, int(seg[0])

    def _segments(self, shard: int, positions: np.ndarray) -> np.ndarray:
        if self.segment_plan is None:
            raise AssertionError("shardkit: a ShardSource without a cache needs its segment plan")
        return self.segment_plan.plan(shard).of(positions)

    def held_groups(self, shard: int, positions: np.ndarray) -> Sequence[slice | np.ndarray]:
        """Index groups of ``positions`` (of ``shard``) that one :meth:`get` each can serve:
        all of them with a cache, one group per segment without.

        Args:
            shard: the shard id.
            positions: in-shard positions.

        Returns:
            Indexes into ``positions``: ``[slice(None)]`` when one :meth:`get` serves them
            all, else one array of indexes per segment.

        Raises:
            AssertionError: without a cache: no segment plan, or a position the plan does not
                hold (a caller's bug).
        """
        if self.cache is not None:
            return [slice(None)]
        seg = self._segments(shard, positions)
        if (seg == seg[0]).all():
            return [slice(None)]
        order = np.argsort(seg, kind="stable")
        cuts = np.flatnonzero(np.diff(seg[order])) + 1
        return np.split(order, cuts)

    def release_all(self) -> None:
        """Unpin every held shard (bytes already handed out stay valid: they are copies, or
        views that keep their mapping alive). Bytes held in memory pin nothing and stay (a
        shard read around the cache would otherwise be read again for the next batch)."""
        for key in [key for key, held in self._held.items() if held.handle is not None]:
            self._drop(key)

    def release(self, upcoming: Sequence[HeldKey]) -> None:
        """Close held shards (segments) not in ``upcoming`` (and the oldest shards beyond
        ``max_open``).

        Args:
            upcoming: what the next runs need held (see :data:`HeldKey`): shard ids with a
                cache, (shard, segment) pairs without.
        """
        if not self._held:
            return
        needed = set(upcoming)
        for key in [key for key in self._held if key not in needed]:
            self._drop(key)
        while self.cache is not None and len(self._held) >= self.max_open:
            self._drop(next(iter(self._held)))

    def _drop(self, key: HeldKey) -> None:
        held = self._held.pop(key)
        if held.users:
            self._closing.append(held)  # stays open and pinned until settle() sees it unused
        else:
            held.close()

    def settle(self) -> None:
        """Close the shards let go of whose last in-flight copy has finished."""
        if self._closing:
            busy = [h for h in self._closing if h.users]
            for h in self._closing:
                if not h.users:
                    h.close()
            self._closing = busy

    def read_uncached(self, shard: int, why: NoRoomError) -> memoryview:
        """The whole shard read from storage into memory, past a cache whose room other
        readers' pins hold (or whose lock a stopped process holds: CacheLockedError), and
        checked like a cache download (size and xxh3-128).

        Args:
            shard: the shard's index.
            why: why the cache did not take it (said in the log).

        Returns:
            The shard's bytes.

        Raises:
            IntegrityError: the bytes read disagree with the manifest.
            StorageError: storage faults outlasted the retries.
        """
        global _warned_no_room, _warned_locked
        info = self.ds.shard_list[shard]
        if isinstance(why, CacheLockedError):
            # A warning the first time (it names the stuck process), then one line at info level per shard.
            log.log(logging.INFO if _warned_locked else logging.WARNING, "%s", why)
            _warned_locked = True
        elif not _warned_no_room:
            _warned_no_room = True
            log.warning("%s; reading it from storage without caching it (as any shard that finds no room): "
                        "cache_limit is too small for the readers on this node (ranks x DataLoader workers, "
                        "each holding a shard); raise cache_limit", why)
        data = ranged.read_range(self.store, info.path, 0, info.bytes, FETCH_PART_SIZE, FETCH_CONCURRENCY)
        view = memoryview(data)  # type: ignore[arg-type]  # numpy arrays are buffers
        with self._fetched_mu:
            self.bytes_fetched += len(view)
            self.uncached_reads += 1
        if xxhash.xxh3_128_hexdigest(view) != info.checksum.lower():
            raise IntegrityError(f"shard {info.path}: read from storage (the cache had no room), its "
                                 f"{info.bytes} bytes do not match the manifest's xxh3 {info.checksum}")
        return view

    # ---- direct (no cache) reads ----------------------------------------------------------

    def _direct(self, key: tuple[int, int]) -> Held:
        ahead = self._ahead.pop(key, None)
        data = ahead.result() if ahead is not None else self._read_segment(*self._segment_job(key))
        return Held(*self._bounds(key), data=data)  # its samples were checked as it was read

    def _bounds(self, key: tuple[int, int]) -> tuple[int, int]:
        assert self.segment_plan is not None
        return self.segment_plan.plan(key[0]).bounds(key[1])

    def _segment_job(self, key: tuple[int, int]) -> tuple[ShardInfo, ShardRows, np.ndarray, int, int]:
        """What reading segment ``key`` takes, gathered in the reader's own thread (the
        manifest memos are not shared with the read-ahead threads)."""
        assert self.segment_plan is not None
        shard, seg = key
        plan = self.segment_plan.plan(shard)
        lo, hi = plan.bounds(seg)
        return self.ds.shard_list[shard], self.rows(shard), plan.members(seg), lo, hi

    def _read_segment(self, info: ShardInfo, rows: ShardRows, positions: np.ndarray, lo: int, hi: int) -> memoryview:
        """Shard bytes ``[lo, hi)``, each sample of ``positions`` checked (xxh3-64) as they
        arrive: in a read-ahead thread, off the training loop's path.

        A segment that fails a check is read again (up to :data:`SEGMENT_READS` reads, with
        backoff): a byte flipped in transit is gone on the next read, as the cache's and
        random access's re-reads find; one that fails every read is corrupt on storage."""
        where = f"shard {info.shard} ({info.path})"
        for attempt in range(1, SEGMENT_READS + 1):
            # Ranged GETs of FETCH_PART_SIZE, FETCH_CONCURRENCY at a time, read straight into one
            # buffer: a segment of one 300 MB sample arrives in parallel parts, copied once.
            data = ranged.read_range(self.store, info.path, lo, hi, FETCH_PART_SIZE, FETCH_CONCURRENCY)
            with self._fetched_mu:
                self.bytes_fetched += len(data)
                self.direct_reads += 1
            view = memoryview(data)  # type: ignore[arg-type]  # numpy arrays are buffers
            if not self.verify:
                return view
            try:
                verify_samples(view, lo, rows, positions, where)
                return view
            except IntegrityError as exc:
                if attempt == SEGMENT_READS:
                    raise IntegrityError(f"{exc}, on each of {SEGMENT_READS} reads of bytes [{lo}, {hi}): corrupt on "
                                         f"storage; shardkit verify --deep {self.ds.url} lists every bad shard") from exc
                log.warning("%s; reading bytes [%d, %d) of it again (read %d of %d)", exc, lo, hi, attempt,
                            SEGMENT_READS)
                with self._fetched_mu:
                    self.segment_rereads += 1
                time.sleep(backoff_delay(attempt))
        raise AssertionError("unreachable")  # the loop returns or raises

    def _read_ahead(self, upcoming: Sequence[HeldKey]) -> None:
        """Start reading the ``upcoming`` segments in need order, up to ``ahead_segments``
        segments' worth of bytes (``SEGMENT_BYTES`` each) in flight or waiting, and at least one."""
        if not self.prefetch or not upcoming:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(self.prefetch, READ_AHEAD_THREADS),
                                            thread_name_prefix="shardkit-readahead")
        budget = max(self.ahead_segments, 1) * segments.SEGMENT_BYTES
        pending = sum(hi - lo for lo, hi in map(self._bounds, self._ahead))
        for key in upcoming:
            if key in self._held or key in self._ahead:
                continue
            assert isinstance(key, tuple)
            lo, hi = self._bounds(key)
            if (self._ahead and pending + (hi - lo) > budget) or len(self._ahead) >= MAX_READS_AHEAD:
                break
            self._ahead[key] = self._pool.submit(self._read_segment, *self._segment_job(key))
            pending += hi - lo

    # ---- end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close everything. The caller has stopped its copy threads first."""
        for shard in list(self._held):
            self._drop(shard)
        for h in self._closing:
            h.close()
        self._closing = []
        for fut in self._ahead.values():
            fut.cancel()
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self.cache is not None:
            self.cache.close()

    def stats(self) -> dict[str, float]:
        """Counters of this source: bytes fetched from storage, cache counters, waits.

        Returns:
            Counter name -> value: ``bytes_fetched``, ``direct_reads``, ``uncached_reads``,
            ``wait_seconds`` (time :meth:`get` waited for bytes), and the cache's counters (zero
            without a cache; its ``wait_seconds`` as ``cache_wait_seconds``).
        """
        out: dict[str, float] = {"bytes_fetched": float(self.bytes_fetched + self.downloads.bytes),
                                 "direct_reads": float(self.direct_reads),
                                 "uncached_reads": float(self.uncached_reads),
                                 "segment_rereads": float(self.segment_rereads),
                                 "hits": 0.0, "misses": 0.0, "evictions": 0.0, "prefetched": 0.0, "streamed": 0.0,
                                 "corrupt_refetches": 0.0, "prefetch_skipped": 0.0, "cache_wait_seconds": 0.0,
                                 "lock_fallbacks": 0.0}
        if self.cache is not None:
            cs = self.cache.stats()
            for k, v in cs.items():
                out["cache_wait_seconds" if k == "wait_seconds" else k] = float(v)
        out["wait_seconds"] = self.wait_seconds
        return out
