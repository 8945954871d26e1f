"""Packing an iterable of sample dicts: streamed into shards as it comes, local engine only.

An iterable cannot be listed ahead, so it has no plan: its shards roll over as they fill
(:class:`~shardkit.packing.writer.ShardWriter`) and a samples fragment closes at the first shard
boundary past :data:`ITERABLE_FRAGMENT_ROWS` rows or :data:`ITERABLE_FRAGMENT_BYTES` compressed
bytes, so an endless iterable keeps one fragment's rows, not every row of the pack. A rerun
cannot resume it: it starts over.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from shardkit.errors import SourceError
from shardkit.format.fragments import FragmentBuilder
from shardkit.format.manifest import fragment_name
from shardkit.format.rows import SampleRows, ShardRecord
from shardkit.packing.claim import Claim
from shardkit.packing.commit import commit_pack
from shardkit.packing.destination import prepare_destination, refuse_committed, say_replaced
from shardkit.packing.manifest_writer import put_fragment
from shardkit.packing.progress import Progress
from shardkit.packing.sources.iterable import samples_from_iterable
from shardkit.packing.task import PackOptions, TaskResult
from shardkit.packing.writer import ShardWriter
from shardkit.storage.store import Store

__all__ = ["ITERABLE_FRAGMENT_BYTES", "ITERABLE_FRAGMENT_ROWS", "pack_iterable"]

_ITERABLE_PLAN = "iterable"  # an iterable cannot be planned: every run of one is the same "plan"
ITERABLE_FRAGMENT_ROWS = 1_000_000
ITERABLE_FRAGMENT_BYTES = 64 * 2**20


def pack_iterable(items: Iterable[dict[str, Any]], store: Store, opts: PackOptions, overwrite: bool,
                  show: bool) -> dict[str, Any]:
    """Pack an iterable of sample dicts into a dataset at ``store`` and commit it.

    Args:
        items: the samples (see :mod:`shardkit.packing.sources.iterable` for their form).
        store: the destination.
        opts: the pack's options (``task_bytes`` does not apply).
        overwrite: replace a dataset already there.
        show: show a progress bar on stderr.

    Returns:
        The dataset.json content, as :func:`~shardkit.packing.pack.pack` returns it.

    Raises:
        DatasetExistsError: the destination holds a dataset (and not ``overwrite``) or another pack.
        SourceError: a bad sample (``on_error="raise"``), or the iterable is empty.
        StorageError: a write failed.
    """
    started = time.monotonic()
    refuse_committed(store, overwrite)
    claim = Claim(store, _ITERABLE_PLAN, {"source": {"type": "iterable"}, "shard_bytes": opts.shard_bytes,
                                         "shard_samples": opts.shard_samples, "transform": opts.transform_desc})
    claim.take(overwrite)
    replaced = False
    try:
        # An iterable cannot be replanned, so a rerun starts over: clear what an earlier run left.
        replaced = prepare_destination(store, claim, overwrite, resumable=False)
        return _pack_claimed(items, store, opts, show, started, claim)
    except BaseException as exc:
        claim.release(ended=True)
        if replaced:
            say_replaced(exc, store)
        raise


def _pack_claimed(items: Iterable[dict[str, Any]], store: Store, opts: PackOptions, show: bool,
                  started: float, claim: Claim) -> dict[str, Any]:
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
                result.row_groups = put_fragment(store, result.fragment, builder)

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
        result.row_groups = put_fragment(store, result.fragment, builder)
    # (Every skip is in a result now: the last shard closed, and with it any open fragment,
    # once the iterable was exhausted.)
    return commit_pack(store, claim, results, source={"type": "iterable"}, labels=None, started=started,
                       engine="local", opts=opts)
