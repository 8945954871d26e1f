"""The engines that run a pack's planned tasks, picked by name.

Every engine runs the same task body (:func:`shardkit.packing.task.run_task`) and hands back
the results in plan order; they differ in where the tasks run. An engine that needs an
optional package says how to install it when it is picked without it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable, Protocol

from shardkit.errors import ConfigError
from shardkit.packing.engines.local import LocalEngine
from shardkit.packing.engines.ray import INSTALL_HINT as RAY_INSTALL_HINT
from shardkit.packing.engines.ray import RayEngine
from shardkit.packing.plan_stream import Feed
from shardkit.packing.sources.base import Source
from shardkit.packing.task import PackOptions, TaskResult
from shardkit.storage.store import Store

__all__ = ["ENGINES", "Engine", "EngineSpec", "LocalEngine", "RayEngine", "engine_for"]


class Engine(Protocol):
    """Runs a pack's tasks somewhere."""

    name: str

    def start(self) -> None:
        """Reach what runs the tasks, before the pack changes anything at its destination."""
        ...

    def run(self, store: Store, src: Source, plan: Feed, opts: PackOptions, show: bool,
            check: Callable[[], None]) -> list[TaskResult]:
        """Run every task of the plan, each as soon as it is planned.

        Args:
            store: the destination.
            src: the source.
            plan: the pack's plan, or its tasks as a listing plans them.
            opts: the pack's options.
            show: show a progress bar on stderr.
            check: called before each task; raises once another pack took the destination over.

        Returns:
            Every task's result, in plan order, each stored (fragment included).
        """
        ...


@dataclass(frozen=True)
class EngineSpec:
    """An engine as :func:`engine_for` finds it.

    Attributes:
        make: makes the engine, given the Ray address option (engines other than Ray ignore it).
        requires: the optional module the engine imports (None: nothing beyond shardkit's own).
        install_hint: the error when ``requires`` is missing, saying how to install it.
    """

    make: Callable[[str | None], Engine]
    requires: str | None = None
    install_hint: str = ""


ENGINES: dict[str, EngineSpec] = {
    "local": EngineSpec(lambda _address: LocalEngine()),
    "ray": EngineSpec(RayEngine, requires="ray", install_hint=RAY_INSTALL_HINT),
}


def engine_for(name: str, address: str | None = None) -> Engine:
    """The engine called ``name``.

    Args:
        name: a key of :data:`ENGINES` (``"local"`` or ``"ray"``).
        address: the Ray cluster address, for the Ray engine.

    Returns:
        The engine, ready to :meth:`~Engine.start`.

    Raises:
        ConfigError: no engine has that name, or the one named needs a package that is not
            installed (the error says how to install it).
    """
    spec = ENGINES.get(name)
    if spec is None:
        raise ConfigError(f"engine: expected {' or '.join(repr(n) for n in ENGINES)}, got {name!r}")
    if spec.requires is not None and not _installed(spec.requires):
        raise ConfigError(spec.install_hint)
    return spec.make(address)


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (importing Ray is slow)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False
