"""What a shard download in flight has landed and verified, sample by sample: readers serve a
sample as soon as its bytes are in and match its manifest xxh3-64, long before the shard is whole.

A parallel fill reports each range it has landed (:meth:`Progress.landed`, from its GET
threads). Every sample whose bytes are then all in is hashed and, if it matches, flagged
verified. One that does not match is read again on its own (a byte flipped in transit is gone
on the next read), up to :data:`REFETCHES` times, then the fill fails with one IntegrityError
naming it. The fill still hashes the whole shard (xxh3-128) before it publishes the file: a
flag lets a reader serve that sample now; only the whole-shard check makes the file cached.

Readers in this process find the :class:`Progress` in :data:`INFLIGHT` and wait on it. Readers
in other processes read the same flags from a small file beside the shard's download lock
(``<ns>/.locks/<file>.landed``, :class:`ProgressFile`): a header (the downloader's pid, the
attempt, the temp file's device and inode, bytes landed, state, a checksum of all that) and one
byte per sample. The bytes a flag vouches for never change: a new attempt of the fill writes a
new inode (``ShardCache`` never truncates or rewrites a temp file a reader may have open).
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import xxhash

from shardkit.cache.progress_file import DONE, FAILED, LANDING, ProgressFile, RemoteState
from shardkit.errors import IntegrityError

__all__ = ["SampleTable", "Spans", "Progress", "ProgressFile", "RemoteState", "Inflight", "INFLIGHT", "REFETCHES",
           "LANDING", "DONE", "FAILED"]

log = logging.getLogger(__name__)

REFETCHES = 2  # reads of a sample again after its bytes failed their checksum, before the fill fails


@dataclass(frozen=True)
class SampleTable:
    """A shard's samples as its manifest rows place them: what a download checks as it lands.

    Attributes:
        offsets: each sample's first byte in the shard (int64, by position).
        sizes: its bytes (int64).
        checksums: the xxh3-64 of those bytes (uint64).
    """

    offsets: np.ndarray
    sizes: np.ndarray
    checksums: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets)

    def span(self, positions: np.ndarray) -> tuple[int, int]:
        """The shard bytes holding ``positions``.

        Args:
            positions: sample positions (not empty).

        Returns:
            (first byte, the byte after the last).
        """
        return int(self.offsets[positions].min()), int((self.offsets[positions] + self.sizes[positions]).max())


class Progress:
    """One attempt of one shard's download: the ranges landed, the samples verified, and the
    readers of this process waiting for them.

    Args:
        name: the shard (for messages).
        table: its samples.
        view: the bytes the fill lands into (a landing buffer or a map of the temp file), from
            shard byte 0.
        refetch: reads shard bytes ``[lo, hi)`` again into a new buffer (a sample that failed).
        file: the progress file other processes read, or None.
        temp: the temp file's path.
        st: its stat (which inode this attempt fills).
        landing: the landing buffer ``view`` is in, if any (readers pin it).
    """

    def __init__(self, name: str, table: SampleTable, view: memoryview, refetch: Callable[[int, int], memoryview],
                 file: ProgressFile | None, temp: str, st: os.stat_result, landing: object | None = None) -> None:
        self.name, self.table, self.view, self._refetch = name, table, view, refetch
        self.file, self.temp, self.st, self.landing = file, temp, st, landing
        self._cv = threading.Condition()
        self.spans = Spans(table)
        # By position: 0 not looked at, 1 verified, 2 being hashed, 3 failed when a reader
        # joined (read again by settle).
        self._state = np.zeros(len(table), np.uint8)
        self._eager = False  # hash samples as they land (a reader follows: see follow)
        self._settling = False  # the fill has all its parts: readers no longer hash (see settle)
        self._hashing = 0  # readers hashing what landed (follow), which settle waits for
        self._spans: list[list[int]] = []  # landed [lo, hi), disjoint, sorted
        self.landed_bytes = 0
        self.state = LANDING
        self.error: BaseException | None = None
        self.repaired: list[tuple[int, int]] = []  # byte ranges written again after a refetch
        self.ticks = 0  # grows at every change readers may wait for

    # ---- the fill's side ------------------------------------------------------------------

    def landed(self, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` are in ``view``: verify the samples they complete, once a reader
        follows the shard (a PartCallback; see :meth:`follow`).

        Args:
            lo: the first byte.
            hi: the byte after the last.

        Raises:
            IntegrityError: a sample failed its checksum on every read (:data:`REFETCHES` more).
        """
        if hi <= lo:
            return
        with self._cv:
            left, right, grew = self._merge(lo, hi)
            self.landed_bytes += grew
            self.ticks += 1
            eager = self._eager
        if not eager and self.file is not None and self.file.followed():
            self.follow()  # a reader in another process asked: verify what landed so far, then as it lands
            eager = True
        if eager:
            self._verify(self._complete(lo, hi, left, right), repair=True)
        elif self.file is not None:
            self.file.state(self.landed_bytes, LANDING)

    def follow(self) -> None:
        """A reader follows the shard: verify every sample landed so far (in the caller's
        thread), and from now on each as it lands.

        Samples are hashed only for readers that read the shard while it lands: a shard fetched
        ahead of its reader is checked whole (xxh3-128) before anyone reads it, and hashing its
        samples too would only cost cores the download needs. A sample that fails here is read
        again by the fill itself, once all its parts are in (:meth:`settle`): only the fill
        writes its bytes. Once the fill settles, nothing more is hashed here (its bytes go
        away): the reader opens the published file.
        """
        with self._cv:
            if self._eager:
                return
            self._eager = True
            if self._settling:
                return
            todo = [self._complete(lo, hi, lo, hi) for lo, hi in self._spans]
            self._hashing += 1
        try:
            for pos in todo:
                self._verify(pos, repair=False)
        finally:
            with self._cv:
                self._hashing -= 1
                self._cv.notify_all()

    def _complete(self, lo: int, hi: int, left: int, right: int) -> np.ndarray:
        """Claim the samples touching ``[lo, hi)`` that lie wholly in the landed span
        ``[left, right)`` and were not looked at yet (lock held, or taken here)."""
        with self._cv:
            sp = self.spans
            # The samples these bytes touch (ends are a running maximum: searchable) that now
            # lie wholly in landed bytes.
            idx = np.arange(int(np.searchsorted(sp.ends, lo, side="right")), int(np.searchsorted(sp.starts, hi)))
            pos = sp.order[idx]
            pos = pos[(sp.starts[idx] >= left) & (sp.starts[idx] + self.table.sizes[pos] <= right)]
            pos = pos[self._state[pos] == 0]
            self._state[pos] = 2
            return pos

    def _verify(self, pos: np.ndarray, repair: bool) -> None:
        """Hash the claimed samples ``pos``; flag those that match (``repair``: read the others
        again now; else leave them to :meth:`settle`). The samples that match are flagged even
        when another one of ``pos`` fails for good, whose IntegrityError is raised after."""
        good: list[int] = []
        bad: list[int] = []
        in_file: list[int] = []  # what other processes, reading the temp file, may be told of
        error: IntegrityError | None = None
        for p in pos.tolist():
            try:
                before = len(self.repaired)
                if self._check(p, repair):
                    good.append(p)
                    # A sample read again went into the landing buffer only: the file gets it
                    # when the fill ends, so readers of the file wait for the published shard.
                    if self.landing is None or len(self.repaired) == before:
                        in_file.append(p)
                else:
                    bad.append(p)
            except IntegrityError as exc:
                error = error or exc
                bad.append(p)
        with self._cv:
            self._state[good] = 1
            self._state[bad] = 3
            self.ticks += 1
            self._cv.notify_all()
        if self.file is not None:
            self.file.mark(_runs(sorted(in_file)))
            self.file.state(self.landed_bytes, LANDING)
        if error is not None:
            raise error

    def _merge(self, lo: int, hi: int) -> tuple[int, int, int]:
        """Add ``[lo, hi)`` to the landed spans (lock held): the span now holding it, and by how
        many bytes the landed ones grew (a range may be reported twice)."""
        spans = self._spans
        i = bisect.bisect_left(spans, [lo, lo])
        if i > 0 and spans[i - 1][1] >= lo:
            i -= 1
        j, before = i, 0
        while j < len(spans) and spans[j][0] <= hi:
            before += spans[j][1] - spans[j][0]
            lo, hi = min(lo, spans[j][0]), max(hi, spans[j][1])
            j += 1
        spans[i:j] = [[lo, hi]]
        return lo, hi, hi - lo - before

    def _check(self, p: int, repair: bool = True) -> bool:
        """Whether sample ``p``'s bytes match, reading them again when they do not (``repair``)."""
        start, size, want = int(self.table.offsets[p]), int(self.table.sizes[p]), int(self.table.checksums[p])
        if xxhash.xxh3_64_intdigest(self.view[start:start + size]) == want:
            return True
        if not repair:
            log.warning("cache: shard %s: sample at byte %d (%d bytes) fails its checksum; not served from this "
                        "download (its whole-shard check fails it)", self.name, start, size)
            return False
        for attempt in range(1, REFETCHES + 1):
            log.warning("cache: shard %s: sample at byte %d (%d bytes) fails its checksum as it landed; "
                        "reading it again (%d of %d)", self.name, start, size, attempt, REFETCHES)
            data = self._refetch(start, start + size)
            if xxhash.xxh3_64_intdigest(data) == want:
                self.view[start:start + size] = data
                with self._cv:
                    self.repaired.append((start, start + size))
                return True
        raise IntegrityError(f"shard {self.name}: the sample at bytes [{start}, {start + size}) fails its checksum "
                             f"on each of {REFETCHES + 1} reads: corrupt on storage? (shardkit verify --deep lists "
                             "every bad shard)")

    def settle(self) -> None:
        """Read again the samples that failed when a reader joined (see :meth:`follow`): the
        fill calls it once every part is in, before it writes or hashes its last bytes.

        Raises:
            IntegrityError: a sample failed its checksum on every read.
        """
        self.quiesce()
        with self._cv:
            pos = np.flatnonzero(self._state == 3)
            self._state[pos] = 2
        if len(pos):
            self._verify(pos, repair=True)

    def quiesce(self) -> None:
        """From now on no reader hashes the fill's bytes; wait for those hashing them now (the
        fill calls it before it lets go of them)."""
        with self._cv:
            self._settling = True
            while self._hashing:
                self._cv.wait()

    def finish(self, state: int, error: BaseException | None = None) -> None:
        """The attempt is over: published (:data:`DONE`) or not (:data:`FAILED`).

        Args:
            state: DONE or FAILED.
            error: why it failed, for this process's readers (None: a new attempt follows, or
                the caller raises it elsewhere).
        """
        self.quiesce()
        with self._cv:
            self.state, self.error = state, error
            self.ticks += 1
            self._cv.notify_all()
        if self.file is not None:
            try:
                self.file.state(self.landed_bytes, state)
            except OSError:
                pass  # readers elsewhere see the lock go and the header stale

    # ---- readers' side --------------------------------------------------------------------

    def verified(self, positions: np.ndarray) -> bool:
        """Whether every sample of ``positions`` is verified.

        Args:
            positions: sample positions.

        Returns:
            True when all are.
        """
        return bool((self._state[positions] == 1).all())

    def wait(self, positions: np.ndarray, quiet: float) -> bool:
        """Wait until the samples ``positions`` are verified, or this attempt is over.

        Args:
            positions: sample positions.
            quiet: seconds without any landing after which the wait gives up.

        Returns:
            True when they are verified; False when the attempt ended first (published:
            open the file; failed: a new attempt may follow).

        Raises:
            TimeoutError: nothing landed for ``quiet`` seconds.
        """
        with self._cv:
            seen, since = self.ticks, time.monotonic()
            while True:
                if self.verified(positions):
                    return True
                if self.state != LANDING:
                    return False
                self._cv.wait(min(1.0, quiet))
                if self.ticks != seen:
                    seen, since = self.ticks, time.monotonic()
                elif time.monotonic() - since >= quiet:
                    raise TimeoutError(f"shard {self.name}: nothing landed for {quiet:.0f} s")

    def flags(self) -> np.ndarray:
        """Verified flags by position (a copy).

        Returns:
            One bool per sample.
        """
        with self._cv:
            return self._state == 1

    def pin(self, take: Callable[[object], None], buf: object) -> bool:
        """Call ``take(buf)`` (pin the landing buffer) if this attempt is still landing.

        Args:
            take: pins ``buf``.
            buf: the attempt's landing buffer.

        Returns:
            True when pinned; False when the attempt is over (its buffer may be recycled).
        """
        with self._cv:
            if self.state != LANDING:
                return False
            take(buf)
            return True

    def wait_over(self, quiet: float) -> None:
        """Wait until this attempt is over (published or not).

        Args:
            quiet: seconds without any landing after which the wait gives up.

        Raises:
            TimeoutError: nothing landed for ``quiet`` seconds.
        """
        with self._cv:
            seen, since = self.ticks, time.monotonic()
            while self.state == LANDING:
                self._cv.wait(min(1.0, quiet))
                if self.ticks != seen:
                    seen, since = self.ticks, time.monotonic()
                elif time.monotonic() - since >= quiet:
                    raise TimeoutError(f"shard {self.name}: nothing landed for {quiet:.0f} s")


