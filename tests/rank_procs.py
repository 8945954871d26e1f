"""Rank processes the way ``torchrun`` starts them, for the DDP tests: one Python process per
rank running a worker script, the rendezvous in RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT /
LOCAL_WORLD_SIZE, each writing its results as JSON to the ``out`` path of its config.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(worker: Path, confs: list[dict[str, Any]], local_world: list[int] | None = None,
              timeout: float = 180) -> list[dict[str, Any]]:
    """Run one process per config (rank = its position) to the end, within ``timeout`` seconds
    for all of them (any still running then is killed and the test fails).

    Args:
        worker: the script each rank runs; it gets its config as JSON in argv[1].
        confs: each rank's config, with ``out``: where the rank writes its JSON results.
        local_world: each rank's LOCAL_WORLD_SIZE (the ranks on its node); default all of them.
        timeout: seconds for the whole run.

    Returns:
        Each rank's results, read from its ``out``.
    """
    port, world = free_port(), len(confs)
    procs = []
    for rank, conf in enumerate(confs):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "LOCAL_WORLD_SIZE": str(local_world[rank] if local_world else world),
               "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen([sys.executable, str(worker), json.dumps(conf)], env=env))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            assert p.wait(timeout=max(0.0, deadline - time.monotonic())) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(Path(c["out"]).read_text()) for c in confs]
