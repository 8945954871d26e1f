"""Shards read while they land: the node cache's side of ``ShardCache.open(stream=True)``.

* :class:`Tracker` follows one attempt of one parallel fill (its :class:`~.progress.Progress`,
  in :data:`~.progress.INFLIGHT` for this process and in a progress file for the others), and
  ends it once the fill published the shard or gave up.
* :class:`Streams` finds the download in flight of a shard a reader wants (this process's, or
  another's with a progress file) and hands out :class:`~.landing_shard.LandingShard` readers
  of it, or starts the download in a thread of its own when nobody runs one.

A reader of a landing shard reads only samples flagged verified (their xxh3-64 matched as they
landed); the file counts as cached for anyone only once the whole shard's xxh3-128 matched and
the cache renamed it into place, as for any download.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import sys
import threading
import time
from typing import Callable

from shardkit.cache.files import FileLock, ShardRef
from shardkit.cache.landing import Landing
from shardkit.cache.landing_shard import LandingShard
from shardkit.cache.layout import CacheDir
from shardkit.cache.progress import DONE, FAILED, INFLIGHT, Progress, ProgressFile
from shardkit.cache.room import keeps_progress
from shardkit.errors import IntegrityError
from shardkit.storage.ranged import PartCallback, RangeReader, read_fully

__all__ = ["Tracker", "Streams", "FillJob", "CORRUPT_REMEMBERED"]

log = logging.getLogger(__name__)

_ATTEMPTS = itertools.count(1)  # attempt numbers of this process's fills (in progress file headers)
_LOOK = 0.01  # longest wait between two looks for a download a reader's open started
_BUSY_LOOK = 1.0  # seconds to look for the progress of a download another thread or process holds
# A download of this process that found the shard corrupt (twice, or a sample on every read) this
# recently: a streaming open raises its error instead of fetching the shard once more.
CORRUPT_REMEMBERED = 60.0


class Tracker:
    """The progress of one attempt of a parallel fill (a :class:`~.fill.Track`).

    Args:
        ref: the shard (with its samples).
        final: the cache file the fill publishes.
        tmp: the temp file it fills.
        fd: that file, open.
        buf: the landing buffer it lands into, if any.
        reader: the attempt's reader (a failed sample is read again with it).
        progress_path: the progress file other processes read (None: none is kept, they wait
            for the published shard).
    """

    def __init__(self, ref: ShardRef, final: str, tmp: str, fd: int, buf: Landing | None, reader: RangeReader,
                 progress_path: str | None, corrupt: Callable[[str, BaseException], None] | None = None) -> None:
        self.ref, self.final, self.tmp, self.fd, self.buf = ref, final, tmp, fd, buf
        self._corrupt = corrupt
        self.reader, self.progress_path = reader, progress_path
        self.progress: Progress | None = None
        self._file: ProgressFile | None = None

    def __call__(self, view: memoryview) -> PartCallback:
        """The fill lands into ``view`` now: start following it.

        Args:
            view: the shard's bytes as they land (from byte 0).

        Returns:
            The callback to tell of each range landed.
        """
        assert self.ref.samples is not None
        st = os.fstat(self.fd)
        try:
            if self.progress_path is not None:
                self._file = ProgressFile(self.progress_path, writable=True)
                self._file.start(next(_ATTEMPTS), st, len(self.ref.samples))
        except OSError as exc:  # other processes wait for the whole shard, as before
            log.debug("cache: no progress file for %s: %s", self.ref.name, exc)
            self._file = None
        self.progress = Progress(self.ref.name, self.ref.samples, view, self._refetch, self._file, self.tmp, st,
                                 self.buf)
        INFLIGHT.put(self.final, self.progress)
        return self.progress.landed

    def settle(self) -> None:
        """Every part is in: read again the samples that failed as a reader joined.

        Raises:
            IntegrityError: such a sample failed its checksum on every read.
        """
        if self.progress is not None:
            self.progress.settle()

    def quiesce(self) -> None:
        """The fill lets go of its bytes next: no reader may hash them from now on."""
        if self.progress is not None:
            self.progress.quiesce()

    @property
    def repaired(self) -> list[tuple[int, int]]:
        """Byte ranges put into the fill's bytes again (samples read anew)."""
        return list(self.progress.repaired) if self.progress is not None else []

    def _refetch(self, lo: int, hi: int) -> memoryview:
        out = memoryview(bytearray(hi - lo))
        read_fully(self.reader, lo, out, self.ref.name)
        return out

    def end(self, published: bool, error: BaseException | None = None) -> None:
        """The attempt is over: tell its readers, here and elsewhere.

        Args:
            published: the shard is in the cache now.
            error: why it failed for good (None: published, or a new attempt follows).
        """
        if isinstance(error, IntegrityError) and self._corrupt is not None:
            self._corrupt(self.final, error)
        if self.progress is None:
            return
        self.progress.finish(DONE if published else FAILED, error)
        INFLIGHT.drop(self.final, self.progress)
        if self._file is not None:
            try:
                self._file.clear()
            except OSError:
                pass  # readers elsewhere see the header say so, or the lock go
            self._file.close()
            self._file = None