class Spans:
    """A shard's samples sorted by offset, to find the samples holding a byte.

    Args:
        table: the samples.
    """

    def __init__(self, table: SampleTable) -> None:
        self.table = table
        self.order = np.argsort(table.offsets, kind="stable")
        self.starts = table.offsets[self.order].astype(np.int64)
        self.ends = np.maximum.accumulate(self.starts + table.sizes[self.order])

    def holding(self, pos: int) -> int:
        """The position of the sample holding shard byte ``pos``.

        Args:
            pos: a shard byte.

        Returns:
            Its position, or -1 when no sample holds it (a gap, the archive's end).
        """
        i = int(np.searchsorted(self.starts, pos, side="right")) - 1
        if i < 0 or self.ends[i] <= pos:
            return -1
        return int(self.order[i])

    def servable(self, ok: np.ndarray, pos: int) -> int:
        """Bytes from ``pos`` on held by verified samples that follow each other with no gap.

        Args:
            ok: verified flags by position.
            pos: a shard byte.

        Returns:
            How many (0 when the sample holding ``pos`` is not verified, or none holds it).
        """
        i = int(np.searchsorted(self.starts, pos, side="right")) - 1
        if i < 0 or self.ends[i] <= pos:
            return 0
        end = pos
        sizes = self.table.sizes
        for p, s in zip(self.order[i:i + 1024].tolist(), self.starts[i:i + 1024].tolist()):  # a bounded look ahead
            if s > end or not ok[p]:
                break
            end = max(end, s + int(sizes[p]))
        return end - pos


