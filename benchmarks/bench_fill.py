"""How fast S3 GETs fill new files while earlier files stay in the page cache, and after.

    .venv/bin/python -m benchmarks.bench_fill [--count 20000] [--runs 4]

Packs ``count`` sample JPEGs into a throwaway SeaweedFS, then fills the shard bytes into new
files on the local disk ``runs`` times keeping every run's files, and ``runs`` times deleting
each run's files after it. 8 ranged-GET threads, 8 MiB parts read into maps of the new files
(as the node cache fills them); ``os.sync()`` before each run. First, the rate at which this
machine hands out memory never touched before (1 GiB of fresh anonymous memory, one byte written
per 4 KiB page) against memory already touched. Prints MB/s per run: machine facts the streaming
benchmark's cold rows depend on (benchmarks/RESULTS.md, "Machine notes").
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (Weed, bench_images, boto3_client, new_file_maps, part_jobs,  # noqa: E402
                               ranged_get_into, settle_disk)

PART = 8 << 20
GIB = 1 << 30


def first_touch_gb_per_s(again: bool = False) -> float:
    """GB/s of writing one byte per page into 1 GiB of fresh anonymous memory (``again``: the
    second pass over the same memory, whose pages are already there)."""
    import numpy as np

    with mmap.mmap(-1, GIB) as m:
        pages = np.frombuffer(m, np.uint8)[::mmap.PAGESIZE]
        if again:
            pages[:] = 1
        t0 = time.perf_counter()
        pages[:] = 2
        seconds = time.perf_counter() - t0
        del pages
    return GIB / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    import shardkit

    folder = bench_images(args.count)
    fresh = [first_touch_gb_per_s() for _ in range(3)]
    print("first touch of new memory: " + ", ".join(f"{r:.1f}" for r in fresh)
          + f" GB/s; the same pages again: {first_touch_gb_per_s(again=True):.0f} GB/s")
    work = Path(tempfile.mkdtemp(prefix="shardkit-bench-fill-"))
    try:
        with Weed() as server:
            os.environ.update(server.env())
            client = boto3_client(server.env())
            client.create_bucket(Bucket="bench")
            shardkit.pack(str(folder), "s3://bench/ds", shard_bytes="64MB", progress=False)
            shards = [(i.path, i.bytes) for i in shardkit.open_dataset("s3://bench/ds").shard_list]
            total = sum(b for _, b in shards)

            objects = [(f"ds/{p}", b) for p, b in shards]
            jobs = part_jobs(objects, PART)

            def fill(into: Path) -> float:
                maps = new_file_maps(into, objects)
                settle_disk()
                t0 = time.perf_counter()
                ranged_get_into(client, "bench", jobs, maps)
                seconds = time.perf_counter() - t0
                for m in maps.values():
                    m.close()
                return total / seconds / 1e6

            for keep in (True, False):
                rates = []
                for k in range(args.runs):
                    into = work / f"{'keep' if keep else 'delete'}-{k}"
                    rates.append(fill(into))
                    if not keep:
                        shutil.rmtree(into)
                label = "earlier runs' files kept" if keep else "each run's files deleted after it"
                print(f"{total / 1e6:.0f} MB into new files, {label}: " + ", ".join(f"{r:.0f}" for r in rates) + " MB/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
