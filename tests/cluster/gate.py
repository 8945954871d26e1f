"""A source wrapper that holds loads at a gate, so a test can act while tasks are mid-pack.

Each held load first leaves a mark ``<node id>.<key>`` in a directory the test watches (the
node from Ray's runtime context), then waits while a flag file exists and until tasks on
``nodes`` distinct Ray nodes have reached the gate (bounded: ``timeout`` seconds after the
first load reached it, every load goes on, and the test's own assertions say what did not
happen). Everything else is the wrapped source's, so the pack's plan is the plain source's
plan: a plain rerun resumes it.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["Gate", "install_from_env", "marked_nodes"]


def marked_nodes(marks: str | Path) -> set[str]:
    """The node ids that have left a mark in ``marks``."""
    try:
        return {name.split(".", 1)[0] for name in os.listdir(marks)}
    except FileNotFoundError:
        return set()


def _first_mark(marks: str | Path) -> float:
    """When the first mark was left in ``marks`` (now if none was)."""
    times = [e.stat().st_mtime for e in os.scandir(marks)]
    return min(times) if times else time.time()


class Gate:
    """Wraps a source; ``load`` of the items from index ``held_from`` on waits at the gate.

    Args:
        inner: the source to wrap.
        marks: the directory the marks go to.
        flag: a file; loads wait while it exists (None: no flag).
        nodes: loads wait until tasks on this many nodes are at the gate.
        held_from: the position (in listing order) of the first item held.
        timeout: the most seconds loads wait, from the first load that reached the gate.
    """

    def __init__(self, inner: Any, marks: str, flag: str | None = None, nodes: int = 1, held_from: int = 0,
                 timeout: float = 90.0) -> None:
        self.inner = inner
        self.marks = marks
        self.flag = flag
        self.nodes = nodes
        self.timeout = timeout
        self.held: set[str] | None = None
        self.held_from = held_from

    def list_items(self) -> Any:
        items = self.inner.list_items()
        self.held = {it.key for it in items[self.held_from:]}
        return items

    def _held(self) -> set[str]:
        # A pack that plans as the source is listed pickles the gate into tasks before the
        # listing ends: each copy lists the (local, small) source itself, once.
        if self.held is None:
            self.held = {it.key for it in self.inner.list_items()[self.held_from:]}
        return self.held

    def load(self, item: Any) -> Any:
        if item.key in self._held():
            import ray

            node = ray.get_runtime_context().get_node_id()
            Path(self.marks, f"{node}.{item.key.replace('/', '_')}").touch()
            # One deadline for all loads (from the first mark): a gate that never opens costs
            # ``timeout`` once, not once per held item.
            deadline = _first_mark(self.marks) + self.timeout
            while time.time() < deadline and (
                    (self.flag is not None and os.path.exists(self.flag))
                    or len(marked_nodes(self.marks)) < self.nodes):
                time.sleep(0.05)
        return self.inner.load(item)

    @property
    def storage_options(self) -> Any:
        """The wrapped source's: the Ray engine pins the driver's S3 endpoint into a copy of the
        source for its tasks, which must reach the wrapped source (AttributeError if it has none)."""
        return self.inner.storage_options

    @storage_options.setter
    def storage_options(self, value: Any) -> None:
        self.inner = copy.copy(self.inner)  # the driver's own source keeps its options
        self.inner.storage_options = value

    def __getattr__(self, name: str) -> Any:
        # describe(), labels(), listing ...: the wrapped source's (never recurse while unpickling).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def install_from_env() -> None:
    """Wrap every source ``shardkit.pack`` resolves in a :class:`Gate` configured by
    ``SK_GATE_MARKS``, ``SK_GATE_FLAG``, ``SK_GATE_NODES`` and ``SK_GATE_HELD_FROM``."""
    import shardkit.packing.pack as packing

    real = packing.resolve_source
    flag = os.environ.get("SK_GATE_FLAG") or None
    nodes = int(os.environ.get("SK_GATE_NODES", "1"))
    held_from = int(os.environ.get("SK_GATE_HELD_FROM", "0"))

    def gated(*args: Any, **kwargs: Any) -> Gate:
        return Gate(real(*args, **kwargs), os.environ["SK_GATE_MARKS"], flag, nodes, held_from)

    packing.resolve_source = gated  # type: ignore[assignment]
