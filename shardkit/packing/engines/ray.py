"""Running pack tasks as Ray tasks.

Local Ray is the default (``address="local"``: never a bare ``ray.init()`` that could attach
to a stale cluster); a cluster by address, or the one ``ray job submit`` put us in
(``RAY_ADDRESS``). Tasks get the Store and Source (URLs and options only; the Store with the
S3 endpoint and region the driver resolved, never its keys) and their slice of
items; they write to storage themselves and return small results, so the driver holds no
data. In-flight tasks are bounded to keep the object store and memory small.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
from typing import Any, Callable, Iterable, TypeVar

from shardkit.errors import ConfigError, ShardkitError
from shardkit.packing.plan import PlannedTask, TaskPlan
from shardkit.packing.plan_stream import Feed
from shardkit.packing.progress import Progress
from shardkit.packing.sources.base import Source, SourceItem
from shardkit.packing.sources.table import TableSource
from shardkit.packing.sources.tfrecord import TfRecordSource
from shardkit.packing.sources.wds import WdsTarSource
from shardkit.packing.task import PackOptions, TaskResult, completed_task, run_task
from shardkit.storage.options import with_env_location
from shardkit.storage.store import Store

__all__ = ["INSTALL_HINT", "RayEngine", "ensure_ray", "for_tasks", "probe_ray_address", "run_bounded"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# run_bounded's end of work (any value, None or 0 included, may be a piece of work).
_NO_MORE = object()

INSTALL_HINT = "engine='ray' needs Ray: pip install 'shardkit[ray]'"
# Set before Ray starts: a local cluster on this machine only, and no usage reporting.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def ensure_ray(address: str | None) -> Any:
    """Ray, initialised in this process (started locally or joined at ``address``).

    Args:
        address: a cluster address (``host:port``, ``ray://host:port``, ``auto``), or None for
            ``RAY_ADDRESS`` or else a local Ray on this machine.

    Returns:
        The ``ray`` module, initialised.

    Raises:
        ConfigError: Ray is not installed (says how to install it).
        ShardkitError: nothing answers at the address, or Ray fails to start.
    """
    try:
        import ray  # optional: only this engine needs it
    except ImportError as exc:
        raise ConfigError(INSTALL_HINT) from exc
    if ray.is_initialized():
        return ray
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)
    target = address or os.environ.get("RAY_ADDRESS") or "local"
    probe_ray_address(target)
    kwargs: dict[str, Any] = {"address": target, "log_to_driver": True, "ignore_reinit_error": True}
    if target == "local":
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        kwargs.update(include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        ray.init(**kwargs)
    except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ...
        raise ShardkitError(f"cannot start or reach Ray at {target}: {type(exc).__name__}: {exc}") from exc
    return ray


def probe_ray_address(address: str, timeout: float = 5.0) -> None:
    """Fail at once, naming ``address``, when nothing listens at an explicit ``host:port``.

    ``ray.init`` would retry the GCS connection for many minutes, printing C++ warnings.
    ``local``, ``auto`` and other forms are left to Ray.

    Args:
        address: ``host:port`` or ``ray://host:port`` (anything else passes).
        timeout: seconds to wait for the connection.

    Raises:
        ShardkitError: nothing answers there.
    """
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    if "://" in rest or rest in ("local", "auto"):
        return
    host, sep, port_text = rest.rstrip("/").rpartition(":")
    if not sep or not host or not port_text.isdigit():
        return
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:6379
    try:
        with socket.create_connection((host, int(port_text)), timeout=timeout):
            pass
    except OSError as exc:
        raise ShardkitError(f"cannot reach Ray at {address}: nothing answers on {host}:{port_text} "
                            f"({exc.strerror or type(exc).__name__}); is the cluster's head running?") from exc


def for_tasks(src: Source) -> Source:
    """``src`` as tasks on other nodes must see it.

    A source read from S3 (WebDataset tars, or any source with ``storage_options`` whose
    description names an ``s3://`` URL: folders, file lists, HDF5, ``.npy``, TFRecords,
    tables) is read from the endpoint and region this driver resolved
    (:func:`~shardkit.storage.options.with_env_location`), whatever the nodes' environments say.

    Args:
        src: the pack's source.

    Returns:
        ``src``, or a copy of it with the S3 location pinned.
    """
    if isinstance(src, WdsTarSource):
        on_s3 = any(u.startswith(("s3://", "s3a://")) for u in src.urls)
    else:
        on_s3 = hasattr(src, "storage_options") and (bool(getattr(src, "reads_s3", False)) or any(
            s in json.dumps(src.describe(), default=str) for s in ('"s3://', '"s3a://')))
    if on_s3:
        pinned = copy.copy(src)  # through __getstate__: open stores and threads are not copied
        pinned.storage_options = with_env_location("s3://", src.storage_options or {}) or None  # type: ignore[attr-defined]
        return pinned
    if isinstance(src, (TfRecordSource, TableSource)) and any(u.startswith(("s3://", "s3a://")) for u in src.paths):
        pinned_tfr = copy.copy(src)
        pinned_tfr.storage_options = with_env_location("s3://", src.storage_options or {}) or None
        return pinned_tfr
    return src


def _remote_task(store: Store, source: Source, task: TaskPlan, items: list[SourceItem], opts: PackOptions) -> TaskResult:
    # Skip work a killed earlier attempt (or a retry of this task) already finished.
    done = completed_task(store, task, task.fingerprint)
    if done is not None:
        return done
    result = run_task(store, source, task, items, task.fingerprint, opts)
    result.node = _node_id()
    return result


def _node_id() -> str | None:
    """The id of the Ray node this task runs on (None outside Ray): the pack's summary counts
    tasks per node, which shows whether a cluster's nodes all took part."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _run_tasks_on_ray(store: Store, src: Source, plan: Feed, opts: PackOptions, show: bool,
                      address: str | None, check: Callable[[], None] | None = None) -> list[TaskResult]:
    """Run the plan's tasks on Ray as they are planned, at most a few per CPU at once.

    Args:
        store: the destination.
        src: the source (pickled into every task: URLs, paths and options only).
        plan: the pack's plan, or its tasks as a listing plans them.
        opts: the pack's options.
        show: show a progress bar on stderr.
        address: the Ray cluster (see :func:`ensure_ray`).
        check: called before each task is submitted (the pack's claim: it raises once another
            pack took the destination over).

    Returns:
        Every task's result, in plan order.

    Raises:
        ShardkitError: a task's own error (a bad input, a failed write), or Ray's.
        SourceError: the listing failed.
    """
    ray = ensure_ray(address)
    # The tasks write where this driver plans and commits, whatever endpoint their nodes'
    # environments name (a worker without AWS_ENDPOINT_URL would otherwise go to AWS itself).
    store = Store(store.url, with_env_location(store.url, store.storage_options))
    src = for_tasks(src)
    remote = ray.remote(num_cpus=1, max_retries=3, retry_exceptions=[ConnectionError, TimeoutError])(_remote_task)

    def submit(planned: PlannedTask) -> Any:
        return remote.remote(store, src, planned.task, planned.items, opts)

    with Progress(plan.num_items, plan.total_bytes, plan.num_tasks, "pack (ray)", enabled=show) as bar:
        results = run_bounded(ray, plan, submit, bar, check, lambda: bar.set_totals(plan.num_items, plan.num_tasks))
    return [results[t] for t in sorted(results)]


