"""Bounded waits for the node cache's ``flock`` locks, that say who holds them.

Every lock of the cache (:mod:`.layout`) is held by some process on the node. One stopped while
it holds a lock (SIGSTOP, a paused job, a frozen container) made every other reader wait on
that lock without end, printing nothing. So no lock is waited for blindly: a wait polls, logs
after :data:`~shardkit.config.LOCK_NOTE_SECONDS` which process holds the lock (its pid and
state, from ``/proc/locks``, else the pid a downloader writes into its lock file), and gives up
with :class:`~shardkit.errors.CacheLockedError` once the holder has made no progress for
:func:`~shardkit.config.lock_wait` seconds; the caller reads the shard around the cache.

Progress is the holder's CPU time (``/proc/<pid>/stat``) or a value the caller watches (the
stat of the download's temp file) changing; a stopped process changes neither. A holder that
works is waited for as long as it takes: downloads end, and storage retries are bounded.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from shardkit.cache.files import FileLock
from shardkit.config import LOCK_NOTE_SECONDS, LOCK_WAIT_ENV, lock_wait
from shardkit.errors import CacheLockedError

__all__ = ["Holder", "clear_owner", "holders", "wait_lock", "write_owner", "STUCK_REMEMBERED"]

log = logging.getLogger(__name__)

_POLL = 0.05  # the longest sleep between two tries of the lock
_LOOK = 0.25  # seconds between two looks at the holder (reads /proc/locks)
_NOTE_EVERY = 30.0  # after the first note, a wait goes on saying so this often
STUCK_REMEMBERED = 60.0  # a lock given up on this recently, with the same holders: give up sooner
_STUCK_AGAIN = 0.25  # ... after this many seconds without progress (one look after the first)
_STATES = {"R": "running", "S": "sleeping", "D": "in disk sleep", "T": "stopped", "t": "stopped by a tracer",
           "Z": "exited, not yet reaped", "I": "idle"}
_STOPPED = ("T", "t")
_stuck: dict[str, tuple[float, frozenset[int]]] = {}  # lock path -> (when a wait gave up, its holders then)
_stuck_mu = threading.Lock()


@dataclass(frozen=True)
class Holder:
    """A process holding a lock, as ``/proc`` shows it now.

    Attributes:
        pid: its process id.
        state: its ``/proc`` state letter (``T``: stopped), ``?`` when unknown.
        cpu: its user + system CPU time in clock ticks (-1 when unknown).
    """

    pid: int
    state: str
    cpu: int

    @property
    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP, a tracer)."""
        return self.state in _STOPPED

    def __str__(self) -> str:
        return f"pid {self.pid} ({_STATES.get(self.state, 'state unknown')})"


def _holder(pid: int) -> Holder:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
        return Holder(pid, fields[0], int(fields[11]) + int(fields[12]))
    except (OSError, IndexError, ValueError):
        return Holder(pid, "?", -1)


def holders(path: str) -> list[Holder]:
    """The processes holding a ``flock`` lock on the file ``path``.

    Args:
        path: the lock file.

    Returns:
        From ``/proc/locks`` (matched by device and inode); else the pid written into the file
        by :func:`write_owner`, if that process is alive; else none.
    """
    try:
        st = os.stat(path)
    except OSError:
        return []
    exact: list[int] = []
    by_inode: list[int] = []  # a device /proc/locks names differently (btrfs subvolumes, overlays)
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 6 or "->" in parts or parts[1] != "FLOCK":
                    continue  # "->": a process waiting for the lock, not holding it
                dev = parts[5].split(":")
                if len(dev) != 3 or int(dev[2]) != st.st_ino or int(parts[4]) <= 0:
                    continue
                same_dev = (int(dev[0], 16), int(dev[1], 16)) == (os.major(st.st_dev), os.minor(st.st_dev))
                (exact if same_dev else by_inode).append(int(parts[4]))
    except (OSError, ValueError):
        pass
    pids = exact or by_inode
    if not pids:
        try:
            with open(path, "rb") as f:
                owner = int(f.read(32).split()[0])
            pids = [owner] if owner > 0 and os.path.exists(f"/proc/{owner}") else []
        except (OSError, ValueError, IndexError):
            pass
    return [_holder(pid) for pid in sorted(set(pids))]


