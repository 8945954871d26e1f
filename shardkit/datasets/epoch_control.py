"""A directory the main process shares with its DataLoader workers, for state set after they started.

Persistent workers keep the copy of a dataset they were started with, so ``set_epoch`` or
``load_state_dict`` called later in the main process reaches them only through a file: the
main process writes it, and each worker reads it when its iteration starts. The directory
also holds what one rank's processes share (statistics, said-once markers). It is removed
when the object that made it is collected, in the process that made it.

A process killed (SIGKILL, the OOM killer) removes nothing, so each directory is named
``<prefix><pid>-<random>`` and holds a file its process keeps a shared ``flock`` on for as long
as it lives (its forked workers inherit it). The first directory a process makes sweeps the
temp directory for the ones whose owner is dead: the name matches that pattern, the directory is
this user's, no process with that pid exists and nobody holds the lock (a process in another
pid namespace still does). Directories of the old unnamed kind are left alone.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
import weakref
from typing import Any

from shardkit.cache.files import write_replace
from shardkit.util.procs import pid_alive

__all__ = ["ControlDir", "sweep_dead_dirs"]

log = logging.getLogger(__name__)

_OWNED = re.compile(r"^shardkit-(?:stream|wds)-(?P<pid>[0-9]+)-[a-z0-9_]+$")
_OWNER_LOCK = "owner.lock"
_SWEEP_EVERY = 60.0  # seconds between two sweeps by one process
_swept_at: float | None = None


def _remove_dir(path: str, owner: int, lock_fd: int) -> None:
    if os.getpid() == owner:  # a forked worker inherits the finalizer, not the directory
        shutil.rmtree(path, ignore_errors=True)
    try:
        os.close(lock_fd)
    except OSError:
        pass  # closed already (the process is going away)


def sweep_dead_dirs(root: str | None = None) -> list[str]:
    """Remove the control directories of dead processes (see the module docstring).

    Args:
        root: where to look; None: the temp directory.

    Returns:
        The directories removed.
    """
    root = tempfile.gettempdir() if root is None else root
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        m = _OWNED.match(entry.name)
        if m is None or int(m["pid"]) == os.getpid():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or pid_alive(int(m["pid"])):
                continue
            fd = os.open(os.path.join(entry.path, _OWNER_LOCK), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = -1  # gone meanwhile, or made before its lock file was: its pid is dead all the same
        except OSError:
            continue
        try:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its owner lives (elsewhere)
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        except OSError:
            continue
        finally:
            if fd >= 0:
                os.close(fd)
    if removed:
        log.info("removed %d control directories of dead readers in %s", len(removed), root)
    return removed


class ControlDir:
    """A temp directory with one JSON state file, written by the main process.

    Args:
        prefix: the directory name's prefix (which reader made it).
    """

    def __init__(self, prefix: str) -> None:
        global _swept_at
        if _swept_at is None or time.monotonic() - _swept_at >= _SWEEP_EVERY:
            _swept_at = time.monotonic()
            sweep_dead_dirs()
        self.path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
        lock_fd = os.open(os.path.join(self.path, _OWNER_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock_fd, fcntl.LOCK_SH)  # held while this process (or a forked worker) lives
        weakref.finalize(self, _remove_dir, self.path, os.getpid(), lock_fd)

    def write(self, state: dict[str, Any]) -> None:
        """Replace the state file (atomically: a reader sees the old state or the new one).

        Args:
            state: a JSON-able dict.
        """
        write_replace(os.path.join(self.path, "control.json"), json.dumps(state).encode())

    def read(self) -> dict[str, Any] | None:
        """The state last written.

        Returns:
            The state, or None when the directory is gone (the object was copied to another
            node, say): the caller's own copy is then all there is.
        """
        try:
            with open(os.path.join(self.path, "control.json")) as f:
                state: dict[str, Any] = json.load(f)
        except FileNotFoundError:
            return None
        return state

    def say_once(self, what: str) -> bool:
        """Whether the caller is the first of the processes sharing this directory to ask about ``what``.

        A warning every DataLoader worker would give is then said once per rank: a marker
        file, created exclusively, tells the first (the rank's main process or any of its
        workers, in any epoch) from the others.

        Args:
            what: the name of the thing to say.

        Returns:
            True for the first to ask (and when the directory is gone: better a line per
            worker than none), False for the others.
        """
        try:
            os.close(os.open(os.path.join(self.path, f"said-{what}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:
            return True
        return True
