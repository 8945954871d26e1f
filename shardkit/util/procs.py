"""Facts about other processes on this machine, asked of the kernel without side effects."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether a process with id ``pid`` exists on this machine (it may belong to another user).

    Args:
        pid: the process id to look for.

    Returns:
        False only when the kernel says there is no such process.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True
