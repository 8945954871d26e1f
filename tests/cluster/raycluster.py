"""A real two-node Ray cluster on 127.0.0.1 for tests: ``ray start --head`` + ``ray start --address``.

Each node is its own ``ray start`` in its own session (``start_new_session``), with its
own ``--temp-dir``, custom resource, CPU and every port it opens chosen free at runtime, so
clusters of other test sessions on this machine are never touched: teardown kills the processes
of our sessions (and any stray one naming our temp dirs), never ``ray stop``, which stops every Ray
of the user on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ClusterError", "Node", "RayCluster", "free_port"]

# GCS health checks fast enough that a killed node is declared dead in seconds, not ~30 s:
# until then Ray may still lease retried tasks to it.
FAST_DEATH_ENV = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
                  "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}
START_TIMEOUT = 60.0
# ``ray start --address`` on one host, on loopback. Ray refuses to join a node while
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (how the project keeps Ray on loopback), and with it on
# it rewrites the 127.0.0.1 of --address to the host's routable IP, where a head started with
# --node-ip-address 127.0.0.1 does not listen. Real clusters use real IPs and meet neither;
# here `ray start` runs with the join allowed and the address taken as given, in its own
# process only (its daemons keep the loopback environment).
JOIN_ON_LOOPBACK = ("import ray._private.ray_constants as c, ray._private.services as s\n"
                    "c.ENABLE_RAY_CLUSTER = True\n"
                    "s.resolve_ip_for_localhost = lambda host: host\n"
                    "from ray.scripts.scripts import main\n"
                    "main()\n")


class ClusterError(RuntimeError):
    """The test cluster could not be started or did not come up."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    """One ``ray start`` of the cluster.

    Attributes:
        name: ``head`` or ``worker`` (also its custom resource).
        temp_dir: its ``--temp-dir``.
        sid: the session of its processes: the ``ray start`` that spawned them leads it (the
            raylet gives each worker a process group of its own, and a title without the temp
            dir, but every process stays in the session).
        node_id: Ray's hex node id, once the cluster is up.
        log: the output of its ``ray start``.
    """

    name: str
    temp_dir: Path
    sid: int = 0
    node_id: str = ""
    log: Path = field(default_factory=Path)


class RayCluster:
    """Start, query and tear down a two-node Ray cluster on loopback.

    Args:
        root: a short directory for the nodes' temp dirs (Ray's socket paths must stay short).
        env: the environment of the nodes (and so of every Ray worker on them).
        object_store_bytes: each node's object store.
    """

    def __init__(self, root: Path, env: dict[str, str], object_store_bytes: int = 80 * 2**20) -> None:
        self.root = root
        self.env = env
        self.object_store_bytes = object_store_bytes
        self.ray_cli = str(Path(sys.executable).parent / "ray")
        self.port = free_port()
        self.dashboard_port = free_port()
        self.head = Node("head", root / "h")
        self.worker = Node("worker", root / "w")

    @property
    def address(self) -> str:
        """The GCS address drivers join (``RAY_ADDRESS``)."""
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard(self) -> str:
        """The job submission address (``ray job submit --address``)."""
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _node_args(self, node: Node) -> list[str]:
        return ["--node-ip-address=127.0.0.1", "--num-cpus=1", f"--resources={json.dumps({node.name: 1})}",
                f"--object-store-memory={self.object_store_bytes}", f"--temp-dir={node.temp_dir}",
                f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
                f"--metrics-export-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
                f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
                # 0: each worker binds a port the OS picks (the default is a fixed shared range).
                "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats", "--log-style=record"]

    def _start(self, node: Node, args: list[str], env: dict[str, str], shim: bool = False) -> None:
        node.temp_dir.mkdir(parents=True, exist_ok=True)
        node.log = self.root / f"start-{node.name}.log"
        with open(node.log, "wb") as out:
            cli = [sys.executable, "-c", JOIN_ON_LOOPBACK] if shim else [self.ray_cli]
            proc = subprocess.Popen([*cli, "start", *args, *self._node_args(node)], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root)
            node.sid = proc.pid  # the session leader: its daemons and workers stay in its session
            try:
                code = proc.wait(timeout=START_TIMEOUT)
            except subprocess.TimeoutExpired:
                code = None
        if code != 0:
            said = [ln.strip() for ln in node.log.read_text(errors="replace").splitlines() if ln.strip()]
            last = said[-1][-300:] if said else "no output"
            ran = "timed out after %.0fs" % START_TIMEOUT if code is None else f"exit {code}"
            raise ClusterError(f"ray start of the {node.name} node on {self.address} failed ({ran}): {last}")

    def start(self) -> None:
        """Start the head, then the worker, and wait until both are alive.

        Raises:
            ClusterError: a ``ray start`` failed or both nodes were not alive in time.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self._start(self.head, ["--head", f"--port={self.port}", "--include-dashboard=true",
                                "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                                f"--ray-client-server-port={free_port()}"], {**self.env, **FAST_DEATH_ENV})
        self._start(self.worker, [f"--address={self.address}"], self.env, shim=True)
        self.wait_nodes(2)

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's nodes as the head's state API lists them.

        Returns:
            Ray's node records (``node_id``, ``state``, ``resources_total``, ...); [] while the
            dashboard does not answer yet.
        """
        try:
            with urllib.request.urlopen(f"{self.dashboard}/api/v0/nodes?limit=100&detail=1", timeout=10) as r:
                return list(json.loads(r.read())["data"]["result"]["result"])
        except (OSError, ValueError, KeyError):
            return []

    def wait_nodes(self, alive: int, timeout: float = 60.0) -> None:
        """Wait until ``alive`` nodes are alive, and learn the node ids by their resources.

        Args:
            alive: how many nodes must be alive.
            timeout: seconds to wait.

        Raises:
            ClusterError: they were not, naming what was seen.
        """
        deadline = time.monotonic() + timeout
        seen: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            seen = self.nodes()
            up = [n for n in seen if n.get("state") == "ALIVE"]
            if len(up) >= alive:
                for n in up:
                    for node in (self.head, self.worker):
                        if node.name in n.get("resources_total", {}):
                            node.node_id = str(n["node_id"])
                return
            time.sleep(0.5)
        raise ClusterError(f"the Ray cluster at {self.address} has not {alive} alive nodes after {timeout:.0f}s: "
                           f"{[(n.get('node_id'), n.get('state')) for n in seen]}")

    def kill(self, node: Node) -> None:
        """SIGKILL every process of ``node``: its raylet, agents and workers.

        Args:
            node: the node to kill.
        """
        for pid in self._pids(node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _pids(self, node: Node) -> list[int]:
        """Processes of ``node``: in its session, or naming its temp dir."""
        mark = str(node.temp_dir).encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                if os.getsid(int(entry)) == node.sid:
                    pids.append(int(entry))
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if mark in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
        return pids

    def stop(self) -> None:
        """Stop both nodes (SIGTERM, then SIGKILL) and remove their temp dirs."""
        for node in (self.worker, self.head):
            if not node.sid:
                continue
            for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
                for pid in self._pids(node):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                deadline = time.monotonic() + grace
                while self._pids(node) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if not self._pids(node):
                    break
        shutil.rmtree(self.root, ignore_errors=True)
