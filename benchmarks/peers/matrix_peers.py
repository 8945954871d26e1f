"""The matrix's peer rows: webdataset, MosaicML Streaming and LitData on the matrix's samples
(benchmarks/matrix_data.py), each packing the same samples at the same shard/chunk size and
reading them back through a torch DataLoader (2 workers, torch's default collate, the
matrix's batch size), as benchmarks/peers/{wds,mds,litdata}_peer.py do for the JPEG run.

Each function is one row, run in its own forked process of the peers' venv by
benchmarks/forkrun.py; ``args`` is the row's config from benchmarks/matrix.py. Every loader
row returns the ``cold`` phase (first epoch, empty local cache) and, where the tool caches,
``warm`` (the best of ``warm_epochs`` later epochs from its cache), plus ``rss``.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
os.environ["AWS_ALLOW_HTTP"] = "true"  # LitData's obstore client (see _litdata_site)

import litdata  # noqa: E402,F401 - imported once by the forking server
import streaming  # noqa: E402,F401
import torch  # noqa: E402,F401
import webdataset  # noqa: E402,F401

from benchmarks.common import boto3_client  # noqa: E402
from benchmarks.matrix_data import KINDS, load_pool, sample_dict  # noqa: E402
from benchmarks.matrix_measure import measured_row, phase  # noqa: E402
from benchmarks.peers._base import loader  # noqa: E402

__all__ = ["wds_pack", "wds_row", "mds_pack", "mds_row", "litdata_pack", "litdata_row"]


def _pool(args: dict[str, Any]) -> list[bytes]:
    return load_pool(args["kind"], args.get("jpeg_dir"), args.get("quick", False))


class Sample:
    """A tool's sample -> ``{"data": bytes, "cls": int}``, the same for every peer (picklable)."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __call__(self, s: dict[str, Any]) -> dict[str, Any]:
        return {"data": s[self.field], "cls": int(s["cls"])}


def _loader_phases(args: dict[str, Any], make: Any, cached: bool) -> dict[str, Any]:
    count, payload = int(args["count"]), int(args["payload_bytes"])
    out: dict[str, Any] = {"cold": phase(make, 1, count, payload)}
    warm = int(args.get("warm_epochs", 2))
    if cached and warm and out["cold"]["status"] == "ok":
        out["warm"] = phase(make, warm, count, payload)
    return out


# --------------------------------------------------------------------------- webdataset


def wds_pack(args: dict[str, Any]) -> dict[str, Any]:
    """webdataset's ShardWriter to local tars (``maxsize`` = the shard size), then an upload."""
    import webdataset as wds

    from shardkit.config import parse_size

    pool, kind = _pool(args), args["kind"]
    out = os.path.join(args["work"], "wds-tars")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    t0 = time.perf_counter()
    with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxsize=parse_size(args["shard_bytes"], "shard_bytes"),
                         maxcount=10**9, verbose=0) as sink:
        for i in range(int(args["count"])):
            s = sample_dict(kind, pool, i)
            sink.write({**s, "cls": str(s["cls"]).encode()})
    client = boto3_client()
    tars = sorted(glob.glob(os.path.join(out, "*.tar")))
    for t in tars:
        client.upload_file(t, args["bucket"], f"wds/{os.path.basename(t)}")
    seconds = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": round(seconds, 3), "num_shards": len(tars),
            "urls": [f"s3://{args['bucket']}/wds/{os.path.basename(t)}" for t in tars]}


def wds_row(args: dict[str, Any]) -> dict[str, Any]:
    """webdataset over S3 (s3fs, 8 MB reads): ``cache_dir`` None streams every epoch."""
    import webdataset as wds

    from benchmarks.peers.wds_peer import s3_opener

    wds.gopen_schemes["s3"] = s3_opener
    cache = args.get("cache_dir")
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
        os.makedirs(cache)
    field, batch = KINDS[args["kind"]].field, KINDS[args["kind"]].batch

    def make() -> Any:
        ds = wds.WebDataset(args["urls"], shardshuffle=False, cache_dir=cache, workersplitter=wds.split_by_worker,
                            empty_check=False)
        return loader(ds.map(Sample(field)), batch_size=batch)

    try:
        return measured_row(lambda: _loader_phases(args, make, bool(cache)))
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)


