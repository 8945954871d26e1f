"""Where this process sits: DDP rank and world size, DataLoader worker, node.

Rank and world size come from ``torch.distributed`` when it is initialised, else from the
standard ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` variables (read when
called); the DataLoader worker from ``torch.utils.data.get_worker_info()``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Topology:
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


def current(rank: int | None = None, world_size: int | None = None) -> Topology:
    """The topology of the calling process; explicit ``rank``/``world_size`` win."""
    r, w = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    worker, num_workers = 0, 1
    try:
        import torch.distributed as dist
        from torch.utils.data import get_worker_info

        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        info = get_worker_info()
        if info is not None:
            worker, num_workers = info.id, info.num_workers
    except ImportError:
        pass
    r = r if rank is None else rank
    w = w if world_size is None else world_size
    if not 0 <= r < w:
        raise ConfigError(f"rank {r} is outside world_size {w}")
    return Topology(r, w, worker, num_workers)
