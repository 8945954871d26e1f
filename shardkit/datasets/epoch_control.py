"""A directory the main process shares with its DataLoader workers, for state set after they started.

Persistent workers keep the copy of a dataset they were started with, so ``set_epoch`` or
``load_state_dict`` called later in the main process reaches them only through a file: the
main process writes it, and each worker reads it when its iteration starts. The directory
also holds what one rank's processes share (statistics, said-once markers). It is removed
when the object that made it is collected, in the process that made it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from typing import Any

from shardkit.cache.files import write_replace

__all__ = ["ControlDir"]


def _remove_dir(path: str, owner: int) -> None:
    if os.getpid() == owner:  # a forked worker inherits the finalizer, not the directory
        shutil.rmtree(path, ignore_errors=True)


class ControlDir:
    """A temp directory with one JSON state file, written by the main process.

    Args:
        prefix: the directory name's prefix (which reader made it).
    """

    def __init__(self, prefix: str) -> None:
        self.path = tempfile.mkdtemp(prefix=prefix)
        weakref.finalize(self, _remove_dir, self.path, os.getpid())

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
