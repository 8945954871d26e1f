"""``pack(..., append=True)``: pack a source as the next version of a committed dataset, and
the "up to date" check of a rerun.

An append plans its source like any pack, leaves out the keys the dataset already has
(refused, or skipped and listed with ``on_error="skip"``), numbers its shards and fragments
on from the latest version's, so no name of an earlier version is ever written again, and
commits through :mod:`shardkit.packing.version_commit`. It holds the destination's claim
(:mod:`shardkit.packing.claim`) like any pack, so a killed append resumes on rerun; its plan
names the version it builds on, so a rerun after another append committed is a new plan.

Keys are checked against the dataset one samples file at a time, with the new keys as the
value set of an Arrow hash lookup: memory holds the new keys and one file's key column, never
every key of the dataset.
"""

from __future__ import annotations

import re
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from shardkit.errors import ConfigError, DatasetExistsError, ShardkitError, SourceError
from shardkit.format.manifest import parquet_file
from shardkit.packing.claim import CLAIM, Claim
from shardkit.packing.destination import sweep_temp
from shardkit.packing.plan import PackPlan, ShardSpan, TaskPlan, make_plan
from shardkit.packing.sources.base import Source, SourceItem
from shardkit.packing.task import PackOptions
from shardkit.packing.version_commit import BaseVersion, commit_version, roll_root_forward
from shardkit.read.manifest import read_info
from shardkit.read.versions import list_versions, marker_name, open_version
from shardkit.storage.store import Store

__all__ = ["append_pack", "committed_as", "known_keys"]

_FRAGMENT = re.compile(r"manifest/samples-(\d+)\.parquet$")


def committed_as(store: Store, fingerprint: str) -> dict[str, Any] | None:
    """The version of the dataset at ``store`` that a pack of this fingerprint (same source,
    same options) committed, if any: a rerun of that pack has nothing to do.

    Args:
        store: the destination.
        fingerprint: the pack's fingerprint (its plan id over the whole source listing).

    Returns:
        That version's dataset.json content (with ``dataset_version``), or None.

    Raises:
        StorageError: reading failed.
    """
    versions = list_versions(store)
    if not versions:
        if not store.exists("dataset.json"):
            return None
        try:
            info = read_info(store)
        except ShardkitError:  # an unreadable dataset.json: the pack refuses it as before
            return None
        found = [(1, info)]
    else:
        found = [(v, read_info(store, marker_name(v))) for v in versions]
    for number, info in reversed(found):
        if (info.get("pack") or {}).get("fingerprint") == fingerprint:
            if versions:
                roll_root_forward(store)
                _drop_committed_claim(store, (info.get("pack") or {}).get("plan_id"))
            return {**info, "dataset_version": number}
    return None


def _drop_committed_claim(store: Store, plan_id: Any) -> None:
    """Remove the claim an append killed after its commit left (its version is committed, so
    nothing is left to resume); a claim that is still live, or of another plan, stays."""
    if not isinstance(plan_id, str) or not store.exists(CLAIM):
        return
    claim = Claim(store, plan_id, {})
    try:
        claim.take(False)  # only a claim of this plan that is no longer live is taken over
    except DatasetExistsError:
        return
    claim.release(ended=False)
    store.remove("_pack", recursive=True)


def _latest(store: Store) -> BaseVersion:
    info, shards = open_version(store)
    return BaseVersion(int(info.get("dataset_version") or 1), info, shards)


def _merged_labels(base: dict[str, Any], new: dict[str, int], url: str) -> dict[str, int]:
    """The class labels of every version: the new source's must agree with the dataset's."""
    labels = dict(base.get("labels") or {})
    by_index = {v: k for k, v in labels.items()}
    for name, index in sorted(new.items()):
        if labels.get(name, index) != index or by_index.get(index, name) != name:
            raise ConfigError(f"labels: class {name!r} is {index} in the appended source but the dataset at {url} "
                              f"has {name!r}={labels.get(name)} and {by_index.get(index)!r}={index}; an append must "
                              "keep every class's label (append class folders that agree)")
        labels[name], by_index[index] = index, name
    return labels


def _samples_files(store: Store, base: BaseVersion) -> list[str]:
    files = base.shards.column("samples_file").to_pylist() if "samples_file" in base.shards.column_names else []
    if files and all(files):
        return sorted(set(files))
    return sorted(store.glob("manifest/samples-*.parquet"))  # a manifest from before samples_file


