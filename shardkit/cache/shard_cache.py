"""The node-local shard cache shared by every rank and DataLoader worker on a node: each shard
is fetched once, verified whole, and kept within a byte limit.

The pieces: :mod:`.layout` (the files and locks in ``cache_dir``), :mod:`.room` (reserving
room, evicting), :mod:`.schedule` (this process's need order), :mod:`.fill` (filling a temp file
from a :class:`~shardkit.storage.ranged.RangeReader`), :mod:`.prefetch` (background downloads),
:mod:`.cached_shard` (what :meth:`ShardCache.open` returns) and :mod:`.streamed` (shards read
while they land: what ``open(stream=True)`` returns before the shard is whole).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import threading
import time
from typing import Callable, Sequence, cast

from shardkit.cache.cached_shard import CachedShard
from shardkit.cache.files import (FileLock, ShardRef, file_name, hash_fd, mark_used, stamp_verified, unlink_quiet,
                                  verified_stamp_ns)
from shardkit.cache.attempt import attempt
from shardkit.cache.kept_maps import KEPT
from shardkit.cache.landing import LANDING
from shardkit.cache.layout import CacheDir, no_space_errno
from shardkit.cache.landing_shard import LandingShard
from shardkit.cache.lock_wait import clear_owner, wait_lock, write_owner
from shardkit.cache.prefetch import Prefetcher
from shardkit.cache.room import Planned, Room
from shardkit.cache.schedule import Schedule
from shardkit.cache.streamed import Streams
from shardkit.config import human_bytes
from shardkit.config import lock_wait as lock_wait_seconds
from shardkit.errors import (CacheGoneError, CacheLockedError, ConfigError, IntegrityError, ShardkitError, StorageError,
                             StorageStalledError)
from shardkit.storage.ranged import RangeReader

__all__ = ["ShardRef", "ReaderFor", "ShardCache", "CachedShard", "LandingShard", "STALL_REMEMBERED"]

log = logging.getLogger(__name__)

# A prefetch that gave up on a stalled store (every retry timed out) this recently: the reader
# opening that shard gets its error instead of spending the whole retry budget again.
STALL_REMEMBERED = 60.0

ReaderFor = Callable[[ShardRef], RangeReader]
"""``fetch(ref)``: the reader a download of ``ref`` reads its object with (one per attempt).

