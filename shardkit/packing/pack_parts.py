"""Packing a source of N parts (:class:`~shardkit.packing.sources.parts.Parts`): one task per part.

The pack's fingerprint is the parts' description (their number and the identity of their
function) and the options, so a rerun of the same pack after a kill takes over its claim and
redoes only the parts whose staged fragment and shards are not complete
(:func:`~shardkit.packing.part_task.completed_part`). The local engine packs the parts in
order in this process; the Ray engine runs one Ray task per part
(:mod:`shardkit.packing.engines.ray_parts`). The driver alone commits
(:mod:`shardkit.packing.part_commit`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import xxhash

from shardkit.packing.claim import Claim
from shardkit.packing.destination import prepare_destination, refuse_committed, say_replaced, sweep_temp
from shardkit.packing.part_commit import commit_parts
from shardkit.packing.part_task import completed_part, run_part, staged_fragment
from shardkit.packing.progress import Progress
from shardkit.packing.sources.parts import Parts
from shardkit.packing.task import PackOptions, TaskResult
from shardkit.storage.store import Store

__all__ = ["pack_parts", "parts_plan_id"]


def parts_plan_id(settings: dict[str, Any]) -> str:
    """The fingerprint of a pack of parts: a rerun with the same one resumes it.

    Args:
        settings: the source's description and every option that changes the output.

    Returns:
        16 hex digits.
    """
    return xxhash.xxh3_128_hexdigest(json.dumps(settings, sort_keys=True, default=str).encode())[:16]


def pack_parts(parts: Parts, store: Store, opts: PackOptions, overwrite: bool, show: bool, engine: str = "local",
               address: str | None = None) -> dict[str, Any]:
    """Pack ``parts`` into a dataset at ``store`` and commit it, resuming an unfinished run of it.

    Args:
        parts: the source.
        store: the destination.
        opts: the pack's options (``task_bytes`` does not apply: a part is a task).
        overwrite: replace a dataset already there.
        show: show a progress bar on stderr.
        engine: ``"local"`` (parts in order, in this process) or ``"ray"`` (a Ray task each).
        address: the Ray cluster for ``engine="ray"``.

    Returns:
        The dataset.json content, as :func:`~shardkit.packing.pack.pack` returns it
        (``tasks`` counts the parts, ``reused_tasks`` those an earlier run finished).

    Raises:
        DatasetExistsError: the destination holds a dataset (and not ``overwrite``) or another pack.
        SourceError: a bad sample or a part's error (one line naming the part), two parts with
            the same key, or no samples at all.
        StorageError: a write failed.
    """
    started = time.monotonic()
    source = parts.describe()
    settings = {"source": source, "on_error": opts.on_error, "transform": opts.transform_desc,
                "shard_bytes": opts.shard_bytes, "shard_samples": opts.shard_samples}
    plan_id = parts_plan_id(settings)
    refuse_committed(store, overwrite)
    claim = Claim(store, plan_id, settings)
    claim.take(overwrite)
    replaced = False
    try:
        if engine == "ray":
            from shardkit.packing.engines.ray import ensure_ray

            ensure_ray(address)  # reach Ray (or fail naming it) before an overwrite removes anything
        replaced = prepare_destination(store, claim, overwrite)
        sweep_temp(store)
        results: dict[int, TaskResult] = {}
        if claim.resumed:  # keep the parts an earlier run finished (a rerun after a kill)
            store.fs.invalidate_cache(store.path("_pack"))
            staged = set(store.glob("_pack/parts/samples-*.parquet"))
            for part in range(parts.n):
                done = completed_part(store, part, plan_id) if staged_fragment(part) in staged else None
                if done is not None:
                    results[part] = done
        todo = [p for p in range(parts.n) if p not in results]
        if engine == "ray":
            from shardkit.packing.engines.ray_parts import run_parts_on_ray

            results.update(run_parts_on_ray(store, parts, todo, plan_id, opts, show, address, claim.check))
        else:
            results.update(_run_local(store, parts, todo, plan_id, opts, show, claim.check))
        return commit_parts(store, claim, [results[p] for p in range(parts.n)], source=source, started=started,
                            engine=engine, opts=opts)
    except BaseException as exc:
        claim.release(ended=True)
        if replaced:
            say_replaced(exc, store)
        raise


def _run_local(store: Store, parts: Parts, todo: list[int], plan_id: str, opts: PackOptions, show: bool,
               check: Any) -> dict[int, TaskResult]:
    """Pack the parts ``todo`` in order in this process."""
    results: dict[int, TaskResult] = {}
    with Progress(None, None, len(todo), "pack parts", enabled=show) as bar:
        for part in todo:
            check()  # stop writing as soon as another pack has taken the destination over
            skipped: list[dict[str, str]] = []
            results[part] = run_part(store, part, parts.samples(part, skipped if opts.on_error == "skip" else None),
                                     skipped, plan_id, opts, bar.advance)
            bar.task_done()
    return results
