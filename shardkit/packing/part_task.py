"""The body of one part of a parts source (or one Ray Data write task), whichever engine runs it.

A part's length is not known ahead, so its shards cannot take the dataset's shard numbers:
they are numbered from 0 within the part and named by the part's index
(``shards/part-PPPPP-SSSSSS.tar``), and the part's samples fragment, with those local numbers,
is staged under ``_pack/parts/`` with a footer recording the part's shards. The driver renumbers
the parts' shards at commit (:mod:`shardkit.packing.part_commit`). A rerun of the same pack
finds a finished part by its staged footer (:func:`completed_part`) and skips it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from typing import Callable, Iterable

from shardkit.errors import SourceError
from shardkit.format.fragments import FragmentBuilder
from shardkit.format.manifest import fragment_name, parquet_file
from shardkit.format.rows import SampleRows, ShardRecord
from shardkit.packing.manifest_writer import put_fragment
from shardkit.packing.sample import PackSample
from shardkit.packing.task import TASK_META, PackOptions, TaskResult, shards_intact
from shardkit.packing.writer import ShardWriter
from shardkit.storage.store import Store

__all__ = ["completed_part", "part_shard_name", "run_part", "staged_fragment"]

log = logging.getLogger(__name__)


def part_shard_name(part: int, shard: int) -> str:
    """The path of shard ``shard`` (numbered within its part) of part ``part``.

    Args:
        part: the part's index.
        shard: the shard's number within the part.

    Returns:
        ``shards/part-PPPPP-SSSSSS.tar``.
    """
    return f"shards/part-{part:05d}-{shard:06d}.tar"


def staged_fragment(part: int) -> str:
    """Where part ``part``'s samples fragment waits for the commit.

    Args:
        part: the part's index.

    Returns:
        ``_pack/parts/samples-PPPPP.parquet``.
    """
    return f"_pack/parts/samples-{part:05d}.parquet"


def run_part(store: Store, part: int, samples: Iterable[PackSample], skipped: list[dict[str, str]],
             plan_id: str, opts: PackOptions, progress: Callable[[int, int], None] | None = None) -> TaskResult:
    """Write one part's shards, then stage its fragment.

    Args:
        store: the dataset root.
        part: the part's index (names its shards and fragment).
        samples: its samples (a bad one raises SourceError naming the part).
        skipped: the list ``samples`` appends the items it left out to (``on_error="skip"``).
        plan_id: the pack's fingerprint, recorded in the staged fragment for :func:`completed_part`.
        opts: the pack's options (``task_bytes`` does not apply).
        progress: called with (samples, bytes) as each sample is written.

    Returns:
        The part's result: its shards numbered from 0 within the part, ``fragment`` the name the
        commit gives its fragment, ``row_groups`` empty (the commit fills them in).

    Raises:
        SourceError: a bad sample, or an error of the part's own code, naming the part.
        StorageError: a write failed.
    """
    fragment = FragmentBuilder()
    fields: set[str] = set()

    def on_shard(record: ShardRecord, rows: SampleRows) -> None:
        fragment.add(record, rows)

    with ShardWriter(store, shard_bytes=opts.shard_bytes, shard_samples=opts.shard_samples,
                     name_for=lambda j: part_shard_name(part, j), on_shard=on_shard,
                     on_rows=fragment.add_rows) as writer:
        for sample in samples:
            try:
                if opts.transform is not None:
                    sample = opts.transform(sample)
                writer.write(sample)
            except SourceError as exc:  # a transform's or the writer's: name the part and the sample
                raise SourceError(f"part {part}: sample {sample.key!r}: {exc}") from exc
            fields.update(sample.fields)
            if progress is not None:
                progress(1, sample.nbytes())
    records = list(writer.shards)
    for entry in skipped:  # the items a part left out, named by part in dataset.json's list
        if not entry["ref"].startswith("part "):
            entry["ref"] = f"part {part} {entry['ref']}"
    summary = {"plan_id": plan_id, "task": part, "shards": [asdict(r) for r in records], "skipped": skipped,
               "fields": sorted(fields)}
    put_fragment(store, staged_fragment(part), fragment, {TASK_META: json.dumps(summary)})
    return TaskResult(part, fragment_name(part), records, [], list(skipped), sorted(fields), fragment.num_rows,
                      sum(r.bytes for r in records))


def completed_part(store: Store, part: int, plan_id: str) -> TaskResult | None:
    """The result of an earlier run of part ``part`` of this pack, if its staged fragment and
    every shard are intact.

    Args:
        store: the dataset root.
        part: the part's index.
        plan_id: the pack's fingerprint: a part of another pack is not this one's.

    Returns:
        The earlier run's result (``reused=True``), or None when the part must be (re)done.
    """
    name = staged_fragment(part)
    try:
        if not store.exists(name):
            return None
        raw = (parquet_file(store.read_bytes(name)).metadata.metadata or {}).get(TASK_META.encode())
    except Exception:  # noqa: BLE001 - an unreadable fragment is simply redone
        log.debug("staged fragment %s unreadable, redoing part %d", name, part, exc_info=True)
        return None
    if raw is None:
        return None
    summary = json.loads(raw)
    if summary.get("plan_id") != plan_id or summary.get("task") != part:
        return None
    records = [ShardRecord(**r) for r in summary["shards"]]
    if not shards_intact(store, records):
        return None
    return TaskResult(part, fragment_name(part), records, [], summary["skipped"], summary["fields"],
                      sum(r.num_samples for r in records), sum(r.bytes for r in records), reused=True)
