"""Running the parts of a parts source as Ray tasks, one task per part.

Each task gets the destination Store (pinned to the endpoint and region this driver resolved,
as for planned tasks: :mod:`shardkit.packing.engines.ray`), the parts source (its function
pickled with cloudpickle, as Ray pickles any task argument) and the part's index; it skips a
part an earlier run or attempt finished, else packs it and returns a small result.
"""

from __future__ import annotations

from typing import Any, Callable

from shardkit.errors import ShardkitError
from shardkit.packing.engines.ray import ensure_ray
from shardkit.packing.part_task import completed_part, run_part
from shardkit.packing.progress import Progress
from shardkit.packing.sources.parts import Parts
from shardkit.packing.task import PackOptions, TaskResult
from shardkit.storage.options import with_env_location
from shardkit.storage.store import Store

__all__ = ["run_parts_on_ray"]


def _remote_part(store: Store, parts: Parts, part: int, plan_id: str, opts: PackOptions) -> TaskResult:
    done = completed_part(store, part, plan_id)  # a retry of a part its killed attempt finished
    if done is not None:
        return done
    skipped: list[dict[str, str]] = []
    return run_part(store, part, parts.samples(part, skipped if opts.on_error == "skip" else None), skipped,
                    plan_id, opts)


def run_parts_on_ray(store: Store, parts: Parts, todo: list[int], plan_id: str, opts: PackOptions, show: bool,
                     address: str | None, check: Callable[[], None]) -> dict[int, TaskResult]:
    """Pack the parts ``todo`` as Ray tasks, at most two per cluster CPU in flight.

    Args:
        store: the destination.
        parts: the source.
        todo: the parts to pack (those an earlier run did not finish).
        plan_id: the pack's fingerprint.
        opts: the pack's options.
        show: show a progress bar on stderr.
        address: the Ray cluster (see :func:`~shardkit.packing.engines.ray.ensure_ray`).
        check: called before each part is submitted; raises once another pack took the
            destination over.

    Returns:
        Part index -> its result.

    Raises:
        ShardkitError: a part's own error (one line naming the part), or Ray's.
    """
    ray = ensure_ray(address)
    store = Store(store.url, with_env_location(store.url, store.storage_options))
    remote = ray.remote(num_cpus=1, max_retries=3, retry_exceptions=[ConnectionError, TimeoutError])(_remote_part)
    parts_ref = ray.put(parts)  # pickled once, not once per task
    max_in_flight = max(2, int(ray.cluster_resources().get("CPU", 2)) * 2)
    results: dict[int, TaskResult] = {}
    pending: dict[Any, int] = {}
    queue = list(todo)
    try:
        with Progress(None, None, len(queue), "pack parts (ray)", enabled=show) as bar:
            while queue or pending:
                while queue and len(pending) < max_in_flight:
                    check()
                    part = queue.pop(0)
                    pending[remote.remote(store, parts_ref, part, plan_id, opts)] = part
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    pending.pop(ref)
                    try:
                        res: TaskResult = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        cause = getattr(exc, "cause", None)
                        if isinstance(cause, ShardkitError):
                            raise cause from None
                        raise
                    results[res.task] = res
                    bar.advance(res.samples, res.bytes)
                    bar.task_done()
    except BaseException:
        for other in pending:
            ray.cancel(other)
        raise
    return results
