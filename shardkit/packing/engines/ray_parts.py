"""Running the parts of a parts source as Ray tasks, one task per part.

Each task gets the destination Store (pinned to the endpoint and region this driver resolved,
as for planned tasks: :mod:`shardkit.packing.engines.ray`), the parts source (its function
pickled with cloudpickle, as Ray pickles any task argument) and the part's index; it skips a
part an earlier run or attempt finished, else packs it and returns a small result.
"""

from __future__ import annotations

from typing import Any, Callable

from shardkit.packing.engines.ray import ensure_ray, run_bounded
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

    def submit(part: int) -> Any:
        return remote.remote(store, parts_ref, part, plan_id, opts)

    with Progress(None, None, len(todo), "pack parts (ray)", enabled=show) as bar:
        return run_bounded(ray, todo, submit, bar, check)
