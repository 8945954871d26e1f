"""What every DDP test worker (tests/ddp_*_worker.py) does around its reading: the gloo process
group from the torchrun-style environment (tests/rank_procs.py), the config in argv[1], resuming
from ``state_in``, the step loop DDP's backward would synchronise, and the result JSON at ``out``.
"""

import json
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist


def start() -> dict[str, Any]:
    """Join the gloo process group; return this rank's config (JSON in argv[1])."""
    cfg: dict[str, Any] = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    return cfg


def resume(loader: Any, cfg: dict[str, Any]) -> None:
    """Load the loader's state from the config's ``state_in`` file, if it names one."""
    if cfg.get("state_in"):
        with open(cfg["state_in"]) as f:
            loader.load_state_dict(json.load(f))


def run_steps(loader: Any, cfg: dict[str, Any], out: dict[str, Any], take: Callable[[Any], None]) -> None:
    """Read ``loader`` to its end, or to ``stop_after`` steps (then ``out["state"]`` is its state).

    ``take`` records each batch in ``out``; ``out["steps"]`` counts them. Every step all-reduces
    as DDP's backward does, so every rank's step waits for the others.
    """
    for batch in loader:
        take(batch)
        out["steps"] += 1
        dist.all_reduce(torch.ones(1))
        if cfg.get("stop_after") and out["steps"] == cfg["stop_after"]:
            out["state"] = loader.state_dict()
            break


def finish(cfg: dict[str, Any], out: dict[str, Any]) -> None:
    """Write ``out`` as JSON to the config's ``out`` path and leave the process group."""
    with open(cfg["out"], "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
