"""Listing an ImageFolder of objects in S3 (SeaweedFS) and planning its pack: objects/s, time to
the first planned task, and the driver's memory per object, in one run.

    .venv/bin/python -m benchmarks.bench_listing [--objects 200000] [--classes 200] [--data-dir DIR]

Data: ``objects`` empty ``.jpg`` objects in ``classes`` class folders of a throwaway SeaweedFS
(listing reads names and sizes only), put by many threads at once. ``--data-dir`` keeps the
server's data there (not under benchmarks/) and reuses it on a later run with the same counts.

Arms, each in a fresh process (so its memory is its own) after one warm-up listing:

- ``find``: one client paging the whole prefix without a delimiter (s3fs ``find``, 1,000 keys
  a call): the baseline.
- ``walk-1`` / ``walk-16``: ``ImageFolderSource.list_items()``, the delimiter walk on 1 and on
  16 list threads: the whole listing held, as a plan made from it needs.
- ``stream-16``: what ``shardkit.pack`` does with such a source: ``iter_items()`` through a
  :class:`~shardkit.packing.plan_stream.TaskStream` (keys checked, tasks planned as the listing
  arrives, each task dropped once handed out, as an engine does once it submitted it). Shards of
  ``--shard-bytes`` (default 7 MB: as many of these objects' 1.5 KB of tar framing as 512 MB
  holds 110 KB images), the default task size. Reports when the first task was planned.

Each arm runs twice: timed without tracemalloc (seconds, objects/s, the process's peak RSS over
its RSS before the listing, per object), then with tracemalloc (Python heap held at the end and
at the peak, per object; tracemalloc slows the listing many times over). Prints a table; writes
results/listing.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Weed, boto3_client  # noqa: E402

ARMS = ("find", "walk-1", "walk-16", "stream-16")


def upload(env: dict[str, str], bucket: str, objects: int, classes: int, threads: int = 48) -> float:
    """Put the empty objects from ``threads`` threads; the seconds it took."""
    client = boto3_client(env, max_pool=threads)

    def put(start: int) -> None:
        for i in range(start, min(start + 500, objects)):
            client.put_object(Bucket=bucket, Key=f"train/class{i % classes:04d}/img{i:08d}.jpg", Body=b"")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, range(0, objects, 500)))
    return time.perf_counter() - t0


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _storage_options() -> dict[str, Any]:
    return {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "region_name": "us-east-1"}}


def child(arm: str, url: str, traced: bool, shard_bytes: int) -> dict[str, Any]:
    """One arm in this (fresh) process."""
    from shardkit.config import DEFAULT_TASK_BYTES
    from shardkit.packing.plan import Planner
    from shardkit.packing.plan_stream import TaskStream
    from shardkit.packing.sources import listing
    from shardkit.packing.sources.imagefolder import ImageFolderSource

    so = _storage_options()
    if arm == "find":
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **so)
        fs.ls(url[5:].split("/")[0])  # connect
        run = lambda: (len(fs.find(url[5:])), None)  # noqa: E731
    else:
        listing.LIST_THREADS = int(arm.rsplit("-", 1)[1])
        src = ImageFolderSource(url, so)
        src.classes()  # the class folders: listed before the clock starts, as pack does

        def run() -> tuple[int, float | None]:
            if arm.startswith("walk"):
                held.append(src.list_items())
                return len(held[-1]), None
            planner = Planner(shard_bytes=shard_bytes, shard_samples=None, task_bytes=DEFAULT_TASK_BYTES,
                              options={"on_error": "raise", "transform": {}, "source": src.describe()})
            first = None
            with TaskStream(src.iter_items(), planner) as stream:
                for _ in stream:  # each task dropped as it comes: an engine submitted it
                    if first is None:
                        first = time.perf_counter() - t0
            tasks.append(planner.num_tasks)
            return planner.num_items, first

    held: list[Any] = []
    tasks: list[int] = []
    gc.collect()
    base_rss = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    if traced:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    n, first = run()
    seconds = time.perf_counter() - t0
    out: dict[str, Any] = {"arm": arm, "objects": n, "seconds": round(seconds, 3)}
    if traced:
        now, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out.update(heap_held_per_object=round((now - base) / n, 1), heap_peak_per_object=round((peak - base) / n, 1))
    else:
        out.update(objects_per_s=round(n / seconds), rss_peak_per_object=round((_status("VmHWM") - base_rss) / n, 1),
                   first_task_s=None if first is None else round(first, 3), tasks=tasks[0] if tasks else None)
    return out


def run_child(arm: str, url: str, traced: bool, shard_bytes: int, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_listing", "--child", arm, "--url", url,
           "--shard-bytes", str(shard_bytes), *(["--traced"] if traced else [])]
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=3600,
                          cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        raise SystemExit(f"arm {arm} failed: {done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=200_000)
    ap.add_argument("--classes", type=int, default=200)
    ap.add_argument("--shard-bytes", type=int, default=7 * 10**6)
    ap.add_argument("--data-dir", help="keep the server's data here and reuse it (default: throwaway)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.url, args.traced, args.shard_bytes)))
        return

    weed = Weed()
    if args.data_dir:
        Path(args.data_dir).mkdir(parents=True, exist_ok=True)
        weed.data_dir = Path(args.data_dir).resolve()
    marker = Path(args.data_dir, f"objects-{args.objects}-{args.classes}") if args.data_dir else None
    with weed as server:
        env = server.env()
        client = boto3_client(env)
        put_s = None
        if marker is None or not marker.exists():
            client.create_bucket(Bucket="bench")
            put_s = upload(env, "bench", args.objects, args.classes)
            if marker is not None:
                marker.touch()
        url = "s3://bench/train"
        run_child("walk-16", url, False, args.shard_bytes, env)  # warm: the server's caches
        rows = []
        for arm in args.arms.split(","):
            row = run_child(arm, url, False, args.shard_bytes, env)
            if arm != "find":
                row.update({k: v for k, v in run_child(arm, url, True, args.shard_bytes, env).items()
                            if k.startswith("heap_")})
            rows.append(row)
            print(json.dumps(row), flush=True)
    load = os.getloadavg()
    print(f"{args.objects} objects in {args.classes} class folders (upload {put_s if put_s is None else round(put_s, 1)} s, "
          f"load average {load[0]:.1f} at the end)")
    print("| arm | objects | s | objects/s | first task s | peak RSS B/object | heap held B/object | "
          "heap peak B/object |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['arm']} | {r['objects']:,} | {r['seconds']} | {r['objects_per_s']:,} | "
              f"{r.get('first_task_s') or ''} | {r['rss_peak_per_object']} | {r.get('heap_held_per_object', '')} | "
              f"{r.get('heap_peak_per_object', '')} |")
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "listing.json").write_text(json.dumps({"objects": args.objects, "classes": args.classes,
                                                  "shard_bytes": args.shard_bytes, "upload_s": put_s,
                                                  "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