A sequential reader's bytes go to the temp file front to back, and a download that fails
resumes from what landed; a parallel reader gets the whole shard at once, into a writable map
of the temp file or a landing buffer, and a download that fails starts again from byte 0, in a
new temp file. The cache checks size and xxh3-128 of the whole file either way.
"""


class _NoRoom(Exception):
    """A prefetch found no room for its shard (see ShardCache.prefetch)."""


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
        lock_wait: seconds an :meth:`open` waits for a lock (a shard's download, the space
            accounting) whose holder makes no progress (a stopped process), before
            CacheLockedError (the caller reads the shard around the cache); ``None``:
            :func:`~shardkit.config.lock_wait` (``SHARDKIT_LOCK_WAIT``).

    Raises:
        ConfigError: a bad limit, namespace or wait, or a directory that cannot be made.
    """

    def __init__(self, cache_dir: str | os.PathLike[str], limit_bytes: int, *, namespace: str,
                 verify: bool = True, wait_timeout: float = 600.0, room_wait: float | None = None,
                 lock_wait: float | None = None) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
            raise ConfigError(f"cache limit_bytes must be a positive int, got {limit_bytes!r}")
        if wait_timeout < 0:
            raise ConfigError(f"cache wait_timeout must be >= 0, got {wait_timeout!r}")
        if room_wait is not None and room_wait < 0:
            raise ConfigError(f"cache room_wait must be >= 0, got {room_wait!r}")
        if lock_wait is not None and not lock_wait >= 0:
            raise ConfigError(f"cache lock_wait must be >= 0, got {lock_wait!r}")
        self._dir = CacheDir(os.path.abspath(os.fspath(cache_dir)), namespace, lock_wait)
        self._limit, self._verify = limit_bytes, verify
        self._lock_wait = lock_wait
        self._mu = threading.Lock()
        self._stats = dict.fromkeys(("hits", "misses", "bytes_fetched", "evictions", "wait_seconds",
                                     "corrupt_refetches", "prefetched", "prefetch_skipped", "landed",
                                     "lock_fallbacks", "streamed"), 0.0)
        self._schedule = Schedule()
        self._room = Room(self._dir, limit_bytes, self._schedule, wait_timeout, room_wait, self._add)
        self._prefetcher = Prefetcher("shardkit-cache-prefetch")
        self._streams = Streams(self._dir, lambda: lock_wait_seconds() if lock_wait is None else lock_wait, limit_bytes)
        self._stalled: dict[str, tuple[float, StorageStalledError]] = {}  # file -> a prefetch's recent give-up
        try:
            with self._dir.locked():
                self._dir.sweep_dead()
        except CacheLockedError as exc:
            log.warning("cache: not sweeping dead downloads now: %s", exc)

    def set_schedule(self, upcoming: Sequence[str], sizes: Sequence[int] | None = None) -> None:
        """Tell eviction this process's future need order.

        Each :meth:`open` of a scheduled shard moves the cursor to its next position in the
        schedule (the shard counts as needed now until a later one is opened).

        Args:
            upcoming: shard names in need order, repeats allowed.
            sizes: the shards' sizes, if known (a prefetch then leaves room for those needed before it).
        """
        self._schedule.set([file_name(name) for name in upcoming], sizes)

    def open(self, ref: ShardRef, fetch: ReaderFor, landing: bool = False, stream: bool = False,
             first: int = 0, join_below: float = 1.0) -> CachedShard | LandingShard:
        """The verified local copy of ``ref``, downloaded if needed, pinned until closed; or
        with ``stream``, the shard while it lands.

        Args:
            ref: the shard.
            fetch: gives the reader a download reads the shard's object with.
            landing: the caller only copies out of the shard, so a parallel download may go
                through a landing buffer (:mod:`.landing`), and the shard comes with ``hot``
                set while this process's landing buffer still holds it.
            stream: when the shard is not cached and ``ref`` has its samples, return at once a
                :class:`LandingShard` of its parallel download in flight (this process's or
                another's; one is started in a thread when none runs): its samples are read as
                they are verified (:meth:`LandingShard.wait`). The file is cached, for this
                reader and every other, only once the whole shard checked out.
            first: with ``stream``, the shard byte this reader needs first: a download it starts
                asks for the bytes from there on first.
            join_below: with ``stream``, follow a download already in flight only while less
                than this part of it has landed; past that, wait for it to end (without hashing
                its samples one by one) and open the file. A reader that would wait for the rest
                of a shard anyway gains little from reading it sample by sample, and the hashing
                costs cores the download needs.

        Returns:
            The open shard (a LandingShard only with ``stream``).

        Raises:
            ConfigError: the shard is larger than the cache limit.
            IntegrityError: the download disagrees with ``ref`` twice in a row.
            CacheFullError: readers kept too much pinned for ``wait_timeout`` seconds.
            NoRoomError: with ``room_wait``, pinned shards left no room for that long.
            CacheGoneError: the cache directory was removed while in use.
            CacheLockedError: a lock's holder made no progress for ``lock_wait`` seconds
                (a NoRoomError: read the shard around the cache).
            CacheDiskFullError: the disk under the cache has no room for the shard (ENOSPC, or
                a quota); names the directory and the room needed.
            ConfigError: the cache directory became read-only.
            Whatever the reader raises (the partial download is kept and resumed next time;
            after a parallel reader the reservation is kept and the next time starts from 0).
        """
        try:
            if stream and ref.samples is not None:
                shard = self._stream_open(ref, fetch, landing, first, join_below)
                if shard is not None:
                    return shard
            return self._open(ref, fetch, landing)
        except CacheLockedError:
            self._add("lock_fallbacks")
            raise
        except FileNotFoundError as exc:
            if not self._dir.gone():
                raise  # not the cache's own files (a fetch from a local dataset, say)
            # Made again here, its locks would not be the ones other readers hold: stop.
            raise CacheGoneError(f"cache_dir {self._dir.root} was removed while readers used it (a tmp cleaner, "
                                 f"another job's cleanup?): shard {ref.name} cannot be cached; restart the job, "
                                 "which makes the cache again") from exc
        except OSError as exc:
            said = self._os_error(exc, ref)
            if said is exc:
                raise
            raise said from exc

    def _os_error(self, exc: OSError, ref: ShardRef) -> Exception:
        """What an OSError from the cache's own files becomes: a full disk one error naming the
        directory and the room needed (also when a storage error was made of it), a read-only
        directory one line saying so; any other error stays as it is."""
        if isinstance(exc, ShardkitError) and not isinstance(exc, StorageError):
            return exc
        err = no_space_errno(exc)
        if err is not None:
            return self._dir.no_space(err, f"shard {ref.name}", ref.size, self._limit)
        if exc.errno == errno.EROFS and not isinstance(exc, ShardkitError):
            return ConfigError(self._dir.unusable(exc))
        return exc

    def prefetch(self, refs: Sequence[ShardRef], fetch: ReaderFor, max_ahead: int = 2,
                 landing: bool = False, at_once: int = 1) -> None:
        """Download the first ``max_ahead`` of ``refs``, in order, in background threads.

        Replaces the part of an earlier plan not started yet. A prefetch never waits: it
        skips a shard that another process is downloading, that does not fit, or that would
        evict a shard needed sooner (earlier in ``refs`` or in the schedule), or that would
        take room the plan's earlier shards not in the cache yet need: fetched into room freed
        a moment after those were skipped, it would be evicted again to make room for them
        (with a cache of one or two shards, most shards were fetched twice).

        Args:
            refs: shards in need order.
            fetch: gives the reader each download reads with.
            max_ahead: shards of ``refs`` planned.
            landing: as for :meth:`open`.
            at_once: downloads run at once (up to :data:`~shardkit.cache.prefetch.MAX_AT_ONCE`).
        """
        plan = [r for r in refs[:max_ahead] if 0 <= r.size <= self._limit]
        jobs = [functools.partial(self._prefetch_one, r, fetch, {file_name(q.name): q.size for q in plan[:i]}, landing)
                for i, r in enumerate(plan)]
        self._prefetcher.replace(jobs, at_once)

    def contains(self, ref: ShardRef) -> bool:
        """Whether a shard is in the cache now (it may be evicted right after: :meth:`open` decides).

        Args:
            ref: the shard.

        Returns:
            True when its verified file is there.
        """
        return os.path.exists(self._dir.final(file_name(ref.name)))

    def stats(self) -> dict[str, float]:
        """This cache's counters.

        Returns:
            hits, misses, bytes_fetched, evictions, wait_seconds, corrupt_refetches, prefetched,
            prefetch_skipped, landed (downloads through a landing buffer), lock_fallbacks (opens
            that gave up on a lock whose holder made no progress: CacheLockedError), streamed
            (opens that returned a shard still landing).
        """
        with self._mu:
            return dict(self._stats)

    def usage(self) -> int:
        """Bytes counted against the limit now (all namespaces).

        Returns:
            Shards plus reservations.

        Raises:
            CacheLockedError: the global lock's holder made no progress for ``lock_wait`` seconds.
        """
        with self._dir.locked(fcntl.LOCK_SH):
            return sum(e.size for e in self._dir.scan())

    def close(self) -> None:
        """Stop prefetching (after the downloads in progress). Open shards stay valid."""
        self._prefetcher.close()
        self._streams.close()

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- opening ---------------------------------------------------------------------------

    def _add(self, key: str, value: float = 1.0) -> None:
        with self._mu:
            self._stats[key] += value

    def _open(self, ref: ShardRef, fetch: ReaderFor, landing: bool) -> CachedShard:
        if ref.size < 0:
            raise ConfigError(f"shard {ref.name} has a negative size {ref.size}")
        if ref.size > self._limit:
            raise ConfigError(f"shard {ref.name} is {human_bytes(ref.size)}, larger than cache_limit "
                              f"{human_bytes(self._limit)}; raise cache_limit")
        file = file_name(ref.name)
        self._schedule.opened(file)
        with self._mu:
            stalled = self._stalled.pop(file, None)
        if stalled is not None and time.monotonic() - stalled[0] < STALL_REMEMBERED:
            raise stalled[1]  # a prefetch just spent the whole retry budget on it: not a second one
        KEPT.prune()  # let go of kept maps whose files another process evicted
        pin = wait_lock(self._dir.lock_path(self._dir.ns, file, "pin"), fcntl.LOCK_SH, f"shard {ref.name}: its pin",
                        limit=self._lock_wait)
        try:
            fd = cast(int, self._ensure(ref, fetch, file, None, landing))  # None only for a prefetch
        except BaseException:
            pin.release()
            raise
        path = self._dir.final(file)
        st = os.fstat(fd)
        verified = st.st_mtime_ns == verified_stamp_ns(ref.checksum)
        hot = LANDING.hot(path, st) if landing and verified else None
        return CachedShard(ref, path, fd, pin, verified=verified, landing=hot)

    def _stream_open(self, ref: ShardRef, fetch: ReaderFor, landing: bool, first: int,
                     join_below: float) -> LandingShard | None:
        """A reader of ``ref``'s download in flight (see :meth:`.Streams.open`), or None."""
        file = file_name(ref.name)
        if os.path.exists(self._dir.final(file)) or not fetch(ref).parallel:
            return None  # cached (the ordinary open checks it), or a download readers cannot follow
        shard = self._streams.open(ref, file, functools.partial(self._fill_for_reader, ref, fetch, file, landing, first))
        if shard is None:
            return None
        if shard.landed() >= join_below:
            try:
                shard.wait_over()  # then the ordinary open finds the file published (or downloads it)
            finally:
                shard.close()
            return None
        shard.follow()
        self._schedule.opened(file)
        self._add("streamed")
        return shard

    def _fill_for_reader(self, ref: ShardRef, fetch: ReaderFor, file: str, landing: bool, first: int) -> None:
        """A reader's download, in a thread of its own: as its open would, pin held; none if
        another thread or process is downloading the shard (the reader follows that one)."""
        pin = wait_lock(self._dir.lock_path(self._dir.ns, file, "pin"), fcntl.LOCK_SH, f"shard {ref.name}: its pin",
                        limit=self._lock_wait)
        try:
            fd = self._ensure(ref, fetch, file, None, landing, first, busy_ok=True)
            if fd is not None:
                os.close(fd)
        finally:
            pin.release()

    def _prefetch_one(self, ref: ShardRef, fetch: ReaderFor, earlier: dict[str, int], landing: bool) -> None:
        """One job of a prefetch plan: download ``ref`` unless it is there, busy or has no room."""
        file = file_name(ref.name)
        pin = FileLock.try_take(self._dir.lock_path(self._dir.ns, file, "pin"), fcntl.LOCK_SH | fcntl.LOCK_NB)
        if pin is None:  # being evicted this instant
            self._add("prefetch_skipped")
            return
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

    def _open_final(self, ref: ShardRef, file: str) -> tuple[str, int | None]:
        """("ok", fd) for a good cached copy, else ("missing", None) or ("corrupt", None)."""
        try:
            fd = os.open(self._dir.final(file), os.O_RDONLY | os.O_CLOEXEC)
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

    def _ensure(self, ref: ShardRef, fetch: ReaderFor, file: str, planned: Planned, landing: bool,
                first: int = 0, busy_ok: bool = False) -> int | None:
        """An fd of the verified shard (its pin held by the caller); None if a prefetch skips,
        or with ``busy_ok`` if another thread or process is downloading it."""
        state, fd = self._open_final(ref, file)
        downloaded = False
        if state != "ok":
            t0 = time.monotonic()
            path = self._dir.lock_path(self._dir.ns, file, "dl")
            if planned is None and not busy_ok:  # a reader waits for a download elsewhere, while it moves (see lock_wait)
                dl: FileLock | None = wait_lock(path, fcntl.LOCK_EX, f"shard {ref.name}: its download",
                                                limit=self._lock_wait, progress=lambda: self._dir.temp_progress(file))
            else:
                dl = FileLock.try_take(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if dl is None:  # another process is downloading it: prefetch enough
                if planned is not None:
                    self._add("prefetch_skipped")
                return None
            try:
                write_owner(dl)  # who downloads, for a reader that waits for it (and /proc/locks)
                self._add("wait_seconds", time.monotonic() - t0)
                state, fd = self._open_final(ref, file)  # it may have arrived while we waited
                if state == "corrupt":
                    log.warning("cache: shard %s is corrupt on disk; fetching it again", ref.name)
                    with self._dir.locked():
                        unlink_quiet(self._dir.final(file))
                    self._add("corrupt_refetches")
                if state != "ok":
                    self._download(ref, fetch, file, planned, landing, first)
                    downloaded = True
                    state, fd = self._open_final(ref, file)
            finally:
                clear_owner(dl)
                dl.release()
            if state != "ok":
                raise IntegrityError(f"shard {ref.name}: verified download vanished from {self._dir.final(file)}")
        if planned is not None:
            self._add("prefetched", float(downloaded))
        else:
            self._add("misses" if downloaded else "hits")
        return fd

    # ---- downloading -----------------------------------------------------------------------

    def _reserve(self, ref: ShardRef, file: str, planned: Planned) -> tuple[str, int] | None:
        """A temp file counting ``ref.size`` and the bytes in it (see :meth:`.Room.reserve`)."""
        return self._room.reserve(ref, file, planned)

    def _download(self, ref: ShardRef, fetch: ReaderFor, file: str, planned: Planned, landing: bool,
                  first: int = 0) -> None:
        """Fetch, verify and publish ``ref`` (download lock held); _NoRoom if a prefetch finds
        no room for it."""
        got = self._reserve(ref, file, planned)
        if got is None:
            raise _NoRoom(ref.name)
        tmp, start = got
        try:
            self._fill(ref, fetch, file, tmp, start, landing, first)
        except OSError as exc:
            err = no_space_errno(exc)
            if err is None:
                raise
            # A full disk (or quota): what landed goes (it holds disk the cache needs, and a
            # resume onto it would find the disk as full), and the reader is told in one line.
            with self._dir.locked():
                unlink_quiet(tmp)
            raise self._dir.no_space(err, f"shard {ref.name}", ref.size, self._limit) from exc

    def _fill(self, ref: ShardRef, fetch: ReaderFor, file: str, tmp: str, start: int, landing: bool,
              first: int = 0) -> None:
        """Fill the temp file ``tmp`` (``start`` bytes in it), verify and publish it; a second
        attempt from byte 0 if the first does not match (see :mod:`.attempt`)."""
        for n in (1, 2):
            done, pos, digest = attempt(self._dir, self._streams, fetch(ref), ref, file, tmp,
                                        -1 if n == 2 else start, landing, first, self._fetched, last=n == 2)
            if done:
                self._add("landed", float(done == "landed"))
                return
            log.warning("cache: shard %s: got %d bytes with xxh3 %s from byte %d (attempt %d); the "
                        "manifest says %d bytes with %s", ref.name, pos, digest, 0 if n == 2 else start,
                        n, ref.size, ref.checksum)
        with self._dir.locked():
            unlink_quiet(tmp)
        raise IntegrityError(f"shard {ref.name}: download does not match the manifest (size {ref.size}, "
                             f"xxh3 {ref.checksum}) twice; last got {pos} bytes with xxh3 {digest}")

    def _fetched(self, nbytes: int) -> None:
        self._add("bytes_fetched", float(nbytes))
