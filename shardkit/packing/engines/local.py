"""The local engine: a pack's tasks one after another in this process.

One uploader serves the whole pack, so a task's last shard and its fragment upload while
the next task reads and frames its samples.
"""

from __future__ import annotations

from typing import Callable

from shardkit.format.manifest import fragment_name
from shardkit.packing.plan import PackPlan
from shardkit.packing.progress import Progress
from shardkit.packing.sources.base import Source
from shardkit.packing.task import PackOptions, TaskResult, completed_task, run_task
from shardkit.packing.upload import Uploader
from shardkit.storage.store import Store

__all__ = ["LocalEngine"]


class LocalEngine:
    """Runs every task in this process, skipping those an earlier run of the plan completed."""

    name = "local"

    def start(self) -> None:
        """Nothing to reach: the tasks run here."""

    def run(self, store: Store, src: Source, plan: PackPlan, opts: PackOptions, show: bool,
            check: Callable[[], None]) -> list[TaskResult]:
        """Run the plan's tasks in order.

        Args:
            store: the destination.
            src: the source.
            plan: the pack's plan.
            opts: the pack's options.
            show: show a progress bar on stderr.
            check: called before each task; raises once another pack took the destination over.

        Returns:
            Every task's result, in plan order, each stored (fragment included).

        Raises:
            DatasetExistsError: from ``check``.
            SourceError: a bad input (``on_error="raise"``).
            StorageError: a write failed.
        """
        results = []
        # On an error, close() still finishes what earlier tasks queued, so a rerun reuses them.
        stored = _stored_fragments(store)
        uploader = Uploader()
        try:
            with Progress(len(plan.items), plan.total_bytes, len(plan.tasks), "pack", enabled=show) as bar:
                for task in plan.tasks:
                    check()  # stop writing as soon as another pack has taken the destination over
                    done = completed_task(store, task, plan.plan_id) if fragment_name(task.task) in stored else None
                    if done is None:
                        done = run_task(store, src, task, plan.items[task.start:task.stop], plan.plan_id, opts,
                                        bar.advance, uploader)
                    else:
                        bar.advance(done.samples, done.bytes)
                    bar.task_done()
                    results.append(done)
                uploader.close()  # inside the bar: it finishes with the last upload
        except BaseException:
            uploader.close(check=False)
            raise
        return results


def _stored_fragments(store: Store) -> set[str]:
    """The task fragments already stored, from one listing rather than a request per task.

    A fragment missing from it is only redone; one listed is still checked by
    :func:`~shardkit.packing.task.completed_task`.

    Args:
        store: the destination.

    Returns:
        Their paths (``manifest/samples-NNNNN.parquet``).
    """
    store.fs.invalidate_cache(store.path("manifest"))  # another process may have written since
    return set(store.glob("manifest/samples-*.parquet"))