def run_bounded(ray: Any, todo: Iterable[T], submit: Callable[[T], Any], bar: Progress,
                check: Callable[[], None] | None = None, on_done: Callable[[], None] | None = None
                ) -> dict[int, TaskResult]:
    """Submit ``todo`` as Ray tasks in order, at most two per cluster CPU in flight, and collect them.

    Planned tasks (as a listing plans them: the next is taken only when there is room) and a
    parts source's parts both run through this loop. On any failure the tasks still in flight
    are cancelled before the error propagates.

    Args:
        ray: the initialised ``ray`` module (:func:`ensure_ray`).
        todo: the work, submitted in this order.
        submit: starts one item of ``todo`` as a Ray task and returns its object ref.
        bar: advanced by each finished task's samples and bytes.
        check: called before each submission (the pack's claim: it raises once another pack
            took the destination over).
        on_done: called after each finished task (the bar's totals, once a listing ended).

    Returns:
        Task (or part) index -> its result.

    Raises:
        ShardkitError: a task's own error (re-raised as itself), or Ray's.
    """
    max_in_flight = max(2, int(ray.cluster_resources().get("CPU", 2)) * 2)
    results: dict[int, TaskResult] = {}
    pending: list[Any] = []
    queue = iter(todo)
    more = True
    try:
        while more or pending:
            while more and len(pending) < max_in_flight:
                work = next(queue, _NO_MORE)
                if work is _NO_MORE:
                    more = False
                    break
                if check is not None:
                    check()
                pending.append(submit(work))  # type: ignore[arg-type]
            if not pending:
                break
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                pending.remove(ref)
                try:
                    res: TaskResult = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, ShardkitError):
                        raise cause from None
                    raise
                results[res.task] = res
                bar.advance(res.samples, res.bytes)
                if on_done is not None:
                    on_done()
                bar.task_done()
    except BaseException:
        for other in pending:
            ray.cancel(other)
        raise
    return results


class RayEngine:
    """Runs a pack's tasks as Ray tasks, on a local Ray or a cluster.

    Args:
        address: the Ray cluster (see :func:`ensure_ray`); None for ``RAY_ADDRESS`` or a local Ray.
    """

    name = "ray"

    def __init__(self, address: str | None = None) -> None:
        self.address = address

    def start(self) -> None:
        """Reach Ray (or fail naming it) before the pack changes anything at its destination.

        Raises:
            ConfigError: Ray is not installed.
            ShardkitError: Ray cannot be reached or started.
        """
        ensure_ray(self.address)

    def run(self, store: Store, src: Source, plan: Feed, opts: PackOptions, show: bool,
            check: Callable[[], None]) -> list[TaskResult]:
        """Run the plan's tasks on Ray as they are planned, at most two per cluster CPU in flight.

        Args:
            store: the destination.
            src: the source (pickled into every task: URLs, paths and options only).
            plan: the pack's plan, or its tasks as a listing plans them.
            opts: the pack's options.
            show: show a progress bar on stderr.
            check: called before each task is submitted; raises once another pack took the
                destination over.

        Returns:
            Every task's result, in plan order.

        Raises:
            ShardkitError: a task's own error (a bad input, a failed write), or Ray's.
        """
        return _run_tasks_on_ray(store, src, plan, opts, show, self.address, check)
