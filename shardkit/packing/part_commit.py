"""Committing a pack of parts: the parts' shards get the dataset's shard numbers, then the commit.

Each part numbered its shards from 0 (:mod:`shardkit.packing.part_task`); here, once every part
is done, part ``p``'s shards take the numbers after those of parts ``0..p-1``, and its staged
fragment is written to ``manifest/samples-PPPPP.parquet`` with the ``shard`` column and the
shard checksums renumbered (a fragment at a time, so the driver holds one part's rows). Keys
are checked unique across parts: their hashes on the way (12 bytes a key), then the keys of the
shards whose hashes collide are read back. Then :func:`~shardkit.packing.commit.commit_pack`
commits as for any pack.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardkit.errors import SourceError
from shardkit.format.manifest import SHARD_CHECKSUMS_KEY, parquet_file
from shardkit.packing.claim import Claim
from shardkit.packing.commit import commit_pack
from shardkit.packing.key_ledger import KeyLedger
from shardkit.packing.part_task import staged_fragment
from shardkit.packing.task import TASK_META, PackOptions, TaskResult
from shardkit.storage.store import Store

__all__ = ["commit_parts"]


def commit_parts(store: Store, claim: Claim, results: list[TaskResult], *, source: dict[str, Any], started: float,
                 engine: str, opts: PackOptions) -> dict[str, Any]:
    """Renumber the parts' shards, write their fragments and commit the dataset.

    Args:
        store: the destination.
        claim: this pack's claim, held.
        results: every part's result (staged, shards numbered within the part), in part order.
        source: the source's description for dataset.json.
        started: ``time.monotonic()`` when the pack started.
        engine: the engine's name, recorded in dataset.json.
        opts: the pack's options.

    Returns:
        The dataset.json content, with ``elapsed_seconds``, ``reused_tasks`` and ``tasks``.

    Raises:
        SourceError: every part was empty, or two parts hold the same key (naming it and them).
        DatasetExistsError: another pack took the destination over, or committed there first.
        StorageError: a read or write failed.
    """
    if not any(r.shards for r in results):
        raise SourceError("source parts are empty: no part yielded a sample")
    keys = KeyLedger()  # 12 bytes a key: the driver never holds the keys themselves
    first = 0
    committed: list[TaskResult] = []
    for res in results:
        if not res.shards:
            committed.append(res)
            continue
        data = store.read_bytes(staged_fragment(res.task))
        out, groups = _renumber(data, first, res, keys)
        store.put_bytes(res.fragment, out)
        shards = [replace(r, shard=r.shard + first) for r in res.shards]
        committed.append(replace(res, shards=shards, row_groups=[groups.get(r.shard, -1) for r in res.shards]))
        first += len(res.shards)
    _refuse_repeats(store, keys, committed)
    # The parts were staged by other processes (Ray tasks): a listing this process cached
    # would hide them from the commit's removal of _pack/.
    store.fs.invalidate_cache(store.path("_pack"))
    return commit_pack(store, claim, committed, source=source, labels=None, started=started, engine=engine, opts=opts)


def _renumber(data: bytes, first: int, res: TaskResult, keys: KeyLedger) -> tuple[bytes, dict[int, int]]:
    """A staged fragment with its shards numbered from ``first``; its keys go to ``keys``.

    Returns:
        The fragment's bytes, and each local shard number's row group.
    """
    pf = parquet_file(data, staged_fragment(res.task))
    meta = dict(pf.schema_arrow.metadata or {})
    meta.pop(TASK_META.encode(), None)
    sums = json.loads(meta.get(SHARD_CHECKSUMS_KEY, b"{}"))
    meta[SHARD_CHECKSUMS_KEY] = json.dumps({str(int(k) + first): v for k, v in sums.items()}).encode()
    schema = pf.schema_arrow.with_metadata(meta)
    where = schema.get_field_index("shard")
    groups: dict[int, int] = {}
    buf = io.BytesIO()
    with pq.ParquetWriter(buf, schema, compression="zstd") as pw:
        for g in range(pf.num_row_groups):
            table = pf.read_row_group(g)
            shard = table.column(where)
            if len(shard):
                local = int(shard[0].as_py())
                groups[local] = g
                for key in table.column("key").to_pylist():
                    keys.add(key, local + first)
            table = table.set_column(where, schema.field(where), pc.add(shard, pa.scalar(first, pa.int32())))
            pw.write_table(table, row_group_size=max(1, table.num_rows))
    return buf.getvalue(), groups


def _refuse_repeats(store: Store, keys: KeyLedger, committed: list[TaskResult]) -> None:
    """Raise SourceError naming a key two parts share, reading back only the keys of the shards
    the ledger suspects (equal 64-bit hashes)."""
    where: dict[int, tuple[TaskResult, int]] = {}  # global shard -> (its part, its row group)
    for res in committed:
        for rec, group in zip(res.shards, res.row_groups):
            where[rec.shard] = (res, group)
    files: dict[str, Any] = {}

    def keys_of(shard: int) -> list[str]:
        res, group = where[shard]
        if res.fragment not in files:
            files[res.fragment] = parquet_file(store.read_bytes(res.fragment), res.fragment)
        return files[res.fragment].read_row_group(group, columns=["key"]).column(0).to_pylist()

    for a, b in keys.suspects():
        keys_a = keys_of(a)
        both = sorted(k for k, n in Counter(keys_a).items() if n > 1) if a == b else sorted(set(keys_a) & set(keys_of(b)))
        if both:
            part_a, part_b = where[a][0].task, where[b][0].task
            pair = f"part {part_a}" if part_a == part_b else f"part {part_a} and part {part_b}"
            raise SourceError(f"duplicate key {both[0]!r} in {pair}: keys must be unique across parts (prefix each "
                              "part's __key__ with its index, or leave __key__ out)")