# --------------------------------------------------------------------------- MosaicML Streaming


def mds_pack(args: dict[str, Any]) -> dict[str, Any]:
    """MDSWriter straight to S3 (its uploader reads S3_ENDPOINT_URL), ``size_limit`` = shard size."""
    from streaming import MDSWriter

    from shardkit.config import parse_size

    pool, kind, field = _pool(args), args["kind"], KINDS[args["kind"]].field
    t0 = time.perf_counter()
    with MDSWriter(out=f"s3://{args['bucket']}/mds", columns={"data": "bytes", "cls": "int"}, compression=None,
                   size_limit=parse_size(args["shard_bytes"], "shard_bytes"), progress_bar=False) as w:
        for i in range(int(args["count"])):
            s = sample_dict(kind, pool, i)
            w.write({"data": s[field], "cls": s["cls"]})
    return {"seconds": round(time.perf_counter() - t0, 3)}


def mds_row(args: dict[str, Any]) -> dict[str, Any]:
    """MosaicML's StreamingDataset with a local cache, one instance for every epoch."""
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    cache = args["cache_dir"]
    shutil.rmtree(cache, ignore_errors=True)
    batch = KINDS[args["kind"]].batch
    try:
        def run() -> dict[str, Any]:
            ds = StreamingDataset(remote=f"s3://{args['bucket']}/mds", local=cache, shuffle=False, batch_size=batch)
            return _loader_phases(args, lambda: loader(ds, batch_size=batch), True)

        return measured_row(run)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


# --------------------------------------------------------------------------- LitData


class LitSample:
    """``optimize``'s fn: input ``i`` -> sample ``i`` (the pool is loaded once per worker)."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args: dict[str, Any] = {k: args[k] for k in ("kind", "jpeg_dir", "quick") if k in args}
        self.pool: list[bytes] | None = None

    def __call__(self, i: int) -> dict[str, Any]:
        if self.pool is None:
            self.pool = _pool(self.args)
        s = sample_dict(self.args["kind"], self.pool, i)
        return {"data": s[KINDS[self.args["kind"]].field], "cls": s["cls"]}


def _litdata_http() -> None:
    import litdata.streaming.downloader as dl

    dl._OBSTORE_CLIENT_OPTIONS = {**dict(dl._OBSTORE_CLIENT_OPTIONS), "allow_http": True}


def litdata_pack(args: dict[str, Any]) -> dict[str, Any]:
    """LitData's ``optimize`` to S3 (2 workers), ``chunk_bytes`` = the shard size."""
    import litdata as ld

    _litdata_http()
    t0 = time.perf_counter()
    ld.optimize(fn=LitSample(args), inputs=list(range(int(args["count"]))), output_dir=f"s3://{args['bucket']}/litdata",
                chunk_bytes=args["shard_bytes"].replace("B", "b"), num_workers=2, mode="overwrite")
    return {"seconds": round(time.perf_counter() - t0, 3)}


def litdata_row(args: dict[str, Any]) -> dict[str, Any]:
    """LitData's StreamingDataset with a local cache, one instance for every epoch."""
    import litdata as ld

    _litdata_http()
    cache = args["cache_dir"]
    shutil.rmtree(cache, ignore_errors=True)
    batch = KINDS[args["kind"]].batch
    try:
        def run() -> dict[str, Any]:
            ds = ld.StreamingDataset(f"s3://{args['bucket']}/litdata", cache_dir=cache, shuffle=False)
            return _loader_phases(args, lambda: loader(ds, batch_size=batch), True)

        return measured_row(run)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
