"""Streaming-read benchmark: shardkit cold/warm (raw and batched) vs ceilings and naive baselines.

    .venv/bin/python benchmarks/bench_read.py [--count 3000]

One run, one SeaweedFS (started here), ~100 KB real JPEGs from shardkit.sampledata; every
reader goes through DataLoader(num_workers=2). Writes benchmarks/results/read.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Weed, boto3_client, time_loader  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=3000)
    args = ap.parse_args()
    import numpy as np
    from torch.utils.data import DataLoader, Dataset

    import shardkit
    from shardkit import StreamingDataLoader, StreamingDataset
    from shardkit.sampledata import make_image_folder

    work = Path(tempfile.mkdtemp(prefix="shardkit-bench-read-"))
    folder = make_image_folder(Path(tempfile.gettempdir()) / "shardkit-bench-images", args.count)
    files = sorted(p for p in folder.rglob("*.jpg"))
    total_bytes = sum(p.stat().st_size for p in files)
    out: dict[str, dict[str, float]] = {}

    def rec(name: str, seconds: float, n: int, nbytes: int) -> None:
        out[name] = {"seconds": seconds, "samples": n, "samples_per_s": n / seconds, "MB_per_s": nbytes / seconds / 1e6}
        print(f"{name:32s} {n / seconds:10.0f} samples/s {nbytes / seconds / 1e6:9.0f} MB/s")

    with Weed() as server:
        os.environ.update(server.env())
        client = boto3_client(server.env())
        client.create_bucket(Bucket="bench")
        url = "s3://bench/ds"
        shardkit.pack(str(folder), url, shard_bytes="64MB", progress=False)
        ds = shardkit.open_dataset(url)
        shards = [(i.path, i.bytes) for i in ds.shard_list]
        sbytes = sum(b for _, b in shards)

        # Ceiling 1: parallel ranged GETs (8 threads, 8 MiB parts) into preallocated buffers.
        def get_all() -> None:
            jobs = []
            bufs = {p: bytearray(b) for p, b in shards}
            for p, b in shards:
                for lo in range(0, b, 8 << 20):
                    jobs.append((p, lo, min(b, lo + (8 << 20))))

            def one(job: tuple[str, int, int]) -> None:
                p, lo, hi = job
                body = client.get_object(Bucket="bench", Key=f"ds/{p}", Range=f"bytes={lo}-{hi - 1}")["Body"]
                mv = memoryview(bufs[p])[lo:hi]
                while mv.nbytes:
                    n = body._raw_stream.readinto(mv)
                    mv = mv[n:]
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(one, jobs))
        t0 = time.perf_counter()
        get_all()
        rec("ceiling: S3 ranged GET x8", time.perf_counter() - t0, ds.num_samples, sbytes)

        def stream(batch: bool, cache: Path) -> tuple[float, int]:
            sd = StreamingDataset(url, cache_dir=cache, batch_size=256 if batch else None)
            loader = StreamingDataLoader(sd, num_workers=2) if batch else DataLoader(sd, batch_size=None, num_workers=2)
            return time_loader(loader, lambda b: len(b["__key__"]) if isinstance(b["__key__"], list) else 1)

        for batch in (True, False):
            cache = work / f"cache-{batch}"
            sec, n = stream(batch, cache)
            rec(f"shardkit cold {'batched' if batch else 'raw'}", sec, n, sbytes)
            sec, n = stream(batch, cache)
            rec(f"shardkit warm {'batched' if batch else 'raw'}", sec, n, sbytes)
        cached = [str(p) for p in (work / "cache-True").rglob("*.tar") if ".tmp" not in p.parts]
        t0 = time.perf_counter()
        subprocess.run(["cat", *cached], stdout=subprocess.DEVNULL, check=True)
        rec("ceiling: cat cached shards", time.perf_counter() - t0, ds.num_samples, sbytes)

        # Naive baselines: one S3 object per image; cv2.imread per local file.
        keys = [f"objs/{i}.jpg" for i in range(len(files))]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda kv: client.put_object(Bucket="bench", Key=kv[0], Body=kv[1].read_bytes()),
                          zip(keys, files)))

        class PerObject(Dataset):  # type: ignore[type-arg]
            def __len__(self) -> int:
                return len(keys)

            def __getitem__(self, i: int) -> bytes:
                global _CLIENT
                if "_CLIENT" not in globals():
                    _CLIENT = boto3_client()
                return _CLIENT.get_object(Bucket="bench", Key=keys[i])["Body"].read()

        sec, n = time_loader(DataLoader(PerObject(), batch_size=None, num_workers=2), lambda b: 1)
        rec("baseline: get_object per image", sec, n, total_bytes)

        class Imread(Dataset):  # type: ignore[type-arg]
            def __len__(self) -> int:
                return len(files)

            def __getitem__(self, i: int) -> object:
                import cv2
                return cv2.imread(str(files[i]))

        sec, n = time_loader(DataLoader(Imread(), batch_size=None, num_workers=2), lambda b: 1)
        rec("baseline: cv2.imread per file", sec, n, total_bytes)
    shutil.rmtree(work, ignore_errors=True)
    r = {k: v["MB_per_s"] for k, v in out.items()}
    ratios = {
        "cold_batched / GET ceiling": r["shardkit cold batched"] / r["ceiling: S3 ranged GET x8"],
        "warm_raw / cat": r["shardkit warm raw"] / r["ceiling: cat cached shards"],
        "warm_batched / cat": r["shardkit warm batched"] / r["ceiling: cat cached shards"],
        "warm_batched / per-object": r["shardkit warm batched"] / r["baseline: get_object per image"],
        "cold_batched / per-object": r["shardkit cold batched"] / r["baseline: get_object per image"],
    }
    for k, v in ratios.items():
        print(f"{k:32s} {v:8.2f}x")
    dest = Path(__file__).resolve().parent / "results" / "read.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps({"count": args.count, "rows": out, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
