"""The matrix's shardkit rows and ceilings; each function is one row, run in its own forked
process by benchmarks/forkrun.py (``args`` is the row's JSON config from benchmarks/matrix.py).

Loader modes (``args["mode"]``), every one reading the same shards with the same batch size:

- ``per_sample``: a plain ``torch.utils.data.DataLoader`` (2 workers, ``collate_fn=shardkit.collate``
  as the docs advise) over a per-sample ``StreamingDataset`` (``loader_batch_size`` set); runs
  before 2026-12-02 18:00Z used torch's default collate here, as the peers' per-sample rows do;
- ``workers``: ``StreamingDataLoader`` with 2 workers building batches (shared ring handoff);
- ``threads``: ``StreamingDataLoader(num_workers=0)``, batches filled by the stream's read threads;
- ``zero_copy``: ``num_workers=0``, batches of views into the node cache's files;
- ``nocache``: ``StreamingDataLoader`` with 2 workers and ``cache_dir=None`` (ranged reads).

Knobs (``args["knobs"]``): ``prefetch``, ``read_threads``, and ``part_mib``: the ranged-GET part
size of cold downloads (``shardkit.read.shard_source.FETCH_PART_SIZE``, set in this process
before the loader starts; forked workers inherit it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import boto3  # noqa: F401 - imported here so that the forking server pays for it once
import numpy as np  # noqa: F401 - as boto3
import torch  # noqa: F401 - as boto3
from torch.utils.data import DataLoader

import shardkit
from benchmarks.common import boto3_client, get_ceiling, get_range_into
from benchmarks.matrix_data import KINDS, MODES, cell_samples, load_pool, payload_bytes
from benchmarks.matrix_measure import measured_row, phase

__all__ = ["pack_row", "ceiling_row", "cat_row", "loader_row", "MODES"]



def _opts() -> dict[str, Any]:
    return {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "region_name": "us-east-1"}}


def pack_row(args: dict[str, Any]) -> dict[str, Any]:
    """Pack the cell's samples with shardkit (local engine); what the other rows need of it.

    Returns:
        ``seconds``, ``num_shards``, ``objects`` ([key, bytes] per shard, in order),
        ``first_batch_end`` (bytes of shard 0 up to the end of its ``batch``-th sample).
    """
    kind = args["kind"]
    pool = load_pool(kind, args.get("jpeg_dir"), args.get("quick", False))
    url = f"s3://{args['bucket']}/sk"
    t0 = time.perf_counter()
    info = shardkit.pack(cell_samples(kind, pool, args["count"]), url, shard_bytes=args["shard_bytes"],
                         storage_options=_opts(), progress=False)
    seconds = time.perf_counter() - t0
    ds = shardkit.open_dataset(url, _opts())
    rows = ds.samples.select(["shard", "offset", "size"]).slice(0, KINDS[kind].batch).to_pydict()
    ends = [o + s for sh, o, s in zip(rows["shard"], rows["offset"], rows["size"]) if sh == 0]
    return {"seconds": round(seconds, 3), "num_shards": info["num_shards"], "num_samples": info["num_samples"],
            "objects": [[f"sk/{i.path}", i.bytes] for i in ds.shard_list], "first_batch_end": max(ends),
            "payload_bytes": payload_bytes(pool, args["count"])}


def ceiling_row(args: dict[str, Any]) -> dict[str, Any]:
    """The ranged-GET ceiling of the cell's shard bytes, and a bare GET of the first batch's.

    GET ceiling: ``common.get_ceiling`` (8 threads, the best over 8/16/32 MiB parts, ``passes``
    passes each, into buffers allocated before the clock). First batch: one GET of shard 0's
    bytes ``[0, first_batch_end)`` on a client made before the clock (its connection not yet
    open, as a loader's first request), the best of 3.
    """
    objects = [(k, int(b)) for k, b in args["objects"]]
    client = boto3_client(max_pool=16)
    bufs = {k: bytearray(b) for k, b in objects}
    seconds, part = get_ceiling(client, args["bucket"], objects, bufs, passes=int(args.get("passes", 2)))
    bufs.clear()
    end = int(args["first_batch_end"])
    dest = {objects[0][0]: bytearray(end)}
    firsts = []
    for _ in range(3):
        fresh = boto3_client(max_pool=1)
        t0 = time.perf_counter()
        get_range_into(fresh, args["bucket"], (objects[0][0], 0, end), dest)
        firsts.append(time.perf_counter() - t0)
    return {"get_seconds": round(seconds, 4), "get_part_mib": part >> 20, "bytes": sum(b for _, b in objects),
            "first_batch_get_s": round(min(firsts), 4), "first_batch_bytes": end}


def cat_row(args: dict[str, Any]) -> dict[str, Any]:
    """``cat`` of the cached shard files to /dev/null: a first pass (reported) brings them into
    the page cache, the ceiling is the best of the next 3."""
    files = [p for p in Path(args["cache_dir"]).rglob("*.tar") if p.is_file() and ".tmp" not in p.parts]
    if not files:
        raise FileNotFoundError(f"no cached shard files under {args['cache_dir']}")

    def one() -> float:
        t0 = time.perf_counter()
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
        return time.perf_counter() - t0

    first = one()
    return {"seconds": round(min(one() for _ in range(3)), 4), "first_pass_s": round(first, 4),
            "bytes": sum(p.stat().st_size for p in files), "files": len(files)}


def _make_loader(args: dict[str, Any], cache: str | None) -> Any:
    """The row's dataset and a function making one epoch's loader over it."""
    mode, knobs = args["mode"], args.get("knobs") or {}
    batch = KINDS[args["kind"]].batch
    kw: dict[str, Any] = {"cache_dir": cache, "cache_limit": "50GB", "shuffle": False,
                          "storage_options": _opts(), "prefetch": knobs.get("prefetch")}
    if "read_threads" in knobs:
        kw["read_threads"] = knobs["read_threads"]
    url = f"s3://{args['bucket']}/sk"
    if mode == "per_sample":
        ds = shardkit.StreamingDataset(url, loader_batch_size=batch, **kw)
        return lambda: DataLoader(ds, batch_size=batch, num_workers=2, persistent_workers=False,
                                  collate_fn=shardkit.collate)
    ds = shardkit.StreamingDataset(url, batch_size=batch, zero_copy=mode == "zero_copy", **kw)
    if mode in ("workers", "nocache"):
        return lambda: shardkit.StreamingDataLoader(ds, num_workers=2, persistent_workers=False)
    if mode in ("threads", "zero_copy"):
        return lambda: shardkit.StreamingDataLoader(ds, num_workers=0)
    raise ValueError(f"unknown mode {mode!r}; expected one of {sorted(MODES)}")


def loader_row(args: dict[str, Any]) -> dict[str, Any]:
    """One loader mode on one cell: a cold epoch (empty cache) then the best of ``warm_epochs``
    warm epochs (``warm_epochs=0``: cold only), each through a new loader.

    Returns:
        ``cold`` and ``warm`` phases (see ``matrix_measure.phase``) and ``rss``.
    """
    knobs = args.get("knobs") or {}
    if "part_mib" in knobs:
        import shardkit.read.shard_source as shard_source

        if not isinstance(getattr(shard_source, "FETCH_PART_SIZE", None), int):  # never a silent no-op knob
            raise RuntimeError("part_mib: shardkit.read.shard_source.FETCH_PART_SIZE is gone; update the matrix")
        shard_source.FETCH_PART_SIZE = int(knobs["part_mib"]) << 20
    cache = None if args["mode"] == "nocache" else args["cache_dir"]
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
    count, payload = int(args["count"]), int(args["payload_bytes"])

    def run() -> dict[str, Any]:
        t0 = time.perf_counter()
        make = _make_loader(args, cache)
        out: dict[str, Any] = {"open_s": round(time.perf_counter() - t0, 4)}
        out["cold"] = phase(make, 1, count, payload)
        warm = int(args.get("warm_epochs", 2))
        if warm and cache and out["cold"]["status"] == "ok":
            out["warm"] = phase(make, warm, count, payload)
        return out

    try:
        return measured_row(run)
    finally:
        if cache and not args.get("keep_cache"):
            shutil.rmtree(cache, ignore_errors=True)

