"""Node-local shard cache shared by every rank and DataLoader worker on a node.

Processes coordinate only through files and ``flock`` (Linux), so a killed process releases
its locks with its file descriptors. Layout of ``cache_dir`` (``limit_bytes`` covers all of it)::

    .global.lock                    flock EX: space accounting (reserve, evict, rename, sweep)
    <ns>/<file>                     verified shards; <file> = percent-quoted shard name
    <ns>/.tmp/<file>.<size>.<pid>   downloads in flight; each counts <size> from its creation
                                    (a positional download has st_size <size> while in flight)
    <ns>/.locks/<file>.pin          flock SH by readers while open, EX|NB by the evictor
    <ns>/.locks/<file>.dl           flock EX by the one process downloading the shard

Lock order is pin -> dl -> global. The global lock is held only for metadata work and tries
other locks only with LOCK_NB, so nobody waits while holding it and nothing can deadlock.
Lock files are never deleted: deleting one would let two processes lock different inodes.
"""

from __future__ import annotations

import bisect
import fcntl
import logging
import mmap
import os
import re
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, Optional, Sequence, cast


from shardkit.cache.files import (
    CacheEntry,
    FileLock,
    ShardRef,
    file_name,
    hash_fd,
    list_with_stat,
    mark_used,
    preallocate,
    stamp_verified,
    unlink_quiet,
    verified_stamp_ns,
)
from shardkit.config import human_bytes
from shardkit.util.procs import pid_alive
from shardkit.errors import (CacheFullError, CacheGoneError, ConfigError, IntegrityError, NoRoomError,
                             StorageStalledError)
from shardkit.cache.kept_maps import KEPT
from shardkit.cache.fill import fill_landing, fill_map, fill_stream
from shardkit.cache.landing import LANDING, Landing
from shardkit.storage.ranged import RangeReader

__all__ = ["ShardRef", "ReaderFor", "ShardCache", "CachedShard"]

log = logging.getLogger(__name__)

_POLL = 0.05
WAIT_NOTE_SECONDS = 30.0  # a reader blocked on a full cache says so this often (until wait_timeout)
# A prefetch that gave up on a stalled store (every retry timed out) this recently: the reader
# opening that shard gets its error instead of spending the whole retry budget again.
STALL_REMEMBERED = 60.0
MAX_AT_ONCE = 8  # downloads one process's prefetch runs at once, at most
_NAMESPACE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_TEMP = re.compile(r"^(?P<file>.+)\.(?P<size>\d+)\.(?P<pid>\d+)$")
_EX_NB = fcntl.LOCK_EX | fcntl.LOCK_NB


ReaderFor = Callable[[ShardRef], RangeReader]
"""``fetch(ref)``: the reader a download of ``ref`` reads its object with (one per attempt).

A sequential reader's bytes go to the temp file front to back, and a download that fails
resumes from what landed; a parallel reader gets the whole shard at once, into a writable map
of the temp file or a landing buffer, and a download that fails starts again from byte 0. The
cache checks size and xxh3-128 of the whole file either way.
"""

# A prefetch carries the files (and sizes) planned before it: it must neither evict them nor
# take their room. None: a reader's own open.
_Prefetch = Optional[Mapping[str, int]]


class _NoRoom(Exception):
    """A prefetch found no room for its shard (see ShardCache.prefetch)."""


