"""The local engine: a pack's tasks one after another in this process.

One uploader serves the whole pack, so a task's last shard and its fragment upload while
the next task reads and frames its samples. Tasks run as they are planned: with a plan made as
the source is listed, packing starts while the listing goes on.
"""

from __future__ import annotations

from typing import Callable

from shardkit.format.manifest import fragment_name
from shardkit.packing.plan_stream import Feed
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

    def run(self, store: Store, src: Source, plan: Feed, opts: PackOptions, show: bool,
            check: Callable[[], None]) -> list[TaskResult]:
        """Run the plan's tasks in order, each as soon as it is planned.

        Args:
            store: the destination.
            src: the source.
            plan: the pack's plan, or its tasks as a listing plans them.
            opts: the pack's options.
            show: show a progress bar on stderr.
            check: called before each task; raises once another pack took the destination over.

        Returns:
            Every task's result, in plan order, each stored (fragment included).

        Raises:
            DatasetExistsError: from ``check``.
            SourceError: a bad input (``on_error="raise"``), or the listing failed.
            StorageError: a write failed.
        """
        results = []
        # On an error, close() still finishes what earlier tasks queued, so a rerun reuses them.
        stored = _stored_fragments(store)
        uploader = Uploader()
        try:
            with Progress(plan.num_items, plan.total_bytes, plan.num_tasks, "pack", enabled=show) as bar:
                for planned in plan:
                    task = planned.task
                    check()  # stop writing as soon as another pack has taken the destination over
                    done = completed_task(store, task, task.fingerprint) if fragment_name(task.task) in stored else None
                    if done is None:
                        done = run_task(store, src, task, planned.items, task.fingerprint, opts, bar.advance, uploader)
                    else:
                        bar.advance(done.samples, done.bytes)
                    bar.set_totals(plan.num_items, plan.num_tasks)
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
