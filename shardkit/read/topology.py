"""Where this process sits: DDP rank and world size, and DataLoader worker.

Rank and world size, first found wins:

1. explicit ``rank=``/``world_size=`` arguments;
2. ``torch.distributed`` of this process, when it is initialised;
3. in a DataLoader worker, the rank and world size of the process that started it, carried
   by a :class:`FromParent` in the pickled dataset: workers started by ``spawn`` or
   ``forkserver`` (the default inside ``torch.multiprocessing.spawn`` ranks) have no process
   group, and a rank launched with ``init_process_group(rank=, world_size=)`` may have no
   ``RANK`` in its environment either;
4. the standard ``RANK``/``WORLD_SIZE`` variables (read when called);
5. rank 0 of 1.

The DataLoader worker comes from ``torch.utils.data.get_worker_info()``.

This module never imports torch: it looks torch up in ``sys.modules``. A process that never
imported torch has no process group and is no DataLoader worker (a worker's loop imports
``torch.utils.data``, and initialising a process group imports ``torch.distributed``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from shardkit.errors import ConfigError

__all__ = ["FromParent", "Topology", "current"]


@dataclass(frozen=True)
class Topology:
    """Where a reader sits: its DDP ``rank`` of ``world_size``, and its DataLoader ``worker``
    of ``num_workers`` (0 of 1 outside a DataLoader worker)."""

    rank: int
    world_size: int
    worker: int
    num_workers: int


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _distributed() -> tuple[int, int] | None:
    """(rank, world size) of this process's torch.distributed process group, if any."""
    dist: Any = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _worker_info() -> Any:
    """``torch.utils.data.get_worker_info()`` (id, num_workers), or None outside a worker."""
    data: Any = sys.modules.get("torch.utils.data")
    return data.get_worker_info() if data is not None else None


class FromParent:
    """The rank and world size of the process that pickled this object, for the process that
    unpickles it: a dataset holds one, and a DataLoader worker that is not forked gets the
    dataset pickled by the rank's main process. A forked worker inherits the object without
    pickling; what it holds then belongs to another process and is not used."""

    def __init__(self) -> None:
        self.value: tuple[int, int] | None = None
        self.pid = 0

    def __getstate__(self) -> dict[str, tuple[int, int] | None]:
        found = _distributed()
        if found is None:
            try:
                found = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
            except ConfigError:  # said by the worker, which reads the same environment
                pass
        return {"value": found}

    def __setstate__(self, state: dict[str, tuple[int, int] | None]) -> None:
        self.value, self.pid = state["value"], os.getpid()

    def get(self) -> tuple[int, int] | None:
        """What the pickling process's rank and world size were, in the process that unpickled it.

        Returns:
            The carried (rank, world size); None in the process that made this object (or in
            a forked child of it, which inherited it without pickling), or when the pickling
            process's ``RANK``/``WORLD_SIZE`` were no integers.
        """
        return self.value if self.pid == os.getpid() else None


def current(rank: int | None = None, world_size: int | None = None,
            parent: FromParent | None = None) -> Topology:
    """The topology of the calling process (see the module docstring for the order).

    Args:
        rank: this process's rank, overriding every other source.
        world_size: the world size, overriding every other source.
        parent: what the dataset carries from the process that pickled it (used only in a
            DataLoader worker without a process group of its own).

    Returns:
        The topology.

    Raises:
        ConfigError: the rank lies outside the world size, or ``RANK``/``WORLD_SIZE`` is not
            an integer.
    """
    worker, num_workers = 0, 1
    found = _distributed()
    info = _worker_info()
    if info is not None:
        worker, num_workers = info.id, info.num_workers
        if found is None and parent is not None:
            found = parent.get()
    r, w = found if found is not None else (_env_int("RANK", 0), _env_int("WORLD_SIZE", 1))
    r = r if rank is None else rank
    w = w if world_size is None else world_size
    if not 0 <= r < w:
        raise ConfigError(f"rank {r} is outside world_size {w}")
    return Topology(r, w, worker, num_workers)