def known_keys(store: Store, base: BaseVersion, keys: list[str]) -> set[str]:
    """Which of ``keys`` the dataset's version ``base`` already holds.

    Args:
        store: the dataset root.
        base: the version.
        keys: the new keys.

    Returns:
        The keys already there.

    Raises:
        StorageError: reading a samples file failed.
        ManifestError: a samples file is unreadable.
    """
    wanted = pa.array(keys, pa.string())
    found: set[str] = set()
    for rel in _samples_files(store, base):
        column = parquet_file(store.read_bytes(rel), store.url_of(rel)).read(columns=["key"], use_threads=False)[0]
        found.update(column.filter(pc.is_in(column, value_set=wanted)).to_pylist())
    return found


def _shifted(plan: PackPlan, shard_base: int, task_base: int) -> PackPlan:
    """The plan with its shards and tasks numbered on from an earlier version's."""
    # The fingerprints stay: the plan's options name the version it builds on, which fixes the shift.
    tasks = [TaskPlan(t.task + task_base, tuple(ShardSpan(s.shard + shard_base, s.start, s.stop) for s in t.shards),
                      t.fingerprint) for t in plan.tasks]
    return PackPlan(plan.items, tasks, plan.plan_id, plan.total_bytes)


def _next_fragment(store: Store, base: BaseVersion) -> int:
    numbers = [int(m.group(1)) for f in _samples_files(store, base) if (m := _FRAGMENT.search(f))]
    return max(numbers, default=-1) + 1


def append_pack(store: Store, src: Source, items: list[SourceItem], *, settings: dict[str, Any], opts: PackOptions,
                fingerprint: str, engine: str, runner: Any, progress: bool, listing_skipped: list[dict[str, str]],
                started: float) -> dict[str, Any]:
    """Pack ``items`` of ``src`` as the next version of the dataset committed at ``store``.

    Args:
        store: the destination, holding a committed dataset.
        src: the source.
        items: its listed items.
        settings: the pack's settings (on_error, transform, source), as a plain pack records them.
        opts: the pack's options.
        fingerprint: the pack's fingerprint over the whole listing (recorded in the version).
        engine: the engine's name.
        runner: the engine (:func:`~shardkit.packing.engines.engine_for`).
        progress: show a progress bar.
        listing_skipped: inputs the source left out while listing.
        started: ``time.monotonic()`` when the pack started.

    Returns:
        The new version's dataset.json content, with ``elapsed_seconds``, ``reused_tasks`` and ``tasks``.

    Raises:
        SourceError: a key already in the dataset (``on_error="raise"``), or nothing left to append.
        ConfigError: the source's class labels disagree with the dataset's.
        DatasetExistsError: another pack is writing there, or committed the next version first.
        StorageError: reading or writing storage failed.
    """
    roll_root_forward(store)
    base = _latest(store)
    labels = _merged_labels(base.info, src.labels() or {}, store.url)
    dups = known_keys(store, base, [it.key for it in items])
    skipped = list(listing_skipped)
    if dups:
        first = next(it for it in items if it.key in dups)
        if opts.on_error != "skip":
            more = f" ({len(dups) - 1} more keys too)" if len(dups) > 1 else ""
            raise SourceError(f"{first.ref}: key {first.key!r} is already in {store.url} (version {base.number}){more}; "
                              "keys stay unique across versions: rename it, or pass --on-error skip "
                              "(on_error='skip') to leave such samples out")
        reason = f"key already in version {base.number} or earlier"
        skipped += [{"ref": it.ref, "key": it.key, "reason": reason} for it in items if it.key in dups]
        items = [it for it in items if it.key not in dups]
    if not items:
        raise SourceError(f"nothing to append to {store.url}: every sample's key is already in version {base.number}")
    options = {**settings, "append_to": base.number}
    plan = make_plan(items, shard_bytes=opts.shard_bytes, shard_samples=opts.shard_samples,
                     task_bytes=opts.task_bytes, options=options)
    plan = _shifted(plan, int(base.info["num_shards"]), _next_fragment(store, base))
    claim = Claim(store, plan.plan_id, {**options, "shard_bytes": opts.shard_bytes,
                                        "shard_samples": opts.shard_samples, "task_bytes": opts.task_bytes})
    claim.take(False)
    now = list_versions(store)
    if (now[-1] if now else 1) != base.number:
        # Another append committed between our look and our claim: our names would follow
        # on from a version that is no longer the latest.
        claim.drop()
        raise DatasetExistsError(f"{store.url}: version {base.number + 1} was committed by another pack; rerun to "
                                 "append on top")
    try:
        runner.start()
        sweep_temp(store)
        results = runner.run(store, src, plan, opts, progress, claim.check)
        skipped += [s for res in results for s in res.skipped]
        return commit_version(store, claim, base, results, source=src.describe(), labels=labels, started=started,
                              engine=engine, opts=opts, skipped=skipped, fingerprint=fingerprint)
    except BaseException:
        claim.release(ended=True)
        raise