def write_owner(lock: FileLock) -> None:
    """Write this process's pid into the file of a lock it holds (best effort), for
    :func:`holders` where ``/proc/locks`` does not name it.

    Args:
        lock: a lock this process took (exclusively).
    """
    try:
        data = f"{os.getpid()}\n".encode()
        os.pwrite(lock.fd, data, 0)
        os.ftruncate(lock.fd, len(data))
    except OSError:
        pass  # a full or read-only disk: /proc/locks still names the holder


def clear_owner(lock: FileLock) -> None:
    """Empty the owner note :func:`write_owner` left, before the lock is released (best
    effort): a lock file that stays behind for every shard ever downloaded takes no disk
    block when it is empty, and the cache's bound does not count it.

    Args:
        lock: a lock this process holds, its owner note written.
    """
    try:
        os.ftruncate(lock.fd, 0)
    except OSError:
        pass  # a read-only disk: the note stays, harmless


def _describe(who: list[Holder]) -> str:
    if not who:
        return "a process /proc/locks does not show (another pid namespace?)"
    return ", ".join(str(h) for h in who)


def wait_lock(path: str, op: int, what: str, *, limit: float | None = None,
              progress: Callable[[], object] | None = None) -> FileLock:
    """Take the lock ``path``, waiting while its holder makes progress.

    Args:
        path: the lock file (created if missing).
        op: ``LOCK_EX`` or ``LOCK_SH`` (without ``LOCK_NB``).
        what: what waits, for messages (``"shard X: its download"``).
        limit: seconds without progress of the holder before giving up; None: :func:`~shardkit.config.lock_wait`.
        progress: called now and then; a change of its value counts as the holder's progress
            (e.g. the stat of the download it writes).

    Returns:
        The lock.

    Raises:
        CacheLockedError: the holder made no progress for ``limit`` seconds (names it and its pid).
    """
    lock = FileLock.try_take(path, op | fcntl.LOCK_NB)
    if lock is not None:
        return lock
    limit = lock_wait() if limit is None else limit
    t0 = time.monotonic()
    last_change = t0
    seen: object = None
    next_look, next_note = t0, t0 + LOCK_NOTE_SECONDS
    delay = 0.001
    who: list[Holder] = []
    while True:
        time.sleep(delay)
        delay = min(delay * 2, _POLL)
        lock = FileLock.try_take(path, op | fcntl.LOCK_NB)
        if lock is not None:
            with _stuck_mu:
                _stuck.pop(path, None)
            return lock
        now = time.monotonic()
        if now < next_look:
            continue
        next_look = now + _LOOK
        who = holders(path)
        sign = (tuple((h.pid, h.cpu) for h in who if not h.stopped), progress() if progress is not None else None)
        if sign != seen:
            if seen is not None:
                last_change = now
            seen = sign
        bound = limit
        with _stuck_mu:
            before = _stuck.get(path)
        if before is not None and now - before[0] < STUCK_REMEMBERED and before[1] == frozenset(h.pid for h in who):
            bound = min(limit, _STUCK_AGAIN)  # the same holders that were stuck a moment ago
        if now - last_change >= bound:
            with _stuck_mu:
                _stuck[path] = (now, frozenset(h.pid for h in who))
            raise CacheLockedError(
                f"{what}: lock {path} is held by {_describe(who)}, with no progress for {now - last_change:.1f} s "
                f"(waited {now - t0:.1f} s); reading around the node cache instead: resume or end that process "
                f"({LOCK_WAIT_ENV} sets the wait)")
        if now >= next_note:
            next_note = now + _NOTE_EVERY
            log.warning("cache: %s has waited %.0f s for lock %s, held by %s; reading around the cache once "
                        "it makes no progress for %.0f s (%s)", what, now - t0, path, _describe(who), bound,
                        LOCK_WAIT_ENV)