def _runs(positions: list[int]) -> Iterator[tuple[int, int]]:
    """Sorted positions as ``[lo, hi)`` runs."""
    lo = prev = -2
    for p in positions:
        if p != prev + 1:
            if lo >= 0:
                yield lo, prev + 1
            lo = p
        prev = p
    if lo >= 0:
        yield lo, prev + 1


class Inflight:
    """This process's downloads in flight, by the cache file they will publish (reset in a forked
    child: its parent's downloads are another process's there)."""

    def __init__(self) -> None:
        self._mu = threading.Condition()
        self._by: dict[str, Progress] = {}
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._mu = threading.Condition()
        self._by = {}

    def put(self, final: str, progress: Progress) -> None:
        """Register the attempt filling ``final`` now.

        Args:
            final: the cache file it publishes.
            progress: the attempt.
        """
        with self._mu:
            self._by[final] = progress
            self._mu.notify_all()

    def drop(self, final: str, progress: Progress) -> None:
        """Forget ``progress`` (if it is still the one registered for ``final``).

        Args:
            final: the cache file.
            progress: the attempt that ended.
        """
        with self._mu:
            if self._by.get(final) is progress:
                del self._by[final]
            self._mu.notify_all()

    def get(self, final: str) -> Progress | None:
        """The attempt filling ``final`` in this process, if any.

        Args:
            final: the cache file.

        Returns:
            The attempt, or None.
        """
        with self._mu:
            return self._by.get(final)

    def wait_for(self, final: str, done: Callable[[], bool], timeout: float) -> Progress | None:
        """Wait until an attempt filling ``final`` is registered, or ``done()``.

        Args:
            final: the cache file.
            done: True once waiting makes no sense (the download thread ended).
            timeout: seconds to wait at most.

        Returns:
            The attempt, or None.
        """
        end = time.monotonic() + timeout
        with self._mu:
            while True:
                got = self._by.get(final)
                if got is not None or done() or time.monotonic() >= end:
                    return got
                self._mu.wait(0.05)


INFLIGHT = Inflight()
"""This process's downloads in flight."""