class FillJob:
    """A download a reader's open started in a thread of its own.

    Args:
        run: the download (raises what fails it).
    """

    def __init__(self, run: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self._run = run
        self.thread = threading.Thread(target=self._main, name="shardkit-cache-fill", daemon=True)

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # the reader that started it raises it (or opens again)
            self.error = exc

    @property
    def done(self) -> bool:
        """Whether it has ended."""
        return not self.thread.is_alive()


class Streams:
    """Readers of shards still landing, for one ShardCache.

    Args:
        where: the cache directory and namespace.
        quiet: seconds a reader waits while nothing lands (the cache's lock wait).
        limit: the cache's ``cache_limit`` (a progress file must fit under it with its shard).
    """

    def __init__(self, where: CacheDir, quiet: Callable[[], float], limit: int) -> None:
        self._dir, self._quiet, self._limit = where, quiet, limit
        self._mu = threading.Lock()
        self._jobs: list[FillJob] = []
        self._corrupt: dict[str, tuple[float, BaseException]] = {}  # cache file -> when, the error

    def tracker(self, ref: ShardRef, file: str, tmp: str, fd: int, buf: Landing | None,
                reader: RangeReader) -> Tracker | None:
        """A tracker for one fill attempt, if readers can follow it.

        Args:
            ref: the shard.
            file: its file name.
            tmp: the temp file.
            fd: the temp file, open.
            buf: the landing buffer, if any.
            reader: the attempt's reader.

        Returns:
            The tracker, or None (a sequential reader, or a shard without its samples).
        """
        if not reader.parallel or ref.samples is None or not len(ref.samples):
            return None
        progress = self.progress_path(file) if keeps_progress(ref, self._limit) else None
        return Tracker(ref, self._dir.final(file), tmp, fd, buf, reader, progress, self.found_corrupt)

    def found_corrupt(self, final: str, error: BaseException) -> None:
        """A download of this process found the shard corrupt for good (remembered a while).

        Args:
            final: the shard's cache file.
            error: the IntegrityError.
        """
        with self._mu:
            self._corrupt[final] = (time.monotonic(), error)

    def progress_path(self, file: str) -> str:
        """The progress file of a shard's downloads.

        Args:
            file: the shard's file name.

        Returns:
            Its path, beside the shard's locks.
        """
        return self._dir.lock_path(self._dir.ns, file, "landed")

    def find(self, ref: ShardRef, file: str) -> LandingShard | None:
        """A reader of the download of ``ref`` in flight, in this process or another.

        Args:
            ref: the shard (with its samples).
            file: its file name.

        Returns:
            The reader, or None when no download with progress is in flight.
        """
        quiet = self._quiet()
        progress = INFLIGHT.get(self._dir.final(file))
        if progress is not None:
            shard = LandingShard.local(ref, progress, quiet)
            if shard is not None:
                return shard
        return LandingShard.remote(ref, self.progress_path(file), lambda pid: self._dir.temp(file, ref.size, pid), quiet)

    def start(self, run: Callable[[], None]) -> FillJob:
        """Run a download in a thread of its own.

        Args:
            run: the download.

        Returns:
            Its job.
        """
        job = FillJob(run)
        with self._mu:
            self._jobs = [j for j in self._jobs if not j.done] + [job]
        job.thread.start()
        return job

    def wait_started(self, ref: ShardRef, file: str, job: FillJob) -> LandingShard | None:
        """Wait until the download of ``ref`` is in flight with progress (``job``'s, or one it
        found running), or ``job`` ended.

        Args:
            ref: the shard.
            file: its file name.
            job: the download a reader's open started.

        Returns:
            A reader of the download in flight, or None when ``job`` ended first (see its ``error``).
        """
        final = self._dir.final(file)
        ended = None
        while True:
            INFLIGHT.wait_for(final, lambda: job.done, _LOOK)
            shard = self.find(ref, file)
            if shard is not None:
                return shard
            if job.done and (job.error is not None or os.path.exists(final)):
                return None
            if job.done:
                # Another thread or process holds the download: it says how far it is in a moment
                # (or never, a download readers cannot follow: the ordinary open waits for it).
                ended = time.monotonic() if ended is None else ended
                if time.monotonic() - ended > _BUSY_LOOK or not self._busy(file):
                    return None
                time.sleep(_LOOK)

    def open(self, ref: ShardRef, file: str, download: Callable[[], None]) -> LandingShard | None:
        """A reader of the download of ``ref`` in flight, started with ``download`` in a thread
        of its own when none runs.

        Args:
            ref: the shard (with its samples).
            file: its file name.
            download: downloads the shard (as an open would; it finds a copy already there).

        Returns:
            The reader, or None when the download ended before it was in flight with progress
            (it found the shard there, or waited for another process's download).

        Raises:
            IntegrityError: a download of this process found the shard corrupt a moment ago
                (:data:`CORRUPT_REMEMBERED`): not fetched once more.
            Whatever that download raised.
        """
        with self._mu:
            seen = self._corrupt.pop(self._dir.final(file), None)
        if seen is not None and time.monotonic() - seen[0] < CORRUPT_REMEMBERED:
            raise seen[1]
        shard = self.find(ref, file)
        if shard is None:
            job = self.start(download)
            shard = self.wait_started(ref, file, job)
            if shard is None and job.error is not None:
                raise job.error
        return shard

    def _busy(self, file: str) -> bool:
        """Whether some thread or process holds the shard's download lock now."""
        lock = FileLock.try_take(self._dir.lock_path(self._dir.ns, file, "dl"), fcntl.LOCK_EX | fcntl.LOCK_NB)
        if lock is None:
            return True
        lock.release()
        return False

    def close(self) -> None:
        """Wait for the downloads readers' opens started (they end: storage retries are bounded)."""
        with self._mu:
            jobs, self._jobs = self._jobs, []
        if sys.is_finalizing():
            return  # interpreter exit: the daemon threads are frozen by now (see Prefetcher.close)
        for job in jobs:
            job.thread.join()
