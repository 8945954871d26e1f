"""First batch of a cold epoch: seconds from ``iter(loader)`` to the first batch, at several
shard sizes, against a bare ranged GET of that batch's bytes measured in the same run.

    .venv/bin/python -m benchmarks.bench_first_batch [--images 12000] [--shard-mb 64,256,512] [--rounds 3]

One throwaway SeaweedFS; the same ~100 KB JPEGs (``make_image_folder``, 672 px, quality 90)
packed once per shard size. For each shard size and loader, each round starts with an empty
node cache (a new directory) and a new loader, made before the clock; the clock covers
``next(iter(loader))``: DataLoader worker start-up, manifest rows, the download and the batch.
The loaders (batch 256, no shuffle, ``cache_limit`` 50 GB):

* ``StreamingDataLoader`` with 2 workers, raw batches built in the workers (ring handoff);
* a plain ``DataLoader`` with 2 workers over per-sample dicts (``collate_fn=shardkit.collate``);
* ``StreamingDataLoader(num_workers=0)``, raw batches filled by the 2 read threads;
* the same with ``zero_copy=True``: batches of views into the (landing) cache file.

Baselines in the same rounds, with a boto3 client made before the clock: one ranged GET of the
byte span holding the first batch's samples (from its first sample's first byte to its last
sample's last; the per-sample loader's first batch is every other sample of twice the span,
DataLoader workers taking turns), the same span as two parallel GETs, and the whole first shard
in 16 MiB parts, 8 at a time (what a reader that waits for its whole shard waits for). And two
floors: the start-up of a DataLoader with 2 workers (the first, tiny batch of a dataset that
yields at once), and the same loader's first batch from a warm cache (the shard already cached:
no download at all), so that "cold - warm" is what the cold path itself costs.
Writes results/first_batch.json; medians go to benchmarks/RESULTS.md by hand, with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Weed, boto3_client, get_range_into, part_jobs, ranged_get_into  # noqa: E402

BATCH = 256
LOADERS = ("workers2", "per-sample", "main", "zero-copy")
LABELS = {"workers2": "StreamingDataLoader, 2 workers (raw batches)",
          "per-sample": "plain DataLoader, 2 workers, per-sample dicts",
          "main": "StreamingDataLoader, num_workers=0, 2 read threads",
          "zero-copy": "StreamingDataLoader, num_workers=0, zero_copy=True"}


def images(count: int) -> Path:
    """~100 KB JPEGs, made once in the temp dir and kept for later runs."""
    from shardkit.dev.sampledata import make_image_folder

    return make_image_folder(Path(tempfile.gettempdir()) / f"shardkit-bench-images-{count}-672", count, side=672)


def startup_floor() -> float:
    """Seconds to the first batch of a 2-worker DataLoader over an iterable dataset that yields a
    tiny batch at once: DataLoader start-up alone."""
    from torch.utils.data import DataLoader, IterableDataset

    class Instant(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            yield {"__index__": [0]}

    took, _ = first_batch(DataLoader(Instant(), batch_size=None, num_workers=2))
    return took


def make_loader(kind: str, url: str, cache: Path) -> Any:
    import shardkit
    from torch.utils.data import DataLoader

    from shardkit.batch.collate import collate

    if kind == "per-sample":
        ds = shardkit.StreamingDataset(url, cache_dir=cache, cache_limit="50GB", shuffle=False)
        return DataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=collate, persistent_workers=False)
    ds = shardkit.StreamingDataset(url, cache_dir=cache, cache_limit="50GB", shuffle=False, batch_size=BATCH,
                                   zero_copy=kind == "zero-copy")
    return shardkit.StreamingDataLoader(ds, num_workers=2 if kind == "workers2" else 0, persistent_workers=False)


def first_batch(loader: Any) -> tuple[float, list[int]]:
    """Seconds to the first batch, and its samples' global indices. After the clock the
    iterator is closed and its workers waited for (downloads in flight end with them), so a
    round never shares the link with the one before."""
    import multiprocessing

    t0 = time.perf_counter()
    it = iter(loader)
    batch = next(it)
    took = time.perf_counter() - t0
    index = [int(i) for i in batch["__index__"]]
    del batch
    close = getattr(it, "close", None) or getattr(it, "_shutdown_workers", None)
    if close is not None:
        close()
    del it
    for child in multiprocessing.active_children():
        child.join()
    return took, index


def span_of(ds: Any, index: list[int]) -> tuple[str, int, int]:
    """(shard path, first byte, end) of the samples ``index`` (all in the first shard)."""
    import numpy as np

    shard = int(np.searchsorted(ds.first_samples, max(index), side="right")) - 1
    assert shard == 0, f"first batch reaches shard {shard}"
    rows = ds.cached_rows(0)
    pos = np.asarray(index) - int(ds.first_samples[0])
    lo = int(rows.offset[pos].min())
    hi = int((rows.offset[pos] + rows.size[pos]).max())
    return ds.shard_list[0].path, lo, hi


def bare_get(client: Any, key: str, lo: int, hi: int, parts: int) -> float:
    """Seconds for ``parts`` parallel ranged GETs covering bytes [lo, hi) into a buffer made before the clock."""
    buf = {key: bytearray(hi)}
    step = -(-(hi - lo) // parts)
    jobs = [(key, a, min(hi, a + step)) for a in range(lo, hi, step)]
    t0 = time.perf_counter()
    if parts == 1:
        get_range_into(client, "bench", jobs[0], buf)
    else:
        with ThreadPoolExecutor(parts) as pool:
            list(pool.map(lambda j: get_range_into(client, "bench", j, buf), jobs))
    return time.perf_counter() - t0


def whole_shard_get(client: Any, key: str, size: int) -> float:
    buf = {key: bytearray(size)}
    t0 = time.perf_counter()
    ranged_get_into(client, "bench", part_jobs([(key, size)], 16 << 20), buf)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=12000)
    ap.add_argument("--shard-mb", default="64,256,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loaders", default=",".join(LOADERS))
    args = ap.parse_args()
    sizes = [int(s) for s in args.shard_mb.split(",")]
    kinds = [k for k in args.loaders.split(",") if k]

    import torch  # noqa: F401 - imported before any clock

    import shardkit

    started = time.time()
    folder = images(args.images)
    work = Path(tempfile.mkdtemp(prefix="shardkit-bench-first-"))
    out: dict[str, Any] = {"command": "python -m benchmarks.bench_first_batch " + " ".join(sys.argv[1:]),
                           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                           "images": args.images, "load_avg_start": os.getloadavg(), "cells": []}
    try:
        with Weed() as server:
            os.environ.update(server.env())
            client = boto3_client(server.env())
            client.create_bucket(Bucket="bench")
            for mb in sizes:
                url = f"s3://bench/ds{mb}"
                shardkit.pack(str(folder), url, shard_bytes=f"{mb}MB", progress=False)
                ds = shardkit.open_dataset(url)
                first = ds.shard_list[0]
                print(f"-- {mb} MB shards: {len(ds.shard_list)} shards, first {first.bytes / 1e6:.0f} MB, "
                      f"{first.num_samples} samples", flush=True)
                # Untimed warm-up: imports, clients and code paths of every loader kind.
                for kind in kinds:
                    first_batch(make_loader(kind, url, work / f"untimed-{mb}-{kind}"))
                    shutil.rmtree(work / f"untimed-{mb}-{kind}", ignore_errors=True)
                for kind in kinds:
                    cell: dict[str, Any] = {"shard_mb": mb, "loader": kind, "label": LABELS[kind],
                                            "first_shard_bytes": first.bytes, "rounds": []}
                    for r in range(args.rounds):
                        cache = work / f"c-{mb}-{kind}-{r}"
                        loader = make_loader(kind, url, cache)
                        os.sync()
                        took, index = first_batch(loader)
                        del loader
                        key, lo, hi = span_of(ds, index)
                        one = bare_get(client, f"ds{mb}/{key}", lo, hi, 1)
                        two = bare_get(client, f"ds{mb}/{key}", lo, hi, 2)
                        whole = whole_shard_get(client, f"ds{mb}/{key}", first.bytes)
                        floor = startup_floor() if kind not in ("main", "zero-copy") else 0.0
                        rnd = {"first_batch_s": took, "span_bytes": hi - lo, "bare_get_s": one,
                               "bare_get_x2_s": two, "whole_shard_get_s": whole, "worker_startup_s": floor}
                        cell["rounds"].append(rnd)
                        print(f"{mb:4d} MB {kind:11s} round {r}: first batch {took:6.3f} s   bare GET of its "
                              f"{(hi - lo) / 1e6:5.1f} MB {one:6.3f} s (x2 {two:6.3f} s)   whole shard {whole:6.3f} s"
                              f"   2-worker start-up {floor:6.3f} s", flush=True)
                        shutil.rmtree(cache, ignore_errors=True)
                    out["cells"].append(cell)
                # Warm: one epoch fills a cache (untimed), then each loader's first batch from it.
                warm = work / f"warm-cache-{mb}"
                for _ in make_loader("main", url, warm):
                    pass
                for cell in out["cells"][-len(kinds):]:
                    cell["warm_first_batch_s"] = [first_batch(make_loader(cell["loader"], url, warm))[0]
                                                  for _ in range(args.rounds)]
                    print(f"{mb:4d} MB {cell['loader']:11s} warm first batch (cached shard): "
                          f"{', '.join(f'{x:.3f}' for x in cell['warm_first_batch_s'])} s", flush=True)
                    med: Callable[[str], float] = lambda k: statistics.median(x[k] for x in cell["rounds"])  # noqa: E731
                    cell["median"] = {k: med(k) for k in ("first_batch_s", "bare_get_s", "bare_get_x2_s",
                                                          "whole_shard_get_s", "worker_startup_s")}
                    cell["median"]["warm_first_batch_s"] = statistics.median(cell["warm_first_batch_s"])
                    cell["median"]["ratio_to_bare_get"] = cell["median"]["first_batch_s"] / cell["median"]["bare_get_s"]
                shutil.rmtree(warm, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load_avg_end"] = os.getloadavg()
    print("\nshard MB  loader                                          first batch   bare GET  ratio   whole-shard GET"
          "   2-worker start-up   warm first batch")
    for c in out["cells"]:
        m = c["median"]
        print(f"{c['shard_mb']:8d}  {c['label']:46s}  {m['first_batch_s']:9.3f} s  {m['bare_get_s']:7.3f} s  "
              f"{m['ratio_to_bare_get']:5.2f}x  {m['whole_shard_get_s']:7.3f} s  {m['worker_startup_s']:7.3f} s  "
              f"{m['warm_first_batch_s']:7.3f} s")
    dest = Path(__file__).resolve().parent / "results" / "first_batch.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
