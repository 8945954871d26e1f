"""The end of a pack: its tasks' results become ``shards.parquet``, then ``dataset.json``.

Only the driver commits, once every task is done: it checks its claim is still its own,
sweeps what is not part of this pack from shards/ and manifest/, writes ``shards.parquet``
and then ``dataset.json`` create-only, and removes its claim.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from shardkit.errors import DatasetExistsError
from shardkit.format.manifest import DATASET_JSON, dataset_info, shards_table
from shardkit.packing.claim import Claim
from shardkit.packing.destination import abort_uploads, sweep_strays
from shardkit.packing.manifest_writer import put_dataset_json, put_shards_table
from shardkit.packing.task import PackOptions, TaskResult
from shardkit.storage.store import Store

__all__ = ["commit_pack"]

log = logging.getLogger(__name__)


def commit_pack(store: Store, claim: Claim, results: list[TaskResult], *, source: dict[str, Any],
                labels: dict[str, int] | None, started: float, engine: str, opts: PackOptions,
                listing_skipped: list[dict[str, str]] | None = None, fingerprint: str | None = None) -> dict[str, Any]:
    """Commit a pack whose every task is done, and release its claim.

    Args:
        store: the destination.
        claim: this pack's claim, held.
        results: every task's result, in plan order (their fragments are stored).
        source: the source's description for dataset.json.
        labels: class name -> index, if the source has classes.
        started: ``time.monotonic()`` when the pack started.
        engine: the engine's name, recorded in dataset.json.
        opts: the pack's options.
        listing_skipped: inputs the source left out while listing (``on_error="skip"``).
        fingerprint: the source listing and options' fingerprint, recorded so that a rerun of
            the same pack finds it committed (:func:`~shardkit.packing.append.committed_as`).

    Returns:
        The dataset.json content, with ``elapsed_seconds``, ``reused_tasks`` and ``tasks``, and
        ``nodes`` (Ray node id -> tasks it packed in this run) when the tasks ran on Ray.

    Raises:
        DatasetExistsError: another pack took the destination over, or committed there first.
        ManifestError: the shard numbers are not 0..n-1.
        StorageError: a write failed.
    """
    records = [r for res in results for r in res.shards]
    files = [res.fragment for res in results for _ in res.shards]
    groups = [g for res in results for g in res.row_groups]
    table = shards_table(records, files, groups)
    claim.check()  # never commit over shards another pack may have rewritten since
    if store.exists(DATASET_JSON):
        # A racing pack of the same plan committed first: leave its manifest untouched.
        raise DatasetExistsError(f"{store.url} was committed by another pack while this one ran")
    sweep_strays(store, {r.path for r in records} | {res.fragment for res in results})
    abort_uploads(store)
    put_shards_table(store, table)
    fields = sorted({f for res in results for f in res.fields})
    skipped = [*(listing_skipped or []), *(s for res in results for s in res.skipped)]
    info = dataset_info(table, fields, source, labels, skipped,
                        {"pack": {"engine": engine, "shard_bytes": opts.shard_bytes, "transform": opts.transform_desc,
                                  **({"fingerprint": fingerprint} if fingerprint else {})}})
    put_dataset_json(store, info)
    claim.release(ended=False)  # stop the heartbeat first: a late refresh would recreate the claim
    store.remove("_pack", recursive=True)
    elapsed = time.monotonic() - started
    log.info("packed %d samples into %d shards (%d bytes) in %.1fs", info["num_samples"], info["num_shards"],
             info["total_bytes"], elapsed)
    summary = {**info, "elapsed_seconds": round(elapsed, 3),
               "reused_tasks": sum(1 for r in results if r.reused), "tasks": len(results)}
    nodes = Counter(r.node for r in results if r.node is not None)
    if nodes:
        summary["nodes"] = dict(sorted(nodes.items()))
    return summary
