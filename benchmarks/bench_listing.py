"""Listing an ImageFolder of objects in S3 (SeaweedFS): objects/s and driver bytes per object,
one client paging one prefix at a time against the parallel delimiter walk, in one run.

    .venv/bin/python -m benchmarks.bench_listing [--objects 20000] [--classes 100]

Data: ``objects`` empty ``.jpg`` objects in ``classes`` class folders of a throwaway SeaweedFS
(listing reads names and sizes only). Arms: one client paging the whole prefix without a
delimiter (s3fs ``find``, 1,000 keys a call: the baseline), and ``ImageFolderSource.list_items()``
with the walk on 1 thread (one list call at a time) and on the default thread pool. Rates are
timed without tracemalloc; each walk arm is then run again with tracemalloc on: bytes/object =
what the driver still holds once listed (the items, what the planner gets) / objects, and the
peak during the listing. Prints a table; writes results/listing.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Weed  # noqa: E402


def upload(fs: Any, bucket: str, objects: int, classes: int) -> float:
    """Put the objects (batched, concurrent); the seconds it took."""
    t0 = time.perf_counter()
    batch: dict[str, bytes] = {}
    for i in range(objects):
        batch[f"{bucket}/train/class{i % classes:04d}/img{i:08d}.jpg"] = b""
        if len(batch) == 2000:
            fs.pipe(batch)
            batch = {}
    if batch:
        fs.pipe(batch)
    return time.perf_counter() - t0


def measure(url: str, so: dict[str, Any], threads: int) -> dict[str, float]:
    """List the ImageFolder once with the walk on ``threads`` threads."""
    from shardkit.packing.sources import listing
    from shardkit.packing.sources.imagefolder import ImageFolderSource

    default = listing.LIST_THREADS
    listing.LIST_THREADS = threads
    try:
        src = ImageFolderSource(url, so)
        src.classes()
        t0 = time.perf_counter()
        n = len(src.list_items())
        rate_s = time.perf_counter() - t0
        src = ImageFolderSource(url, so)
        src.classes()
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        items = src.list_items()
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        listing.LIST_THREADS = default
    assert len(items) == n
    return {"arm": f"walk, {threads} list thread(s)", "objects": n, "seconds": round(rate_s, 3),
            "objects_per_s": round(n / rate_s),
            "held_bytes_per_object": round((held - base) / n, 1), "peak_bytes_per_object": round((peak - base) / n, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=20_000)
    ap.add_argument("--classes", type=int, default=100)
    args = ap.parse_args()
    from shardkit.packing.sources import listing

    with Weed() as server:
        os.environ.update(server.env())
        so = server.storage_options()
        fs = server.filesystem()
        fs.mkdir("bench")
        put_s = upload(fs, "bench", args.objects, args.classes)
        url = "s3://bench/train"
        measure(url, so, listing.LIST_THREADS)  # warm: imports, clients, the server's caches
        fs.invalidate_cache()
        t0 = time.perf_counter()
        flat = len(fs.find("bench/train"))
        flat_s = time.perf_counter() - t0
        fs.invalidate_cache()
        rows: list[dict[str, Any]] = [{"arm": "one client, find (no delimiter)", "objects": flat,
                                       "seconds": round(flat_s, 3), "objects_per_s": round(flat / flat_s),
                                       "held_bytes_per_object": "", "peak_bytes_per_object": ""}]
        rows += [measure(url, so, 1), measure(url, so, listing.LIST_THREADS)]
    print(f"{args.objects} objects in {args.classes} class folders (upload {put_s:.1f} s)")
    print("| arm | objects | s | objects/s | held bytes/object | peak bytes/object |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['arm']} | {r['objects']} | {r['seconds']} | {r['objects_per_s']:,} | "
              f"{r['held_bytes_per_object']} | {r['peak_bytes_per_object']} |")
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "listing.json").write_text(json.dumps({"objects": args.objects, "classes": args.classes,
                                                  "upload_s": put_s, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
