"""A shard still landing, open for reading the samples already verified (:mod:`.progress`).

:meth:`ShardCache.open(stream=True) <shardkit.cache.shard_cache.ShardCache.open>` returns one
of these while the shard's download is in flight, in this process or another: its samples can
be read as soon as :meth:`LandingShard.wait` says they are verified, from the temp file the
download fills (the same inode the cache publishes once the whole shard checks out), or from
this process's landing buffer. It pins nothing in the cache: the download holds the room, and a
reader opens the published file (pinned) once :meth:`wait` says the landing is over.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from typing import Callable

import numpy as np

from shardkit.cache.files import ShardRef
from shardkit.cache.landing import LANDING, Landing
from shardkit.cache.open_shard import OpenShard
from shardkit.cache.progress import LANDING as IN_FLIGHT
from shardkit.cache.progress import Progress, ProgressFile, RemoteState, Spans
from shardkit.config import LOCK_WAIT_ENV
from shardkit.errors import CacheLockedError, StorageStalledError
from shardkit.util.procs import pid_alive

__all__ = ["LandingShard"]

log = logging.getLogger(__name__)

_POLL = 0.01  # longest sleep between two looks at another process's progress file


class LandingShard(OpenShard):
    """A shard whose download is in flight: samples readable once verified, nothing pinned.

    Made by the cache (:meth:`local` or :meth:`remote`).

    Args:
        ref: the shard.
        path: the temp file the download fills.
        fd: that file, open for reading (closed by :meth:`close`).
        quiet: seconds a wait goes on while nothing lands.

    Attributes:
        ref: the shard.
        path: the temp file (published under the cache's name once whole and verified).
        verified: always False: only some samples are (see :meth:`wait`).
    """

    verified = False

    def __init__(self, ref: ShardRef, path: str, fd: int, quiet: float) -> None:
        super().__init__(ref, path, fd, None)
        self._quiet = quiet
        self._local: Progress | None = None
        self._file: ProgressFile | None = None
        self._head: RemoteState | None = None
        self._spans: Spans | None = None
        self._mmap: mmap.mmap | None = None
        self._view: memoryview | None = None
        self.error: BaseException | None = None  # a download of this process that failed for good

    @classmethod
    def local(cls, ref: ShardRef, progress: Progress, quiet: float) -> LandingShard | None:
        """A reader of a download in flight in this process.

        Args:
            ref: the shard.
            progress: the download's current attempt.
            quiet: seconds a wait goes on while nothing lands.

        Returns:
            The reader, or None if that attempt is over already (or its file is gone).
        """
        try:
            fd = os.open(progress.temp, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (progress.st.st_dev, progress.st.st_ino):
            os.close(fd)
            return None  # a new attempt's inode already: ask again
        shard = cls(ref, progress.temp, fd, quiet)
        shard._local = progress
        buf = progress.landing
        if isinstance(buf, Landing) and not progress.pin(LANDING.pin, buf):  # type: ignore[arg-type]
            shard.close()
            return None
        shard._landing = buf if isinstance(buf, Landing) else None
        return shard

    @classmethod
    def remote(cls, ref: ShardRef, progress_path: str, temp_of: Callable[[int], str], quiet: float) -> LandingShard | None:
        """A reader of a download in flight in another process, from its progress file.

        Args:
            ref: the shard.
            progress_path: the progress file beside the shard's download lock.
            temp_of: the temp file's path for the downloader's pid.
            quiet: seconds a wait goes on while nothing lands.

        Returns:
            The reader, or None when no download with progress is in flight.
        """
        try:
            file = ProgressFile(progress_path, writable=False)
        except OSError:
            return None
        head = file.head()
        if head is None or head.state != IN_FLIGHT or head.pid == os.getpid() or not pid_alive(head.pid):
            file.close()
            return None
        try:
            fd = os.open(temp_of(head.pid), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            file.close()
            return None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (head.dev, head.ino) or st.st_size < ref.size:
            os.close(fd)
            file.close()
            return None
        shard = cls(ref, temp_of(head.pid), fd, quiet)
        shard._file, shard._head = file, head
        return shard

    # ---- what readers use (as of a CachedShard) ----------------------------------------------

    def buffer(self, keep: bool = False) -> memoryview:
        """A read-only map of the whole temp file (only verified samples may be read from it).

        Args:
            keep: ignored (a temp file's map is never kept across epochs).

        Returns:
            The file's bytes.

        Raises:
            ValueError: the shard is closed.
        """
        fd = self.fileno()  # refuses a closed shard
        if self._view is None:
            # Safe to map: the download made the file its full size before any sample was
            # verified, and the cache never shortens a temp file (a new attempt is a new inode).
            if self.ref.size:
                self._mmap = mmap.mmap(fd, self.ref.size, access=mmap.ACCESS_READ)
            self._view = memoryview(self._mmap if self._mmap is not None else b"")
        return self._view

    # ---- following ---------------------------------------------------------------------------

    def landed(self) -> float:
        """The part of the shard landed so far (0 to 1).

        Returns:
            Bytes landed over the shard's size.
        """
        done = self._local.landed_bytes if self._local is not None else self._head.landed if self._head else 0
        return done / self.ref.size if self.ref.size else 1.0

    def follow(self) -> None:
        """Have the download verify samples as they land, for this reader (see
        :meth:`Progress.follow <shardkit.cache.progress.Progress.follow>`): what landed so far
        is checked now (in this thread, for a download of this process)."""
        if self._local is not None:
            self._local.follow()
        elif self._file is not None:
            self._file.follow()

    def wait_over(self) -> None:
        """Wait until the download's attempt is over (published or not), without following it.

        Raises:
            StorageStalledError: nothing landed for ``quiet`` seconds (a download of this process).
            CacheLockedError: nothing landed for ``quiet`` seconds (another process's download).
        """
        self._wait_over()

    # ---- waiting ----------------------------------------------------------------------------

    def wait(self, positions: np.ndarray) -> bool:
        """Wait until samples ``positions`` are verified, or the landing is over.

        Args:
            positions: sample positions in the shard.

        Returns:
            True when all of them are verified (read them); False when the download's attempt
            ended first, published or not: open the shard again.

        Raises:
            StorageStalledError: nothing landed for ``quiet`` seconds (a download of this process).
            CacheLockedError: nothing landed for ``quiet`` seconds (another process's download:
                read around the cache).
            Whatever the download of this process raised, when it failed for good.
        """
        if not len(positions):
            return True
        if self._local is not None:
            try:
                if self._local.wait(positions, self._quiet):
                    return True
            except TimeoutError as exc:
                raise StorageStalledError(f"{exc} (its download in this process makes no progress)") from exc
            if self._local.error is not None:
                self.error = self._local.error
            return False
        return self._wait_remote(positions)

    def _wait_remote(self, positions: np.ndarray) -> bool:
        assert self._file is not None and self._head is not None
        lo, hi = int(positions.min()), int(positions.max()) + 1
        at = positions - lo
        mine = self._head
        seen, since, delay = mine.landed, time.monotonic(), 0.0005
        while True:
            head = self._file.head()
            if head is None or (head.pid, head.attempt, head.ino) != (mine.pid, mine.attempt, mine.ino):
                return False  # another attempt, or none in flight: ask the cache again
            if head.state == IN_FLIGHT and not pid_alive(head.pid):
                return False  # died mid-download: whoever opens next takes it over
            flags = self._file.verified(lo, hi)
            again = self._file.head()  # the flags are this attempt's only if the header held still
            if again is None or (again.pid, again.attempt, again.ino) != (mine.pid, mine.attempt, mine.ino):
                return False
            if (flags[at] == 1).all():
                return True
            if again.state != IN_FLIGHT:
                return False
            now = time.monotonic()
            if again.landed != seen:
                seen, since = again.landed, now
            elif now - since >= self._quiet:
                raise CacheLockedError(f"shard {self.ref.name}: its download in pid {mine.pid} landed nothing for "
                                       f"{now - since:.1f} s; reading around the node cache instead "
                                       f"({LOCK_WAIT_ENV} sets the wait)")
            time.sleep(delay)
            delay = min(delay * 2, _POLL)

    def servable(self, pos: int) -> int:
        """Bytes from shard byte ``pos`` on that lie in verified samples, one after the other,
        waiting until there is at least one or the landing is over.

        Args:
            pos: a shard byte.

        Returns:
            How many (0: the landing is over; open the shard again).

        Raises:
            As :meth:`wait`.
        """
        if self._spans is None:
            self._spans = self._local.spans if self._local is not None else Spans(self.ref.samples)  # type: ignore[arg-type]
        spans = self._spans
        while True:
            if self._local is not None:
                ok = self._local.flags()
            else:
                assert self._file is not None
                ok = self._file.verified(0, len(spans.order)) == 1
            n = spans.servable(ok, pos)
            if n:
                return n
            p = spans.holding(pos)
            if p < 0:  # between samples (the archive's end): only the whole shard vouches for it
                self._wait_over()
                return 0
            if not self.wait(np.array([p])):
                return 0

    def _wait_over(self) -> None:
        """Wait until the download's attempt is over."""
        if self._local is not None:
            try:
                self._local.wait_over(self._quiet)
            except TimeoutError as exc:
                raise StorageStalledError(f"{exc} (its download in this process makes no progress)") from exc
            return
        assert self._file is not None and self._head is not None
        mine, delay, since, seen = self._head, 0.0005, time.monotonic(), -1
        while True:
            head = self._file.head()
            if head is None or head.state != IN_FLIGHT or (head.pid, head.attempt, head.ino) != \
                    (mine.pid, mine.attempt, mine.ino) or not pid_alive(head.pid):
                return
            if head.landed != seen:
                seen, since = head.landed, time.monotonic()
            elif time.monotonic() - since >= self._quiet:
                raise CacheLockedError(f"shard {self.ref.name}: its download in pid {mine.pid} landed nothing for "
                                       f"{self._quiet:.1f} s ({LOCK_WAIT_ENV} sets the wait)")
            time.sleep(delay)
            delay = min(delay * 2, _POLL)

    def close(self) -> None:
        """Unmap, close the file and unpin the landing buffer."""
        if self._view is not None:
            try:
                self._view.release()
            except BufferError:  # sample views are alive: they keep the map
                pass
            self._view = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                log.debug("shard %s: views of its landing map still alive at close", self.ref.name)
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._landing is not None:
            LANDING.release(self._landing)
            self._landing = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> LandingShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
