"""Count the Python calls of warm main-process epochs: a measure of per-batch work that machine
load does not change (timings on a shared 2-core machine do).

    python -m benchmarks.profile_calls [--mode zero-copy|threads] [--samples 6000] [--epochs 3]

Packs an iterable of random 64 KB samples into a local dataset (once, under --work), fills a
node cache with one epoch, then profiles ``--epochs`` warm epochs of
``StreamingDataLoader(num_workers=0)`` with batch 256 and prints the call count, the time and the
functions that took longest. Run it in two checkouts (``PYTHONPATH=<checkout>``) to compare them.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import time
from typing import Any, Iterator

import numpy as np

import shardkit


def samples(n: int) -> Iterator[dict[str, Any]]:
    """Random samples: 64 KB of bytes and a class label each."""
    rng = np.random.default_rng(0)
    for i in range(n):
        yield {"__key__": f"{i:06d}", "bin": rng.bytes(64 * 1024), "cls": str(i % 10).encode()}


def main(argv: list[str] | None = None) -> int:
    """Run the profile; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_calls", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("zero-copy", "threads"), default="zero-copy")
    p.add_argument("--samples", type=int, default=6000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--work", default="/tmp/shardkit-profile-calls")
    args = p.parse_args(argv)
    url = os.path.join(args.work, f"ds-{args.samples}")
    if not os.path.exists(os.path.join(url, "dataset.json")):
        shardkit.pack(samples(args.samples), url, shard_bytes="64MB", progress=False)
    cache = os.path.join(args.work, f"cache-{args.mode}")
    shutil.rmtree(cache, ignore_errors=True)
    ds = shardkit.StreamingDataset(url, cache_dir=cache, cache_limit="10GB", shuffle=False, batch_size=256,
                                   zero_copy=args.mode == "zero-copy")
    loader = shardkit.StreamingDataLoader(ds, num_workers=0)
    for _ in loader:  # the cold epoch fills the cache
        pass
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(args.epochs):
        for _ in loader:
            pass
    prof.disable()
    stats = pstats.Stats(prof)
    print(f"shardkit from {os.path.dirname(shardkit.__file__)}, {args.mode}: {stats.total_calls} calls, "
          f"{time.perf_counter() - start:.3f} s for {args.epochs} warm epochs")
    stats.sort_stats("tottime").print_stats(8)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
