"""Packing: list the source, plan by bytes, run tasks (local or Ray), commit last.

Every task is the same function, :func:`run_task`, whichever engine runs it. A task writes
its shards straight to storage, then its manifest fragment (whose footer records the shards
it completed), and returns the shard rows. The driver alone writes ``shards.parquet`` and
then ``dataset.json`` (create-only), so a dataset is visible only when complete.
"""

from __future__ import annotations

import glob
import itertools
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from shardkit.util.procs import pid_alive
from shardkit.packing.claim import CLAIM, Claim
from shardkit.config import DEFAULT_SHARD_BYTES, DEFAULT_TASK_BYTES, parse_size
from shardkit.errors import ConfigError, DatasetExistsError, ShardkitError, SourceError
from shardkit.format.fragments import FragmentBuilder
from shardkit.format.manifest import (
    DATASET_JSON,
    SHARDS_PARQUET,
    commit,
    dataset_info,
    fragment_name,
    parquet_file,
    read_info,
    shards_table,
    write_shards_table,
)
from shardkit.packing.plan import PackPlan, TaskPlan, make_plan
from shardkit.packing.progress import Progress
from shardkit.packing.sample import PackSample
from shardkit.packing.sources import resolve_source
from shardkit.packing.sources.base import ListingSkips, Source, SourceItem
from shardkit.storage.store import Store
from shardkit.format.rows import SampleRows, ShardRecord
from shardkit.packing.writer import ShardWriter, TarShard, Uploader

log = logging.getLogger(__name__)

ITERABLE_PLAN = "iterable"  # an iterable cannot be planned: every run of one is the same "plan"
# An iterable's samples fragment is closed (written, and the next one started) at the first
# shard boundary where it holds this many rows or compressed bytes: packing an endless
# iterable keeps one fragment's compressed rows, not every row of the pack.
ITERABLE_FRAGMENT_ROWS = 1_000_000
ITERABLE_FRAGMENT_BYTES = 64 * 2**20
_TASK_META = "shardkit_task"
Transform = Callable[[PackSample], PackSample]


@dataclass
class TaskResult:
    """What a finished task hands the driver (small: no sample rows)."""

    task: int
    fragment: str
    shards: list[ShardRecord]
    row_groups: list[int]
    skipped: list[dict[str, str]]
    fields: list[str]
    samples: int
    bytes: int
    reused: bool = False


@dataclass
class PackOptions:
    shard_bytes: int
    shard_samples: int | None
    task_bytes: int
    on_error: str
    transform: Transform | None = None
    transform_desc: dict[str, Any] = field(default_factory=dict)


def run_task(store: Store, source: Source, plan: TaskPlan, items: Sequence[SourceItem], plan_id: str,
             opts: PackOptions, progress: Callable[[int, int], None] | None = None,
             uploader: Uploader | None = None) -> TaskResult:
    """Write one task's shards and fragment. ``items`` are the task's items, in order.

    A bad input raises SourceError naming it (``on_error="raise"``) or is left out and listed
    (``"skip"``); a skip found halfway through a streamed member rewrites that shard without it,
    so no partial member is ever committed.

    With a shared ``uploader`` the task returns once its last job (the fragment) is queued, and
    ``row_groups`` is filled in when that job runs: the caller flushes the uploader before using
    the result. The uploader runs jobs in order and skips the rest after a failure, so the
    fragment is never written unless every shard of the task was.
    """
    own = uploader is None
    up = uploader or Uploader()
    try:
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
                            if item.ref in str(exc):
                                raise
                            # A transform's error names the sample key; the user needs the input.
                            raise type(exc)(f"{item.ref}: {exc}") from exc
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
    meta = {_TASK_META: json.dumps(summary)}

    def write() -> None:
        result.row_groups = fragment.write(store, frag, meta)

    up.submit(write)
    return result


def completed_task(store: Store, plan: TaskPlan, plan_id: str) -> TaskResult | None:
    """The result of an earlier run of this task, if its fragment and every shard are intact."""
    frag = fragment_name(plan.task)
    try:
        if not store.exists(frag):
            return None
        md = parquet_file(store.read_bytes(frag)).metadata
        raw = (md.metadata or {}).get(_TASK_META.encode())
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
    for r in records:
        try:
            if store.size(r.path) != r.bytes:
                return None
        except ShardkitError:
            return None
    groups: dict[int, int] = {}
    for g in range(md.num_row_groups):
        stats = md.row_group(g).column(1).statistics
        if stats is not None and stats.has_min_max:
            groups[int(stats.min)] = g
    return TaskResult(plan.task, frag, records, [groups.get(r.shard, -1) for r in records], summary["skipped"],
                      summary["fields"], sum(r.num_samples for r in records), sum(r.bytes for r in records), reused=True)


