"""Room for a download under the node cache's limit: reserving it, and evicting the files
needed last to make it (never a pinned shard, never one a prefetch must keep)."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Mapping, Optional

from shardkit.cache.files import NO_SPACE, FileLock, ShardRef, preallocate, unlink_quiet
from shardkit.cache.kept_maps import KEPT
from shardkit.cache.landing import LANDING
from shardkit.cache.layout import EX_NB, CacheDir, CacheEntry
from shardkit.cache.progress_file import progress_file_size
from shardkit.cache.schedule import Schedule
from shardkit.config import human_bytes
from shardkit.errors import CacheFullError, NoRoomError

__all__ = ["Room", "Planned", "WAIT_NOTE_SECONDS", "footprint", "keeps_progress"]

log = logging.getLogger(__name__)

_POLL = 0.05
WAIT_NOTE_SECONDS = 30.0  # a reader blocked on a full cache says so this often (until wait_timeout)

Planned = Optional[Mapping[str, int]]
"""For a prefetch, the files (and sizes) planned before it: it must neither evict them nor take
their room. None: a reader's own open."""


def keeps_progress(ref: ShardRef, limit: int) -> bool:
    """Whether a download of ``ref`` keeps a progress file, which lets other processes read its
    samples as they land: a shard whose samples the reader knows, with room for the file beside
    it under ``limit`` (a limit of exactly one shard goes without: other processes wait for the
    whole shard then).

    Args:
        ref: the shard.
        limit: the cache's ``cache_limit``.

    Returns:
        True if it does.
    """
    return bool(ref.samples is not None and len(ref.samples)
                and ref.size + progress_file_size(len(ref.samples)) <= limit)


def footprint(ref: ShardRef, limit: int) -> int:
    """The bytes a download of ``ref`` takes under ``limit`` at most: the shard, and its progress
    file if it keeps one (:func:`keeps_progress`).

    Args:
        ref: the shard.
        limit: the cache's ``cache_limit``.

    Returns:
        Bytes.
    """
    samples = ref.samples
    return ref.size + (progress_file_size(len(samples)) if samples is not None and keeps_progress(ref, limit) else 0)


