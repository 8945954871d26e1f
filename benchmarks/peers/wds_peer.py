"""webdataset 1.0.2 over S3: its ShardWriter packs, an fsspec opener registered for s3://.

Rows: streaming from S3 with no cache (cold: S3 every epoch), with ``cache_dir`` (cold epoch,
then warm from the local copies), decoded from the cache.
"""

from __future__ import annotations

import glob
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.common import boto3_client, failed_row, row  # noqa: E402
from benchmarks.peers._base import Crop, epoch_row, finish, guarded, list_images, load_config, loader  # noqa: E402

TOOL = "webdataset"
BUF = 8 << 20


def s3_opener(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
    """webdataset 1.0.2 has no s3:// handler in gopen_schemes: open through s3fs, 8 MB reads."""
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"],
                                          "region_name": "us-east-1"})
    return fs.open(url, "rb", block_size=BUF)


class Sample:
    """wds dict -> the same {"jpg": bytes, "cls": int} every row yields; optional decode."""

    def __init__(self, decode: bool) -> None:
        self.crop = Crop() if decode else None

    def __call__(self, s: dict[str, Any]) -> dict[str, Any]:
        out = {"jpg": s["jpg"], "cls": int(s["cls"])}
        return self.crop(out) if self.crop else out


def dataset(urls: list[str], cache_dir: str | None, decode: bool) -> Any:
    import webdataset as wds

    wds.gopen_schemes["s3"] = s3_opener
    ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=cache_dir, workersplitter=wds.split_by_worker,
                        empty_check=False)
    return ds.map(Sample(decode))


def main() -> None:
    import webdataset as wds

    wds.gopen_schemes["s3"] = s3_opener
    cfg = load_config()
    items = list_images(cfg["images_dir"])
    n, nbytes, bucket, work = len(items), int(cfg["total_bytes"]), cfg["bucket"], cfg["work"]
    rows: list[dict[str, Any]] = []
    from shardkit.config import parse_size

    maxsize = parse_size(cfg["shard_bytes"], "shard_bytes")

    def pack() -> dict[str, Any]:
        out = os.path.join(work, "tars")
        os.makedirs(out)
        t0 = time.perf_counter()
        with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxsize=maxsize, maxcount=10**9,
                             verbose=0) as sink:
            for i, (path, label) in enumerate(items):
                with open(path, "rb") as f:
                    sink.write({"__key__": f"{i:07d}", "jpg": f.read(), "cls": str(label).encode()})
        client = boto3_client()
        tars = sorted(glob.glob(os.path.join(out, "*.tar")))
        for t in tars:
            client.upload_file(t, bucket, f"wds/{os.path.basename(t)}")
        return row("webdataset ShardWriter + upload", "pack", TOOL, kind="pack", samples=n,
                   seconds=time.perf_counter() - t0, nbytes=nbytes, shards=len(tars))

    packed = guarded(rows, "webdataset ShardWriter + upload", "pack", TOOL, pack, kind="pack")
    names = [("webdataset S3, no cache", "cold"), ("webdataset S3 + cache_dir, cold", "cold"),
             ("webdataset S3 + cache_dir, warm", "warm"), ("webdataset S3 + cache_dir, decoded", "decoded")]
    if packed["status"] != "ok":
        rows.extend(failed_row(nm, g, TOOL, "pack failed: " + packed["reason"]) for nm, g in names)
        finish(rows, ["webdataset", "s3fs", "torch"])
        return
    urls = [f"s3://{bucket}/wds/{os.path.basename(t)}" for t in sorted(glob.glob(os.path.join(work, "tars", "*.tar")))]
    cache = os.path.join(work, "cache")
    os.makedirs(cache)
    plans = [(names[0], None, False), (names[1], cache, False), (names[2], cache, False), (names[3], cache, True)]
    for (nm, g), cdir, dec in plans:
        guarded(rows, nm, g, TOOL, lambda nm=nm, g=g, cdir=cdir, dec=dec: epoch_row(
            nm, g, TOOL, lambda: loader(dataset(urls, cdir, dec)), nbytes, n))
    finish(rows, ["webdataset", "s3fs", "torch"])


if __name__ == "__main__":
    main()