def _sweep_temp(store: Store) -> None:
    """Remove local shard temp files left by packs that died (``*.tar.tmp.<pid>.<id>``)."""
    if store.is_object_store:
        return  # an unfinished multipart upload is invisible; nothing to sweep
    for rel in store.glob("shards/*.tmp.*"):
        pid = rel.rsplit(".tmp.", 1)[1].split(".", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            store.remove(rel)


def _local_path(text: str) -> Path | None:
    """The resolved local path a source or destination string names, None if it is remote."""
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        return None
    path = Path(text).expanduser()
    if not path.exists() and glob.has_magic(text):  # a glob of tars: the folder it starts from
        path = Path(*itertools.takewhile(lambda part: not glob.has_magic(part), path.parts))
    return path.resolve()


def _refuse_nested(source: Any, store: Store) -> None:
    """ConfigError when DEST lies inside a local SOURCE folder (a rerun packs the earlier output
    as input: its files become samples, its folder a class) or SOURCE inside DEST (an
    --overwrite deletes what it packs)."""
    if not isinstance(source, (str, os.PathLike)):
        return
    src, dst = _local_path(os.fspath(source)), _local_path(store.url)
    if src is None or dst is None:
        return
    if dst == src or src in dst.parents:
        raise ConfigError(f"destination {dst} is inside the source {src}: a rerun would pack this pack's output as "
                          "input; choose a destination outside the source")
    if dst in src.parents:
        raise ConfigError(f"source {src} is inside the destination {dst}: packing there would write over (and "
                          "--overwrite delete) the input; choose a destination outside the source")


def _refuse_file_dest(store: Store) -> None:
    """ConfigError when a local DEST is, or lies under, an existing regular file: the first
    directory the pack made failed with a bare NotADirectoryError."""
    dst = _local_path(store.url)
    if dst is None:
        return
    for path in (dst, *dst.parents):
        if path.exists():
            if not path.is_dir():
                where = "is a file" if path == dst else f"lies under {path}, which is a file"
                raise ConfigError(f"destination {dst} {where}, not a directory: choose a directory (a new one, "
                                  "or one holding a dataset)")
            return


def _refuse_committed(store: Store, overwrite: bool) -> None:
    """Refuse a committed dataset at DEST unless ``overwrite``; refuse an index of existing tars
    always: its tars are the user's own (``shardkit index`` wrote only the manifest beside
    them), and a pack there would delete those under shards/ and mix its own with the rest."""
    if not store.exists(DATASET_JSON):
        return
    try:
        made_by = (read_info(store).get("source") or {}).get("type")
    except ShardkitError:  # an unreadable dataset.json is no index to protect: --overwrite replaces it
        made_by = None
    if made_by == "index":
        raise DatasetExistsError(
            f"{store.url} is an index of existing WebDataset tars (shardkit index), not a packed dataset: a pack "
            "there would delete or mix with those tars, which shardkit did not write (--overwrite too); pack to "
            f"another prefix (to drop only the index, delete {store.url_of(DATASET_JSON)} and "
            f"{store.url_of('manifest')}/)")
    if not overwrite:
        raise DatasetExistsError(f"{store.url} already holds a dataset; pass --overwrite (overwrite=True) to replace it")


def _say_replaced(exc: BaseException, store: Store) -> None:
    """Add to the error of a pack that failed after its --overwrite removed the old dataset that
    it did so: the user must not believe the old dataset is still there to fall back on."""
    note = (f"; the old dataset at {store.url} was removed when this --overwrite pack started "
            "(fix the cause and rerun to pack there again)")
    if exc.args and isinstance(exc.args[0], str):
        first, nl, rest = exc.args[0].partition("\n")
        exc.args = (first + note + nl + rest, *exc.args[1:])
    if note not in str(exc):  # an interrupt, or an error that formats its message itself
        log.warning("%s", note[2:])


def _prepare_destination(store: Store, claim: Claim, overwrite: bool, resumable: bool = True) -> bool:
    """With this pack's claim held: refuse a committed dataset, or objects under shards/ and
    manifest/ that no earlier shardkit pack wrote (unless ``overwrite``), and remove what
    shardkit wrote there before unless this pack resumes it (the same plan, ``resumable``).

    With ``overwrite`` that is everything, committed or not: shards an unfinished pack of more
    shards left would otherwise stay beside the new ones, where ``shardkit index`` and outside
    WebDataset readers find them.

    Returns whether a committed dataset was removed (``overwrite``).
    """
    committed = store.exists(DATASET_JSON)
    if committed:
        try:
            _refuse_committed(store, overwrite)
        except DatasetExistsError:
            claim.drop()
            raise
    if claim.fresh and not committed and not overwrite:
        _refuse_foreign(store, claim)
    if committed or (overwrite and not claim.resumed) or not resumable:
        try:
            store.remove(DATASET_JSON)  # uncommit first, so nobody reads a half-replaced dataset
            for prefix in ("shards", "manifest"):
                store.remove(prefix, recursive=True)
            for rel in store.listing("_pack"):
                if rel != CLAIM and not rel.startswith("_pack/takeover-"):  # the takeover records guard the claim
                    store.remove(rel, recursive=True)
            _abort_uploads(store)
        except BaseException as exc:
            if committed:  # dataset.json may be gone already
                _say_replaced(exc, store)
            raise
    return committed


def _abort_uploads(store: Store) -> None:
    """Abort multipart uploads under shards/ and manifest/ that packs killed mid-upload left
    (their parts stay in the bucket, billed, until aborted). Called with the claim held and
    no upload of this pack running: any such upload belongs to a pack that is gone. Only those
    two folders, where packs write: never the uploads of anyone else under the prefix."""
    try:
        for key in store.abort_uploads(("shards", "manifest")):
            log.info("aborted the unfinished multipart upload of %s left by an earlier pack", key)
    except ShardkitError as exc:  # a store without the call, or no permission for it: not worth failing the pack
        log.warning("%s: could not list or abort unfinished multipart uploads under shards/ and manifest/ (%s); "
                    "an interrupted pack may have left some (S3 bills their parts until they are aborted)",
                    store.url, exc)


def _refuse_foreign(store: Store, claim: Claim) -> None:
    """Refuse (and drop the claim) when shards/ or manifest/ hold objects although neither a
    dataset nor an unfinished pack's claim is here: shardkit did not write them (someone's own
    WebDataset, notes), and the commit's sweep of strays would delete them."""
    found = store.listing("shards") + store.listing("manifest")
    if not found:
        return
    claim.drop()
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    raise DatasetExistsError(f"{store.url} holds objects under shards/ or manifest/ but no shardkit dataset or "
                             f"unfinished pack ({store.url_of(found[0])}{more}); choose an empty prefix, or pass "
                             "--overwrite (overwrite=True) to delete them and pack there")


def _sweep_strays(store: Store, results: list[TaskResult]) -> None:
    """Remove objects under shards/ and manifest/ that are not this pack's: a committed dataset
    holds only its own shards (outside readers take every tar under shards/). They are what an
    earlier, unfinished shardkit pack wrote: a pack that found objects there without such a
    pack's claim refused to start (:func:`_refuse_foreign`), unless told to overwrite."""
    ours = {r.path for res in results for r in res.shards} | {res.fragment for res in results}
    for rel in store.listing("shards") + store.listing("manifest"):
        if rel not in ours and rel != SHARDS_PARQUET:
            log.info("removing %s, which is not part of this pack", store.url_of(rel))
            store.remove(rel, recursive=True)


def pack(source: Any, dest: str, shard_bytes: int | str = DEFAULT_SHARD_BYTES, engine: str = "local", *,
         shard_samples: int | None = None, labels_from_dirs: bool = False, on_error: str = "raise",
         overwrite: bool = False, storage_options: dict[str, Any] | None = None, ray_address: str | None = None,
         transform: Any = None, task_bytes: int | str = DEFAULT_TASK_BYTES, hdf5_rows: str | None = None,
         progress: bool = True) -> dict[str, Any]:
    """Pack ``source`` into a dataset at ``dest`` and return its dataset.json content.

    Args:
        source: a path (folder, ImageFolder, CSV/Parquet list, .h5, .npy/.npz, .tar), a
            WebDataset tar URL/glob, a :class:`~shardkit.packing.sources.Source`, or an iterable of dicts.
        dest: any fsspec URL (``s3://bucket/prefix``, a local path, ``memory://...``).
        shard_bytes: target shard size (``"512MB"``); shards close before overflowing it.
        engine: ``"local"`` (in this process) or ``"ray"`` (one Ray task per planned task).
        on_error: ``"raise"`` stops at the first bad input naming it; ``"skip"`` leaves it out
            and lists it under ``skipped`` in dataset.json.
        overwrite: replace a dataset already committed at ``dest``. The old dataset is removed
            when the pack starts (once options, source, plan and claim are checked), not when
            the new one commits: a pack that then fails leaves no dataset there (its error says
            so). To keep the old one readable until the new one is done, pack to a new prefix.
        transform: a :class:`~shardkit.packing.transforms.Transform` or callable applied to each sample.
    """
    if engine not in ("local", "ray"):
        raise ConfigError(f"engine: expected 'local' or 'ray', got {engine!r}")
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error: expected 'raise' or 'skip', got {on_error!r}")
    sbytes = parse_size(shard_bytes, "shard_bytes")
    if shard_samples is not None and shard_samples < 1:
        raise ConfigError(f"shard_samples: must be >= 1, got {shard_samples}")
    store = Store(dest, storage_options)
    _refuse_nested(source, store)
    _refuse_file_dest(store)
    desc = transform.describe() if hasattr(transform, "describe") else ({"callable": repr(transform)} if transform else {})
    opts = PackOptions(sbytes, shard_samples, parse_size(task_bytes, "task_bytes"), on_error, transform, desc)
    if not isinstance(source, (str, bytes)) and not hasattr(source, "list_items") and hasattr(source, "__iter__") \
            and not hasattr(source, "__fspath__"):
        if engine != "local":
            raise ConfigError("engine: an iterable source is packed with engine='local' (it cannot be listed ahead)")
        if hdf5_rows is not None or labels_from_dirs:
            raise ConfigError(f"{'hdf5_rows' if hdf5_rows is not None else 'labels_from_dirs'}: applies to a source "
                              "path, not to an iterable of samples (give each sample its fields)")
        return _pack_iterable(source, store, opts, overwrite, progress)
    src = resolve_source(source, labels_from_dirs=labels_from_dirs, storage_options=storage_options, hdf5_rows=hdf5_rows)
    listing: ListingSkips | None = getattr(src, "listing", None)  # sources that can skip while listing
    if listing is not None:
        listing.skip = on_error == "skip"
    started = time.monotonic()
    items = src.list_items()
    if not items:
        raise SourceError(f"source {source} is empty")
    settings = {"on_error": on_error, "transform": desc, "source": src.describe()}
    plan = make_plan(items, shard_bytes=sbytes, shard_samples=shard_samples, task_bytes=opts.task_bytes,
                     options=settings)
    _refuse_committed(store, overwrite)  # before claiming: nothing written (checked again once claimed)
    claim = Claim(store, plan.plan_id, {**settings, "shard_bytes": sbytes, "shard_samples": shard_samples,
                                        "task_bytes": opts.task_bytes})
    claim.take(overwrite)
    replaced = False
    try:
        if engine == "ray":
            # Reach Ray (or fail naming it) before an --overwrite removes the old dataset.
            from shardkit.packing.ray_engine import ensure_ray

            ensure_ray(ray_address)
        # Everything checkable is checked by now (options, source listed, plan made, claim
        # taken): only from here on may an --overwrite remove the old dataset.
        replaced = _prepare_destination(store, claim, overwrite)
        _sweep_temp(store)
        runner = _run_ray if engine == "ray" else _run_local
        results = runner(store, src, plan, opts, progress, ray_address, claim.check)
        return _commit(store, src.describe(), src.labels(), results, started, engine, opts, claim,
                       listing.skipped if listing is not None else [])
    except BaseException as exc:
        claim.release(ended=True)
        if replaced:
            _say_replaced(exc, store)
        raise


def _run_local(store: Store, src: Source, plan: PackPlan, opts: PackOptions, show: bool,
               _ray_address: str | None, check: Callable[[], None]) -> list[TaskResult]:
    results = []
    # One upload thread for the whole pack: a task's last shard and its fragment upload while
    # the next task reads and frames its samples (on an error, close() still finishes what
    # earlier tasks queued, so a rerun reuses them).
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
    """Task fragments already stored, from one listing rather than a HEAD per task (~8 ms each
    on loopback, 64 tasks in a big pack). A fragment missing from it is only redone; one listed
    is still checked by :func:`completed_task`."""
    store.fs.invalidate_cache(store.path("manifest"))  # another process may have written since
    return set(store.glob("manifest/samples-*.parquet"))


def _run_ray(store: Store, src: Source, plan: PackPlan, opts: PackOptions, show: bool,
             ray_address: str | None, check: Callable[[], None]) -> list[TaskResult]:
    from shardkit.packing.ray_engine import run_tasks_on_ray

    return run_tasks_on_ray(store, src, plan, opts, show, ray_address, check)


def _pack_iterable(items: Iterable[dict[str, Any]], store: Store, opts: PackOptions, overwrite: bool,
                   show: bool) -> dict[str, Any]:
    started = time.monotonic()
    _refuse_committed(store, overwrite)
    claim = Claim(store, ITERABLE_PLAN, {"source": {"type": "iterable"}, "shard_bytes": opts.shard_bytes,
                                         "shard_samples": opts.shard_samples, "transform": opts.transform_desc})
    claim.take(overwrite)
    replaced = False
    try:
        # An iterable cannot be replanned, so a rerun starts over: clear what an earlier run left.
        replaced = _prepare_destination(store, claim, overwrite, resumable=False)
        return _pack_iterable_claimed(items, store, opts, show, started, claim)
    except BaseException as exc:
        claim.release(ended=True)
        if replaced:
            _say_replaced(exc, store)
        raise


def _pack_iterable_claimed(items: Iterable[dict[str, Any]], store: Store, opts: PackOptions, show: bool,
                           started: float, claim: Claim) -> dict[str, Any]:
    from shardkit.packing.sources.iterable import samples_from_iterable

    skipped: list[dict[str, str]] | None = [] if opts.on_error == "skip" else None
    results: list[TaskResult] = []
    fields: set[str] = set()  # of the fragment being built
    noted = 0  # entries of skipped already handed to a result
    building = FragmentBuilder()

    def close_fragment() -> TaskResult:
        """The result for the fragment built so far, whose write is not yet done; start the next."""
        nonlocal building, fields, noted
        builder, number = building, len(results)
        result = TaskResult(number, fragment_name(number), builder.shards, [], (skipped or [])[noted:],
                            sorted(fields), builder.num_rows, sum(s.bytes for s in builder.shards))
        results.append(result)
        building, fields, noted = FragmentBuilder(), set(), len(skipped or [])
        return result

    def on_shard(record: ShardRecord, rows: SampleRows) -> None:
        building.add(record, rows)
        if building.num_rows >= ITERABLE_FRAGMENT_ROWS or building.nbytes >= ITERABLE_FRAGMENT_BYTES:
            builder, result = building, close_fragment()

            def write() -> None:  # after the fragment's shards (the uploader keeps the order)
                result.row_groups = builder.write(store, result.fragment)

            writer.submit(write)

    with Progress(None, None, 1, "pack", enabled=show) as bar, \
            ShardWriter(store, shard_bytes=opts.shard_bytes, shard_samples=opts.shard_samples,
                        on_shard=on_shard, on_rows=lambda rows: building.add_rows(rows)) as writer:
        for sample in samples_from_iterable(items, skipped):
            if opts.transform is not None:
                sample = opts.transform(sample)
            writer.write(sample)
            fields.update(sample.fields)
            bar.advance(1, sample.nbytes())
    if not writer.shards:
        raise SourceError("source iterable is empty")
    if building.shards:  # every shard is stored by now (the writer closed): write the last fragment here
        builder, result = building, close_fragment()
        result.row_groups = builder.write(store, result.fragment)
    # (Every skip is in a result now: the last shard closed, and with it any open fragment,
    # once the iterable was exhausted.)
    return _commit(store, {"type": "iterable"}, None, results, started, "local", opts, claim)


def _commit(store: Store, source_desc: dict[str, Any], labels: dict[str, int] | None, results: list[TaskResult],
            started: float, engine: str, opts: PackOptions, claim: Claim,
            listing_skipped: list[dict[str, str]] | None = None) -> dict[str, Any]:
    records = [r for res in results for r in res.shards]
    files = [res.fragment for res in results for _ in res.shards]
    groups = [g for res in results for g in res.row_groups]
    table = shards_table(records, files, groups)
    claim.check()  # never commit over shards another pack may have rewritten since
    if store.exists(DATASET_JSON):
        # A racing pack of the same plan committed first: leave its manifest untouched.
        raise DatasetExistsError(f"{store.url} was committed by another pack while this one ran")
    _sweep_strays(store, results)
    _abort_uploads(store)
    write_shards_table(store, table)
    fields = sorted({f for res in results for f in res.fields})
    skipped = [*(listing_skipped or []), *(s for res in results for s in res.skipped)]
    info = dataset_info(table, fields, source_desc, labels, skipped,
                        {"pack": {"engine": engine, "shard_bytes": opts.shard_bytes, "transform": opts.transform_desc}})
    commit(store, info)
    claim.release(ended=False)  # stop the heartbeat first: a late refresh would recreate the claim
    store.remove("_pack", recursive=True)
    elapsed = time.monotonic() - started
    log.info("packed %d samples into %d shards (%d bytes) in %.1fs", info["num_samples"], info["num_shards"],
             info["total_bytes"], elapsed)
    return {**info, "elapsed_seconds": round(elapsed, 3),
            "reused_tasks": sum(1 for r in results if r.reused), "tasks": len(results)}

