"""The body of one pack task, the same whichever engine runs it.

A task writes its shards straight to storage, then its samples fragment, whose footer records
the shards it completed; it returns a small :class:`TaskResult` (no sample rows). A rerun of the
same plan finds a finished task by that footer (:func:`completed_task`) and skips it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from shardkit.errors import ShardkitError, SourceError
from shardkit.format.fragments import FragmentBuilder
from shardkit.format.manifest import fragment_name, parquet_file
from shardkit.format.rows import ShardRecord
from shardkit.packing.manifest_writer import put_fragment
from shardkit.packing.plan import TaskPlan
from shardkit.packing.sample import PackSample
from shardkit.packing.sources.base import Source, SourceItem
from shardkit.packing.tar_shard import TarShard
from shardkit.packing.upload import Uploader
from shardkit.storage.store import Store

__all__ = ["TASK_META", "PackOptions", "TaskResult", "Transform", "completed_task", "run_task", "shards_intact"]

log = logging.getLogger(__name__)

# The fragment's Parquet key-value metadata key holding the task's summary (plan, shards done).
TASK_META = "shardkit_task"
Transform = Callable[[PackSample], PackSample]


@dataclass
class TaskResult:
    """What a finished task hands the driver (small: no sample rows).

    Attributes:
        task: the task's number in the plan.
        fragment: its samples fragment (``manifest/samples-NNNNN.parquet``).
        shards: its shards, in order.
        row_groups: each shard's row group in the fragment (-1 for an empty shard).
        skipped: the inputs it left out (``on_error="skip"``), as dataset.json lists them.
        fields: the field names its samples have.
        samples: how many samples it packed.
        bytes: the bytes of its shards.
        reused: found complete from an earlier run, not written by this one.
        node: the Ray node that packed it (None: the local engine, or reused).
    """

    task: int
    fragment: str
    shards: list[ShardRecord]
    row_groups: list[int]
    skipped: list[dict[str, str]]
    fields: list[str]
    samples: int
    bytes: int
    reused: bool = False
    node: str | None = None


@dataclass
class PackOptions:
    """The options every task of a pack runs with (pickled into Ray tasks).

    Attributes:
        shard_bytes: the target shard size.
        shard_samples: close a shard at this many samples too (None: no limit).
        task_bytes: the most bytes one task packs.
        on_error: ``"raise"`` or ``"skip"`` a bad input.
        transform: applied to each sample before it is written.
        transform_desc: the transform as dataset.json records it.
    """

    shard_bytes: int
    shard_samples: int | None
    task_bytes: int
    on_error: str
    transform: Transform | None = None
    transform_desc: dict[str, Any] = field(default_factory=dict)


def run_task(store: Store, source: Source, plan: TaskPlan, items: Sequence[SourceItem], plan_id: str,
             opts: PackOptions, progress: Callable[[int, int], None] | None = None,
             uploader: Uploader | None = None) -> TaskResult:
    """Write one task's shards and fragment.

    A bad input raises SourceError naming it (``on_error="raise"``) or is left out and listed
    (``"skip"``); a skip found halfway through a streamed member rewrites that shard without it,
    so no partial member is ever committed.

    With a shared ``uploader`` the task returns once its last job (the fragment) is queued, and
    ``row_groups`` is filled in when that job runs: the caller flushes the uploader before using
    the result. The uploader runs jobs in order and skips the rest after a failure, so the
    fragment is never written unless every shard of the task was.

    Args:
        store: the dataset root.
        source: the source the items come from.
        plan: the task's part of the plan.
        items: the task's items, in order (``plan.start`` to ``plan.stop`` of the plan's list).
        plan_id: the task's fingerprint (``plan.fingerprint``: the plan through its last item),
            recorded in the fragment for :func:`completed_task`.
        opts: the pack's options.
        progress: called with (samples, bytes) as each sample is written.
        uploader: an upload thread shared with other tasks (default: the task's own, closed
            before returning).

    Returns:
        The task's result.

    Raises:
        SourceError: a bad input (``on_error="raise"``), naming it.
        StorageError: a write failed.
    """
    own = uploader is None
    up = uploader or Uploader()
    try:
        # A source over object storage reads the task's objects ahead, in this order.
        task_items = getattr(source, "task_items", None)
        if callable(task_items):
            task_items(items)
        result = _write_task(store, source, plan, items, plan_id, opts, progress, up)
    except BaseException:
        if own:
            up.close(check=False)
        raise
    finally:
        # A source may keep inputs open across the task's loads (Hdf5Source in rows mode);
        # they close here, so a pack leaves no file open in the process that ran it.
        task_done = getattr(source, "task_done", None)
        if callable(task_done):
            task_done()
    if own:
        up.close()
    return result


def _write_task(store: Store, source: Source, plan: TaskPlan, items: Sequence[SourceItem], plan_id: str,
                opts: PackOptions, progress: Callable[[int, int], None] | None, up: Uploader) -> TaskResult:
    base = plan.start
    records: list[ShardRecord] = []
    fragment = FragmentBuilder()  # rows become compressed Arrow as shards are written
    skipped: list[dict[str, str]] = []
    fields: set[str] = set()
    for span in plan.shards:
        excluded: set[int] = set()
        while True:
            shard = TarShard(store, span.shard, uploader=up, on_rows=fragment.add_rows)
            failed: int | None = None
            try:
                for i in range(span.start, span.stop):
                    if i in excluded:
                        continue
                    item = items[i - base]
                    try:
                        sample = source.load(item)
                        if opts.transform is not None:
                            sample = opts.transform(sample)
                        shard.add(sample)
                    except SourceError as exc:
                        if opts.on_error != "skip":
                            # A transform's error names the sample key; the user needs the input.
                            text = str(exc) if item.ref in str(exc) else f"{item.ref}: {exc}"
                            raise type(exc)(f"{text} (--on-error skip, on_error='skip', packs the rest and lists "
                                            "such inputs in dataset.json)") from exc
                        failed = i
                        skipped.append({"ref": item.ref, "key": item.key, "reason": str(exc)})
                        break
                    fields.update(sample.fields)
                    if progress:
                        progress(1, sample.nbytes())
            except BaseException:
                shard.abort()
                raise
            if failed is None:
                records.append(shard.close())
                fragment.add(records[-1], shard.rows)
                break
            shard.abort()
            fragment.drop_rows()
            excluded.add(failed)
    frag = fragment_name(plan.task)
    summary = {"plan_id": plan_id, "task": plan.task, "shards": [asdict(r) for r in records],
               "skipped": skipped, "fields": sorted(fields)}
    result = TaskResult(plan.task, frag, records, [], skipped, sorted(fields), fragment.num_rows,
                        sum(r.bytes for r in records))
    meta = {TASK_META: json.dumps(summary)}

    def write() -> None:
        result.row_groups = put_fragment(store, frag, fragment, meta)

    up.submit(write)
    return result


def completed_task(store: Store, plan: TaskPlan, plan_id: str) -> TaskResult | None:
    """The result of an earlier run of this task, if its fragment and every shard are intact.

    Args:
        store: the dataset root.
        plan: the task's part of the plan.
        plan_id: the task's fingerprint (``plan.fingerprint``): a fragment of another plan is
            not this task's.

    Returns:
        The earlier run's result (``reused=True``), or None when the task must be (re)done.
    """
    frag = fragment_name(plan.task)
    try:
        if not store.exists(frag):
            return None
        md = parquet_file(store.read_checked(frag)).metadata
        raw = (md.metadata or {}).get(TASK_META.encode())
    except Exception:  # noqa: BLE001 - an unreadable fragment is simply redone
        log.debug("fragment %s unreadable, redoing task", frag, exc_info=True)
        return None
    if raw is None:
        return None
    summary = json.loads(raw)
    if summary.get("plan_id") != plan_id:
        return None
    records = [ShardRecord(**r) for r in summary["shards"]]
    if [r.shard for r in records] != [s.shard for s in plan.shards]:
        return None
    if not shards_intact(store, records):
        return None
    groups: dict[int, int] = {}
    for g in range(md.num_row_groups):
        stats = md.row_group(g).column(1).statistics
        if stats is not None and stats.has_min_max:
            groups[int(stats.min)] = g
    return TaskResult(plan.task, frag, records, [groups.get(r.shard, -1) for r in records], summary["skipped"],
                      summary["fields"], sum(r.num_samples for r in records), sum(r.bytes for r in records), reused=True)


def shards_intact(store: Store, records: Sequence[ShardRecord]) -> bool:
    """Whether every shard an earlier run recorded is in ``store`` at its recorded size.

    A finished task or part is reused only then; a shard missing or cut short is redone.

    Args:
        store: the destination.
        records: the shards an earlier run's fragment names.

    Returns:
        True when each shard exists with its recorded byte count; False otherwise (a storage
        error counts as not intact).
    """
    for r in records:
        try:
            if store.size(r.path) != r.bytes:
                return False
        except ShardkitError:
            return False
    return True
