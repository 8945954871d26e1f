"""Committing a pack of parts: the parts' shards get the dataset's shard numbers, then the commit.

Each part numbered its shards from 0 (:mod:`shardkit.packing.part_task`); here, once every part
is done, part ``p``'s shards take the numbers after those of parts ``0..p-1``, and its staged
fragment is written to ``manifest/samples-PPPPP.parquet`` with the ``shard`` column and the
shard checksums renumbered (a fragment at a time, so the driver holds one part's rows). Keys
are checked unique across parts on the way, then :func:`~shardkit.packing.commit.commit_pack`
commits as for any pack.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardkit.errors import SourceError
from shardkit.format.manifest import SHARD_CHECKSUMS_KEY, parquet_file
from shardkit.packing.claim import Claim
from shardkit.packing.commit import commit_pack
from shardkit.packing.key_ledger import KeySet
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
    seen = KeySet()
    first = 0
    committed: list[TaskResult] = []
    for res in results:
        if not res.shards:
            committed.append(res)
            continue
        data = store.read_bytes(staged_fragment(res.task))
        out, groups = _renumber(data, first, res, results, store, seen)
        store.put_bytes(res.fragment, out)
        shards = [replace(r, shard=r.shard + first) for r in res.shards]
        committed.append(replace(res, shards=shards, row_groups=[groups.get(r.shard, -1) for r in res.shards]))
        first += len(res.shards)
    # The parts were staged by other processes (Ray tasks): a listing this process cached
    # would hide them from the commit's removal of _pack/.
    store.fs.invalidate_cache(store.path("_pack"))
    return commit_pack(store, claim, committed, source=source, labels=None, started=started, engine=engine, opts=opts)


def _renumber(data: bytes, first: int, res: TaskResult, results: list[TaskResult], store: Store,
              seen: KeySet) -> tuple[bytes, dict[int, int]]:
    """A staged fragment with its shards numbered from ``first``, checking its keys against ``seen``.

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
            for key in table.column("key").to_pylist():
                if not seen.add(key):
                    raise SourceError(_repeat(key, res.task, results, store))
            shard = table.column(where)
            if len(shard):
                groups[int(shard[0].as_py())] = g
            table = table.set_column(where, schema.field(where), pc.add(shard, pa.scalar(first, pa.int32())))
            pw.write_table(table, row_group_size=max(1, table.num_rows))
    return buf.getvalue(), groups


def _repeat(key: str, part: int, results: list[TaskResult], store: Store) -> str:
    """The one-line error for ``key`` found twice, naming the parts that hold it."""
    for other in results:
        if other.task >= part or not other.shards:
            continue
        keys = parquet_file(store.read_bytes(staged_fragment(other.task))).read(columns=["key"]).column("key")
        if pc.any(pc.equal(keys, key)).as_py():
            return (f"duplicate key {key!r} in part {other.task} and part {part}: keys must be unique across parts "
                    "(prefix each part's __key__ with its index, or leave __key__ out)")
    return f"duplicate key {key!r} in part {part}: keys must be unique across parts"
