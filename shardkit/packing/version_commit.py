"""The end of an append: version N+1's shard table, its create-only marker, then the root copies.

The layout of versions is :mod:`shardkit.read.versions`'. The order makes the marker the one
commit point: the shard table is written first (named by its content, so racing writers never
overwrite each other's), then ``versions/vNNNNNN.json`` create-only (of two appends of one
version exactly one gets here), then the root ``dataset.json`` and ``manifest/shards.parquet``
that readers knowing nothing of versions open. A pack killed between the marker and the root
has committed; :func:`roll_root_forward` brings the root up to date on the next run.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import xxhash

from shardkit.errors import DatasetExistsError
from shardkit.format.manifest import (DATASET_JSON, SHARDS_PARQUET, dataset_info, dataset_json_bytes, shards_table,
                                      shards_table_bytes)
from shardkit.format.rows import ShardRecord
from shardkit.packing.claim import Claim
from shardkit.packing.create_once import create_once
from shardkit.packing.destination import abort_uploads, sweep_strays
from shardkit.packing.task import PackOptions, TaskResult
from shardkit.read.manifest import read_info, shard_infos
from shardkit.read.versions import list_versions, marker_name, open_version, shards_file_name
from shardkit.storage.store import Store

__all__ = ["BaseVersion", "commit_version", "put_version", "roll_root_forward"]

log = logging.getLogger(__name__)


@dataclass
class BaseVersion:
    """The committed version an append builds on.

    Attributes:
        number: its version number.
        info: its dataset.json content.
        shards: its shard table.
    """

    number: int
    info: dict[str, Any]
    shards: pa.Table


def put_version(store: Store, number: int, info: dict[str, Any], table_bytes: bytes) -> bytes:
    """Write version ``number``'s shard table, then its marker create-only: the commit.

    Args:
        store: the dataset root.
        number: the version.
        info: its dataset.json content (``dataset_version`` and ``shards_file`` are added).
        table_bytes: its shard table's bytes (stored under a name made of their hash).

    Returns:
        The marker's bytes.

    Raises:
        DatasetExistsError: another writer committed this version first (one line).
        StorageError: a write failed.
    """
    shards_file = shards_file_name(number, xxhash.xxh3_64_hexdigest(table_bytes))
    store.put_bytes(shards_file, table_bytes)  # named by its content: rewriting it rewrites the same bytes
    marker = dataset_json_bytes({**info, "dataset_version": number, "shards_file": shards_file})
    try:
        create_once(store, marker_name(number), marker)
    except DatasetExistsError:
        raise DatasetExistsError(f"{store.url}: version {number} was committed by another pack; rerun to append on "
                                 "top") from None
    return marker


def _mark_base(store: Store, base: BaseVersion) -> None:
    """Give version 1 of a dataset never appended to its marker, a copy of the root's files,
    before the root moves on (any writer makes the same bytes: a race writes them twice)."""
    if base.number != 1 or list_versions(store):
        return
    info = {k: v for k, v in read_info(store).items()}
    put_version(store, 1, {**info, "dataset_version": 1}, store.read_bytes(SHARDS_PARQUET))


def roll_root_forward(store: Store) -> None:
    """Bring the root ``dataset.json`` and ``manifest/shards.parquet`` to the latest version,
    if a pack was killed after committing a version but before copying it there.

    Args:
        store: the dataset root.

    Raises:
        StorageError: a read or write failed.
    """
    versions = list_versions(store)
    if not versions:
        return
    try:
        root = json.loads(store.read_bytes(DATASET_JSON))
    except (ValueError, OSError):
        root = {}
    if isinstance(root, dict) and root.get("dataset_version") == versions[-1]:
        return
    info, table = open_version(store, versions[-1])
    log.info("%s: copying version %d to dataset.json (a pack stopped after committing it)", store.url, versions[-1])
    store.put_bytes(DATASET_JSON, store.read_bytes(marker_name(versions[-1])))
    store.put_bytes(SHARDS_PARQUET, shards_table_bytes(table))


def commit_version(store: Store, claim: Claim, base: BaseVersion, results: list[TaskResult], *,
                   source: dict[str, Any], labels: dict[str, int], started: float, engine: str, opts: PackOptions,
                   skipped: list[dict[str, str]], fingerprint: str) -> dict[str, Any]:
    """Commit an append whose every task is done as version ``base.number + 1``, and release the claim.

    Args:
        store: the destination.
        claim: this pack's claim, held.
        base: the version appended to.
        results: every task's result, in plan order (their fragments are stored).
        source: the appended source's description.
        labels: class name -> index of every version (checked to agree beforehand).
        started: ``time.monotonic()`` when the pack started.
        engine: the engine's name.
        opts: the pack's options.
        skipped: the inputs left out (bad inputs, keys already in the dataset).
        fingerprint: the appended source and options' fingerprint (an identical rerun is "up to date").

    Returns:
        The new version's dataset.json content, with ``elapsed_seconds``, ``reused_tasks`` and ``tasks``.

    Raises:
        DatasetExistsError: another pack took the destination over, or committed this version first.
        ManifestError: the shard numbers do not follow on from the base's.
        StorageError: a write failed.
    """
    old = shard_infos(base.shards)
    records = [ShardRecord(s.shard, s.path, s.num_samples, s.bytes, s.checksum) for s in old]
    files = [s.samples_file for s in old]
    groups = [s.samples_row_group for s in old]
    for res in results:
        records += res.shards
        files += [res.fragment] * len(res.shards)
        groups += res.row_groups
    table = shards_table(records, files, groups)
    claim.check()
    _mark_base(store, base)
    ours = {r.path for r in records} | {f for f in files if f}
    sweep_strays(store, ours)
    abort_uploads(store)
    fields = sorted(set(base.info.get("fields") or []) | {f for res in results for f in res.fields})
    info = dataset_info(table, fields, source, labels, skipped,
                        {"pack": {"engine": engine, "shard_bytes": opts.shard_bytes, "transform": opts.transform_desc,
                                  "fingerprint": fingerprint, "plan_id": claim.plan_id}})
    number = base.number + 1
    marker = put_version(store, number, info, shards_table_bytes(table))
    # Committed: from here on the root follows, for readers that know nothing of versions.
    store.put_bytes(DATASET_JSON, marker)
    store.put_bytes(SHARDS_PARQUET, shards_table_bytes(table))
    claim.release(ended=False)
    store.remove("_pack", recursive=True)
    elapsed = time.monotonic() - started
    new = json.loads(marker)
    log.info("appended %d samples as version %d (%d samples, %d shards) in %.1fs",
             sum(r.samples for r in results), number, new["num_samples"], new["num_shards"], elapsed)
    return {**new, "elapsed_seconds": round(elapsed, 3), "reused_tasks": sum(1 for r in results if r.reused),
            "tasks": len(results)}