class Room:
    """Reserves room for downloads in one namespace of a cache directory.

    Args:
        where: the cache directory and namespace.
        limit: bytes everything under the directory may take (all namespaces).
        schedule: this process's need order (eviction keeps the files needed soonest).
        wait_timeout: seconds to wait for readers to unpin space before CacheFullError.
        room_wait: seconds to wait while pinned shards alone leave no room, before
            NoRoomError; None: up to ``wait_timeout``.
        count: told of evictions and of seconds spent waiting (``count(name, amount)``).
    """

    def __init__(self, where: CacheDir, limit: int, schedule: Schedule, wait_timeout: float,
                 room_wait: float | None, count: Callable[[str, float], None]) -> None:
        self._dir, self._limit, self._schedule = where, limit, schedule
        self._wait_timeout, self._room_wait, self._count = wait_timeout, room_wait, count

    def reserve(self, ref: ShardRef, file: str, planned: Planned) -> tuple[str, int] | None:
        """A temp file that counts ``ref.size``, and the bytes already in it (a partial
        download adopted from any process, or none).

        Call with the shard's download lock held. Waits (polling) while readers pin the space.

        Args:
            ref: the shard.
            file: its file name in the cache.
            planned: for a prefetch, what its plan needs first (then it never waits).

        Returns:
            (temp path, bytes in it); None for a prefetch that found no room.

        Raises:
            NoRoomError: after ``room_wait`` seconds, if the pinned shards alone leave no room.
            CacheFullError: after ``wait_timeout`` seconds without room.
            CacheDiskFullError: the disk under the cache has no room for the shard (nothing is left behind).
            CacheLockedError: the global lock's holder made no progress for ``SHARDKIT_LOCK_WAIT`` seconds.
        """
        t0 = time.monotonic()
        next_note = t0 + WAIT_NOTE_SECONDS
        try:
            while True:
                with self._dir.locked():
                    got = self._dir.adopt(file, ref.size)
                    if got is not None:
                        return got
                    entries = self._dir.scan()
                    # The progress files of downloads in flight are on the same disk: counted too.
                    held = sum(e.size for e in entries) + self._dir.progress_bytes(file)
                    excess = held + footprint(ref, self._limit) - self._limit
                    if planned is not None:
                        excess += self._room_for_sooner(file, planned, entries)
                    blockers = self._evict(entries, excess, file, planned) if excess > 0 else None
                    if blockers is None:
                        return self._create(ref, file), 0
                waited = time.monotonic() - t0
                if planned is not None:
                    return None
                self._check_wait(ref, blockers or [], waited)
                if time.monotonic() >= next_note:  # a reader paused or slow elsewhere on the node: say so
                    next_note += WAIT_NOTE_SECONDS
                    log.warning("cache: %s waits %.0f s for room in %s: readers on this node keep %d shards "
                                "open (cache_limit too small for them, or a paused or stopped process?); "
                                "CacheFullError after %.0f s",
                                ref.name, waited, self._dir.root, sum(1 for e in blockers or [] if not e.temp),
                                self._wait_timeout)
                time.sleep(_POLL)
        finally:
            if time.monotonic() - t0 >= _POLL:  # count waiting, not the usual quick pass
                self._count("wait_seconds", time.monotonic() - t0)

    def _create(self, ref: ShardRef, file: str) -> str:
        """The new temp file of ``ref``, its blocks reserved where the file system can (global lock held).

        A disk with less room than ``cache_limit`` allows (other files on it, or a limit larger
        than the disk) says so here: the temp file is removed and CacheDiskFullError raised.
        """
        tmp = self._dir.temp(file, ref.size)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                preallocate(fd, ref.size)
            finally:
                os.close(fd)
        except OSError as exc:
            unlink_quiet(tmp)
            if exc.errno in NO_SPACE:
                raise self._dir.no_space(exc.errno, f"shard {ref.name}", ref.size, self._limit) from exc
            raise
        return tmp

    def _check_wait(self, ref: ShardRef, blockers: list[CacheEntry], waited: float) -> None:
        """Give up a wait that has lasted long enough (see :meth:`reserve`)."""
        pinned = [e for e in blockers if not e.temp]
        held = sum(e.size for e in pinned)
        if self._room_wait is not None and waited >= self._room_wait and held + ref.size > self._limit:
            raise NoRoomError(
                f"cache_limit {human_bytes(self._limit)}: {len(pinned)} shards in use by readers on this node hold "
                f"{human_bytes(held)}, no room for {ref.name} ({human_bytes(ref.size)}) "
                f"after {waited:.1f} s in {self._dir.root}")
        if waited >= self._wait_timeout:
            flight = [e for e in blockers if e.temp]
            raise CacheFullError(
                f"cache_limit {human_bytes(self._limit)} too small: {len(pinned)} shards in use by readers "
                f"hold {human_bytes(held)} and {len(flight)} downloads in flight "
                f"reserve {human_bytes(sum(e.size for e in flight))}; need {human_bytes(ref.size)} for {ref.name} "
                f"(waited {waited:.1f} s in {self._dir.root})")

    def _room_for_sooner(self, file: str, planned: Mapping[str, int], entries: list[CacheEntry]) -> int:
        """Bytes the shards this process needs before ``file`` will take, those not in the
        cache yet: the prefetch plan's earlier shards, and the scheduled ones up to ``file``'s
        next use (the shard a reader is about to open itself is in no prefetch plan)."""
        need = dict(planned)
        for f, size in self._schedule.before(file):
            need.setdefault(f, size)
        ns = self._dir.ns
        present = {e.file for e in entries if e.ns == ns}
        return sum(size for f, size in need.items() if f != file and f not in present)

    def _evict(self, entries: list[CacheEntry], excess: int, file: str, planned: Planned) -> list[CacheEntry] | None:
        """Delete unpinned files until ``excess`` bytes are free (global lock held).

        Order: abandoned partial downloads, then shards not in this process's schedule (least
        recently used first), then scheduled shards, furthest next use first. Returns None on
        success, else (having deleted nothing) the files that could not be evicted.
        """
        ns = self._dir.ns
        uses, mine = self._schedule.next_uses((e.file for e in entries if e.ns == ns), file)
        ranked: list[tuple[tuple[int, int], CacheEntry]] = []
        for e in entries:
            nxt = uses.get(e.file) if e.ns == ns else None
            if e.temp:
                ranked.append(((0, e.last_use), e))
            elif planned is not None and e.ns == ns and e.file in planned:
                continue
            elif nxt is None:
                ranked.append(((1, e.last_use), e))
            elif planned is None or (mine is not None and nxt > mine):
                ranked.append(((2, -nxt), e))
        ranked.sort(key=lambda r: r[0])
        held: list[tuple[CacheEntry, FileLock]] = []
        blockers: list[CacheEntry] = []
        freed = 0
        try:
            for _, e in ranked:
                if freed >= excess:
                    break
                lock = FileLock.try_take(self._dir.lock_path(e.ns, e.file, "dl" if e.temp else "pin"), EX_NB)
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
                self._count("evictions", float(not e.temp))
            return None
        finally:
            for _, lock in held:
                lock.release()