class CachedShard:
    """A verified shard on local disk, pinned against eviction until :meth:`close`.

    Attributes:
        ref: the shard.
        path: local file path, valid while the shard is open.
    """

    def __init__(self, ref: ShardRef, path: str, fd: int, pin: FileLock) -> None:
        self.ref, self.path = ref, path
        # The whole file matched the manifest's checksum and is unchanged since (its mtime is
        # the cache's stamp); False only for a cache with verify=False and an unstamped file.
        self.verified = False
        self._fd, self._pin = fd, pin
        self._mmap: mmap.mmap | None = None
        self._view: memoryview | None = None
        # The landing buffer this process fetched the shard into, when it still holds it.
        self._landing: Landing | None = None

    @property
    def hot(self) -> memoryview | None:
        """The shard's verified bytes in this process's landing buffer, while the shard is open
        (``open(landing=True)``, when the buffer still holds them): copy from them, never hand
        out views of them."""
        return self._landing.view() if self._landing is not None else None

    def fileno(self) -> int:
        """The open file (read-only), valid until :meth:`close`: for ``os.preadv`` copies."""
        if self._fd < 0:
            raise ValueError(f"shard {self.ref.name} is closed")
        return self._fd

    def buffer(self, keep: bool = False) -> memoryview:
        """A read-only memoryview of the whole file (mapped on first call).

        ``keep``: map it through the process's kept maps (:mod:`.keptmaps`), so the next
        epoch's reads find the page tables already filled.
        """
        if self._fd < 0:
            raise ValueError(f"shard {self.ref.name} is closed")
        if self._view is None:
            kept = KEPT.get(self.path, self._fd, self.ref.size) if keep else None
            if kept is not None:
                self._view = memoryview(kept)  # not self._mmap: close() leaves a kept map open
                return self._view
            if self.ref.size:
                # No MAP_POPULATE: DataLoader workers take turns in batches, so each reads only
                # part of a shard; mapping all of it in every worker measured slower here.
                self._mmap = mmap.mmap(self._fd, self.ref.size, access=mmap.ACCESS_READ)
            self._view = memoryview(self._mmap if self._mmap is not None else b"")
        return self._view

    def close(self) -> None:
        """Unmap the file and unpin the shard."""
        if self._fd < 0:
            return
        if self._view is not None:
            try:
                self._view.release()
            except BufferError:  # arrays over it are alive (zero-copy batches): they keep it mapped
                pass
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # The caller still holds slices: the mapping lives until they are dropped,
                # and stays valid even if the file is evicted (Linux keeps the inode).
                log.debug("shard %s: buffer slices still alive at close", self.ref.name)
        os.close(self._fd)
        self._fd = -1
        if self._landing is not None:
            LANDING.release(self._landing)
            self._landing = None
        self._pin.release()

    def __enter__(self) -> CachedShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShardCache:
    """Fetch-once, verified, size-bounded shard cache in one directory on a node.

    Args:
        cache_dir: local directory shared by all processes on the node.
        limit_bytes: bound on everything under ``cache_dir`` (all namespaces), counting
            downloads in flight at their full size.
        namespace: short id of the dataset (e.g. a hash of URL + ``created``); a subdirectory.
        verify: check the xxh3 of a cached shard again unless it is unchanged since it was
            verified (any process on the node stamps a verified file's mtime; a write to the
            file changes it). ``False``: trust any cached file of the right size.
        wait_timeout: seconds to wait for readers to unpin space before CacheFullError.
        room_wait: seconds an :meth:`open` waits while the shards readers keep pinned leave
            no room for its shard, before NoRoomError; ``None``: up to ``wait_timeout``. Those
            readers may never let go while this one waits: a rank in a collective waits for
            the rank whose reader waits here. Downloads in flight always end, so a wait for
            them alone goes on.
    """

    def __init__(self, cache_dir: str | os.PathLike[str], limit_bytes: int, *, namespace: str,
                 verify: bool = True, wait_timeout: float = 600.0, room_wait: float | None = None) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
            raise ConfigError(f"cache limit_bytes must be a positive int, got {limit_bytes!r}")
        if not _NAMESPACE.match(namespace):
            raise ConfigError(f"cache namespace must match {_NAMESPACE.pattern}, got {namespace!r}")
        if wait_timeout < 0:
            raise ConfigError(f"cache wait_timeout must be >= 0, got {wait_timeout!r}")
        if room_wait is not None and room_wait < 0:
            raise ConfigError(f"cache room_wait must be >= 0, got {room_wait!r}")
        self._root, self._ns = os.path.abspath(os.fspath(cache_dir)), namespace
        self._limit, self._verify, self._wait_timeout = limit_bytes, verify, wait_timeout
        self._room_wait = room_wait
        try:
            for sub in (".tmp", ".locks"):
                os.makedirs(os.path.join(self._root, namespace, sub), exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cache_dir {self._root} is not usable: {exc}") from exc
        self._mu = threading.Lock()
        self._stats = dict.fromkeys(("hits", "misses", "bytes_fetched", "evictions", "wait_seconds",
                                     "corrupt_refetches", "prefetched", "prefetch_skipped", "landed"), 0.0)
        self._sched: dict[str, list[int]] = {}  # file -> positions in the schedule
        self._sched_files: list[str] = []  # the schedule in order
        self._sched_sizes: dict[str, int] = {}
        # Schedule positions before this one are past; the one at it is the shard last opened,
        # still in use (a reader opens its shard again at every batch when the cache is tight).
        self._cursor = 0
        self._cv = threading.Condition()
        self._plan: list[tuple[ShardRef, ReaderFor, dict[str, int], bool]] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._stalled: dict[str, tuple[float, StorageStalledError]] = {}  # file -> a prefetch's recent give-up
        with self._global():  # sweep partial downloads of dead processes that nobody adopted
            for e in self._scan():
                dl = None
                if e.temp and e.pid and not pid_alive(e.pid):
                    dl = FileLock.try_take(self._lock_path(e.ns, e.file, "dl"), _EX_NB)
                if dl is not None:
                    log.info("cache: removing stale partial download %s", e.path)
                    unlink_quiet(e.path)
                    dl.release()

    def set_schedule(self, upcoming: Sequence[str], sizes: Sequence[int] | None = None) -> None:
        """Tell eviction this process's future need order (shard names, repeats allowed), and
        the shards' sizes if known (a prefetch then leaves room for those needed before it).

        Each :meth:`open` of a scheduled shard moves the cursor to its next position in the
        schedule (the shard counts as needed now until a later one is opened).
        """
        files = [file_name(name) for name in upcoming]
        pos: dict[str, list[int]] = {}
        for i, file in enumerate(files):
            pos.setdefault(file, []).append(i)
        with self._mu:
            self._sched, self._cursor, self._sched_files = pos, 0, files
            self._sched_sizes = {} if sizes is None else dict(zip(files, sizes))

    def open(self, ref: ShardRef, fetch: ReaderFor, landing: bool = False) -> CachedShard:
        """The verified local copy of ``ref``, downloaded if needed, pinned until closed.

        ``landing``: the caller only copies out of the shard, so a positional download may go
        through a landing buffer (:mod:`.landing`), and the shard comes with ``hot`` set while
        this process's landing buffer still holds it.

        Raises:
            ConfigError: the shard is larger than the cache limit.
            IntegrityError: the download disagrees with ``ref`` twice in a row.
            CacheFullError: readers kept too much pinned for ``wait_timeout`` seconds.
            NoRoomError: with ``room_wait``, pinned shards left no room for that long.
            CacheGoneError: the cache directory was removed while in use.
            Whatever ``fetch`` raises (the partial download is kept and resumed next time;
            after a positional fetch the reservation is kept and the next time starts from 0).
        """
        try:
            return self._open(ref, fetch, landing)
        except FileNotFoundError as exc:
            if os.path.isdir(os.path.join(self._root, self._ns, ".locks")):
                raise  # not the cache's own files (a fetch from a local dataset, say)
            # Made again here, its locks would not be the ones other readers hold: stop.
            raise CacheGoneError(f"cache_dir {self._root} was removed while readers used it (a tmp cleaner, "
                                 f"another job's cleanup?): shard {ref.name} cannot be cached; restart the job, "
                                 "which makes the cache again") from exc

    def _open(self, ref: ShardRef, fetch: ReaderFor, landing: bool) -> CachedShard:
        if ref.size < 0:
            raise ConfigError(f"shard {ref.name} has a negative size {ref.size}")
        if ref.size > self._limit:
            raise ConfigError(f"shard {ref.name} is {human_bytes(ref.size)}, larger than cache_limit "
                              f"{human_bytes(self._limit)}; raise cache_limit")
        file = file_name(ref.name)
        with self._mu:
            nxt = self._next_use(file)
            self._cursor = self._cursor if nxt is None else nxt
            stalled = self._stalled.pop(file, None)
        if stalled is not None and time.monotonic() - stalled[0] < STALL_REMEMBERED:
            raise stalled[1]  # a prefetch just spent the whole retry budget on it: not a second one
        KEPT.prune()  # let go of kept maps whose files another process evicted
        pin = FileLock.take(self._lock_path(self._ns, file, "pin"), fcntl.LOCK_SH)
        try:
            fd = self._ensure(ref, fetch, file, None, landing)
        except BaseException:
            pin.release()
            raise
        shard = CachedShard(ref, self._final(file), cast(int, fd), pin)
        st = os.fstat(cast(int, fd))
        shard.verified = st.st_mtime_ns == verified_stamp_ns(ref.checksum)
        if landing and shard.verified:
            shard._landing = LANDING.hot(shard.path, st)
        return shard

    def prefetch(self, refs: Sequence[ShardRef], fetch: ReaderFor, max_ahead: int = 2,
                 landing: bool = False, at_once: int = 1) -> None:
        """Download the first ``max_ahead`` of ``refs``, in order, in background threads,
        ``at_once`` of them at a time (``landing`` as for :meth:`open`).

        Replaces the part of an earlier plan not started yet. A prefetch never waits: it
        skips a shard that another process is downloading, that does not fit, or that would
        evict a shard needed sooner (earlier in ``refs`` or in the schedule), or that would
        take room the plan's earlier shards not in the cache yet need: fetched into room freed
        a moment after those were skipped, it would be evicted again to make room for them
        (with a cache of one or two shards, most shards were fetched twice).
        """
        with self._cv:
            if self._closed:
                return
            plan = [r for r in refs[:max_ahead] if 0 <= r.size <= self._limit]
            self._plan = [(r, fetch, {file_name(q.name): q.size for q in plan[:i]}, landing)
                          for i, r in enumerate(plan)]
            self._threads = [t for t in self._threads if t.is_alive()]
            while len(self._threads) < min(max(1, at_once), MAX_AT_ONCE, len(plan)):
                t = threading.Thread(target=self._prefetch_loop, name="shardkit-cache-prefetch", daemon=True)
                t.start()
                self._threads.append(t)
            self._cv.notify_all()

    def contains(self, ref: ShardRef) -> bool:
        """Whether ``ref`` is in the cache now (it may be evicted right after: open() decides)."""
        return os.path.exists(self._final(file_name(ref.name)))

    def stats(self) -> dict[str, float]:
        """This cache's counters: hits, misses, bytes_fetched, evictions, wait_seconds,
        corrupt_refetches, prefetched, prefetch_skipped, landed (downloads through a landing
        buffer)."""
        with self._mu:
            return dict(self._stats)

    def usage(self) -> int:
        """Bytes counted against the limit now (all namespaces): shards plus reservations."""
        with self._global(fcntl.LOCK_SH):
            return sum(e.size for e in self._scan())

    def close(self) -> None:
        """Stop prefetching (after a download in progress). Open shards stay valid."""
        with self._cv:
            self._closed, self._plan = True, []
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- bookkeeping ----------------------------------------------------------------------

    def _final(self, file: str) -> str:
        return os.path.join(self._root, self._ns, file)

    def _temp(self, file: str, size: int) -> str:
        return os.path.join(self._root, self._ns, ".tmp", f"{file}.{size}.{os.getpid()}")

    def _lock_path(self, ns: str, file: str, kind: str) -> str:
        return os.path.join(self._root, ns, ".locks", f"{file}.{kind}")

    @contextmanager
    def _global(self, op: int = fcntl.LOCK_EX) -> Iterator[None]:
        lock = FileLock.take(os.path.join(self._root, ".global.lock"), op)
        try:
            yield
        finally:
            lock.release()

    def _add(self, key: str, value: float = 1.0) -> None:
        with self._mu:
            self._stats[key] += value

    def _next_use(self, file: str) -> int | None:
        positions = self._sched.get(file, [])
        k = bisect.bisect_left(positions, self._cursor)
        return positions[k] if k < len(positions) else None

    def _scan(self) -> list[CacheEntry]:
        """Every file that counts against the limit (global lock held, so it is exact)."""
        out: list[CacheEntry] = []
        for ns, _ in list_with_stat(self._root):
            if ns.name.startswith(".") or not ns.is_dir(follow_symlinks=False):
                continue
            for e, st in list_with_stat(ns.path):
                if not e.is_dir(follow_symlinks=False):
                    out.append(CacheEntry(e.path, ns.name, e.name, st.st_size, st.st_atime_ns, False))
            for t, st in list_with_stat(os.path.join(ns.path, ".tmp")):
                m = _TEMP.match(t.name)
                file, size, pid = (m["file"], int(m["size"]), int(m["pid"])) if m else (t.name, 0, 0)
                out.append(CacheEntry(t.path, ns.name, file, max(st.st_size, size), st.st_mtime_ns, True, pid))
        return out

    # ---- the download path ---------------------------------------------------------------

    def _open_final(self, ref: ShardRef, file: str) -> tuple[str, int | None]:
        """("ok", fd) for a good cached copy, else ("missing", None) or ("corrupt", None)."""
        try:
            fd = os.open(self._final(file), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return "missing", None
        try:
            st = os.fstat(fd)
            if st.st_size == ref.size:
                stamped = st.st_mtime_ns == verified_stamp_ns(ref.checksum)
                if stamped or (self._verify and hash_fd(fd, ref.size) == ref.checksum.lower()):
                    stamp_verified(fd, ref.checksum)
                    return "ok", fd
                if not self._verify:  # trusted by size alone: used, but not stamped as verified
                    mark_used(fd, st.st_mtime_ns)
                    return "ok", fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return "corrupt", None

    def _ensure(self, ref: ShardRef, fetch: ReaderFor, file: str, prefetch: _Prefetch,
                landing: bool) -> int | None:
        """An fd of the verified shard (its pin held by the caller); None if a prefetch skips."""
        state, fd = self._open_final(ref, file)
        downloaded = False
        if state != "ok":
            t0 = time.monotonic()
            dl = FileLock.try_take(self._lock_path(self._ns, file, "dl"),
                                fcntl.LOCK_EX | (0 if prefetch is None else fcntl.LOCK_NB))
            if dl is None:  # another process is downloading it: prefetch enough
                self._add("prefetch_skipped")
                return None
            try:
                self._add("wait_seconds", time.monotonic() - t0)
                state, fd = self._open_final(ref, file)  # it may have arrived while we waited
                if state == "corrupt":
                    log.warning("cache: shard %s is corrupt on disk; fetching it again", ref.name)
                    with self._global():
                        unlink_quiet(self._final(file))
                    self._add("corrupt_refetches")
                if state != "ok":
                    self._download(ref, fetch, file, prefetch, landing)
                    downloaded = True
                    state, fd = self._open_final(ref, file)
            finally:
                dl.release()
            if state != "ok":
                raise IntegrityError(f"shard {ref.name}: verified download vanished from {self._final(file)}")
        if prefetch is not None:
            self._add("prefetched", float(downloaded))
        else:
            self._add("misses" if downloaded else "hits")
        return fd

    def _download(self, ref: ShardRef, fetch: ReaderFor, file: str, prefetch: _Prefetch,
                  landing: bool) -> None:
        """Fetch, verify and publish ``ref`` (download lock held); _NoRoom if a prefetch finds
        no room for it."""
        got = self._reserve(ref, file, prefetch)
        if got is None:
            raise _NoRoom(ref.name)
        tmp, start = got
        fetched = self._fetched
        for attempt in (1, 2):
            reader = fetch(ref)
            if reader.parallel:
                start = 0  # a partial file of parts landed out of order cannot be resumed from its length
            fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
            buf = LANDING.take(ref.size) if reader.parallel and landing else None  # pinned until published
            try:
                if attempt == 2:  # from scratch
                    os.ftruncate(fd, 0)
                    preallocate(fd, ref.size)
                if buf is not None:
                    pos, digest = fill_landing(reader, ref, fd, tmp, buf, fetched)
                elif reader.parallel:
                    pos, digest = fill_map(reader, ref, fd, fetched)
                else:
                    pos, digest = fill_stream(reader, ref, fd, start, fetched)
                if pos == ref.size and digest == ref.checksum.lower():
                    stamp_verified(fd, ref.checksum)
                    with self._global():
                        os.replace(tmp, self._final(file))
                    if buf is not None:
                        LANDING.publish(buf, self._final(file), os.fstat(fd))  # unpins it
                        buf = None
                        self._add("landed", 1.0)
                    return
            finally:
                if buf is not None:
                    LANDING.release(buf)
                os.close(fd)
            log.warning("cache: shard %s: got %d bytes with xxh3 %s from byte %d (attempt %d); the "
                        "manifest says %d bytes with %s", ref.name, pos, digest, start,
                        attempt, ref.size, ref.checksum)
            start = 0
        with self._global():
            unlink_quiet(tmp)
        raise IntegrityError(f"shard {ref.name}: download does not match the manifest (size {ref.size}, "
                             f"xxh3 {ref.checksum}) twice; last got {pos} bytes with xxh3 {digest}")

    def _fetched(self, nbytes: int) -> None:
        self._add("bytes_fetched", float(nbytes))

    def _reserve(self, ref: ShardRef, file: str, prefetch: _Prefetch) -> tuple[str, int] | None:
        """A temp file that counts ``ref.size``, and the bytes already in it.

        Waits (polling) while readers pin the space; a prefetch returns None instead.
        NoRoomError after ``room_wait`` seconds if the pinned shards alone leave no room.
        """
        t0 = time.monotonic()
        next_note = t0 + WAIT_NOTE_SECONDS
        try:
            while True:
                with self._global():
                    got = self._adopt(ref, file)
                    if got is not None:
                        return got
                    entries = self._scan()
                    excess = sum(e.size for e in entries) + ref.size - self._limit
                    if prefetch is not None:
                        excess += self._room_for_sooner(file, prefetch, entries)
                    blockers = self._evict(entries, excess, file, prefetch) if excess > 0 else None
                    if blockers is None:
                        tmp = self._temp(file, ref.size)
                        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                        preallocate(fd, ref.size)
                        os.close(fd)
                        return tmp, 0
                waited = time.monotonic() - t0
                if prefetch is not None:
                    return None
                pinned = [e for e in blockers or [] if not e.temp]
                if (self._room_wait is not None and waited >= self._room_wait
                        and sum(e.size for e in pinned) + ref.size > self._limit):
                    raise NoRoomError(
                        f"cache_limit {human_bytes(self._limit)}: {len(pinned)} shards in use by readers on this node hold "
                        f"{human_bytes(sum(e.size for e in pinned))}, no room for {ref.name} ({human_bytes(ref.size)}) "
                        f"after {waited:.1f} s in {self._root}")
                if waited >= self._wait_timeout:
                    flight = [e for e in blockers or [] if e.temp]
                    raise CacheFullError(
                        f"cache_limit {human_bytes(self._limit)} too small: {len(pinned)} shards in use by readers "
                        f"hold {human_bytes(sum(e.size for e in pinned))} and {len(flight)} downloads in flight "
                        f"reserve {human_bytes(sum(e.size for e in flight))}; need {human_bytes(ref.size)} for {ref.name} "
                        f"(waited {waited:.1f} s in {self._root})")
                if time.monotonic() >= next_note:  # a reader paused or slow elsewhere on the node: say so
                    next_note += WAIT_NOTE_SECONDS
                    log.warning("cache: %s waits %.0f s for room in %s: readers on this node keep %d shards "
                                "open (cache_limit too small for them, or a paused or stopped process?); "
                                "CacheFullError after %.0f s",
                                ref.name, waited, self._root, sum(1 for e in blockers or [] if not e.temp),
                                self._wait_timeout)
                time.sleep(_POLL)
        finally:
            if time.monotonic() - t0 >= _POLL:  # count waiting, not the usual quick pass
                self._add("wait_seconds", time.monotonic() - t0)

    def _room_for_sooner(self, file: str, prefetch: Mapping[str, int], entries: list[CacheEntry]) -> int:
        """Bytes the shards this process needs before ``file`` will take, those not in the
        cache yet: the prefetch plan's earlier shards, and the scheduled ones up to ``file``'s
        next use (the shard a reader is about to open itself is in no prefetch plan)."""
        need = dict(prefetch)
        with self._mu:
            mine = self._next_use(file)
            for f in self._sched_files[self._cursor:mine] if mine is not None else ():
                need.setdefault(f, self._sched_sizes.get(f, 0))
        present = {e.file for e in entries if e.ns == self._ns}
        return sum(size for f, size in need.items() if f != file and f not in present)

    def _adopt(self, ref: ShardRef, file: str) -> tuple[str, int] | None:
        """Take over a partial download of ``ref`` left by any process (global and download
        locks held, so nobody writes it); return it under this pid's name, with its length."""
        found = None
        for t, st in list_with_stat(os.path.join(self._root, self._ns, ".tmp")):
            m = _TEMP.match(t.name)
            if m is not None and m["file"] == file:
                if found is None and int(m["size"]) == ref.size and st.st_size <= ref.size:
                    found = t.path, st.st_size
                else:
                    unlink_quiet(t.path)
        if found is None:
            return None
        mine = self._temp(file, ref.size)
        os.replace(found[0], mine)
        return mine, found[1]

    def _evict(self, entries: list[CacheEntry], excess: int, file: str, prefetch: _Prefetch) -> list[CacheEntry] | None:
        """Delete unpinned files until ``excess`` bytes are free (global lock held).

        Order: abandoned partial downloads, then shards not in this process's schedule (least
        recently used first), then scheduled shards, furthest next use first. Returns None on
        success, else (having deleted nothing) the files that could not be evicted.
        """
        with self._mu:
            uses = {e.file: self._next_use(e.file) for e in entries if e.ns == self._ns}
            mine = self._next_use(file)
        ranked: list[tuple[tuple[int, int], CacheEntry]] = []
        for e in entries:
            nxt = uses.get(e.file) if e.ns == self._ns else None
            if e.temp:
                ranked.append(((0, e.last_use), e))
            elif prefetch is not None and e.ns == self._ns and e.file in prefetch:
                continue
            elif nxt is None:
                ranked.append(((1, e.last_use), e))
            elif prefetch is None or (mine is not None and nxt > mine):
                ranked.append(((2, -nxt), e))
        ranked.sort(key=lambda r: r[0])
        held: list[tuple[CacheEntry, FileLock]] = []
        blockers: list[CacheEntry] = []
        freed = 0
        try:
            for _, e in ranked:
                if freed >= excess:
                    break
                lock = FileLock.try_take(self._lock_path(e.ns, e.file, "dl" if e.temp else "pin"), _EX_NB)
                if lock is None:
                    blockers.append(e)
                else:
                    held.append((e, lock))
                    freed += e.size
            if freed < excess:
                return blockers
            for e, _ in held:
                log.debug("cache: evicting %s (%d bytes)", e.path, e.size)
                KEPT.forget(e.path)  # a map kept in this process would keep the disk space
                LANDING.forget(e.path)
                unlink_quiet(e.path)
                self._add("evictions", float(not e.temp))
            return None
        finally:
            for _, lock in held:
                lock.release()

    def _prefetch_loop(self) -> None:
        while True:
            with self._cv:
                while not self._plan and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                ref, fetch, earlier, landing = self._plan.pop(0)
            file = file_name(ref.name)
            pin = FileLock.try_take(self._lock_path(self._ns, file, "pin"), fcntl.LOCK_SH | fcntl.LOCK_NB)
            if pin is None:  # being evicted this instant
                self._add("prefetch_skipped")
                continue
            try:
                fd = self._ensure(ref, fetch, file, earlier, landing)
                if fd is not None:
                    os.close(fd)
            except _NoRoom:
                self._add("prefetch_skipped")
            except Exception as exc:  # the foreground open retries (and resumes) it, unless the store stalled
                log.warning("cache: prefetch of %s failed: %s", ref.name, exc)
                if isinstance(exc, StorageStalledError):
                    with self._mu:
                        self._stalled[file] = (time.monotonic(), exc)
            finally:
                pin.release()
