"""Streaming without a node cache (``cache_dir=None``): what each epoch fetches from S3, how
fast, and how much a reader holds in memory (in-process rows), against the GET ceiling of the same shards and
against whole-shard reads (each reader reading the span of its samples, which for DataLoader
workers taking turns in batches is the whole shard: what shardkit did before segments).

    .venv/bin/python -m benchmarks.bench_nocache [--count 20000] [--pin-server]

The whole-shard arm is the same code with segments.GAP_BYTES and SEGMENT_BYTES set beyond
any shard, so every reader reads each shard it touches as one span; a third arm reads gaps of
at most 256 KiB instead of GAP_BYTES (more, smaller requests). Writes results/nocache.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_pin_server_flag, bench_images, get_ceiling, packed_on_weed, time_loader, touch_count  # noqa: E402


def watch_held(peak: list[int]) -> None:
    """Record in ``peak[0]`` the most bytes a reader in this process held (segments in use and
    read ahead) at any ``ShardSource.get``: what streaming without a cache keeps in memory."""
    from shardkit.read.shard_source import ShardSource

    real = ShardSource.get

    def get(self: Any, *a: Any) -> Any:
        held = real(self, *a)
        ahead = sum(hi - lo for lo, hi in map(self._bounds, self._ahead)) if self.segment_plan else 0
        peak[0] = max(peak[0], ahead + sum(h.end - h.base for h in self._held.values()))
        return held

    ShardSource.get = get  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=20000)
    add_pin_server_flag(ap)
    args = ap.parse_args()

    import numpy as np
    import torch  # noqa: F401 - imported before the clocks

    import shardkit
    from shardkit import StreamingDataLoader, StreamingDataset
    from shardkit.read import segments

    started = time.time()
    folder = bench_images(args.count)
    rows: list[dict[str, Any]] = []
    with packed_on_weed(folder, pin_server=args.pin_server) as (_, client, url):
        ds = shardkit.open_dataset(url)
        objects = [(f"ds/{i.path}", i.bytes) for i in ds.shard_list]
        total = sum(b for _, b in objects)
        needed = sum(int(np.sum(ds.shard_rows(i).size)) for i in range(ds.num_shards))
        bufs = {k: bytearray(b) for k, b in objects}
        seconds, part = get_ceiling(client, "bench", objects, bufs)
        bufs.clear()
        ceiling = total / seconds
        print(f"GET ceiling: {ceiling / 1e6:,.0f} MB/s ({part >> 20} MiB parts), {total / 1e6:,.0f} MB", flush=True)
        rows.append({"name": "GET ceiling", "mb_s": ceiling / 1e6})
        real = (segments.GAP_BYTES, segments.SEGMENT_BYTES)
        arms = {f"segments (gaps <= {real[0] >> 10} KiB read)": real,
                "segments (gaps <= 256 KiB read)": (256 << 10, real[1]),
                "whole shards": (1 << 40, 1 << 40)}
        peak = [0]
        watch_held(peak)
        # Untimed: one epoch, so that imports, S3 clients and manifests are paid before the clocks.
        time_loader(StreamingDataLoader(StreamingDataset(url, cache_dir=None, batch_size=256), num_workers=0))
        for workers in (0, 2):
            for k, shuffle in enumerate((False, True)):
                for arm in (list(arms) if k % 2 == 0 else list(arms)[::-1]):
                    segments.GAP_BYTES, segments.SEGMENT_BYTES = arms[arm]
                    peak[0] = 0
                    sd = StreamingDataset(url, cache_dir=None, batch_size=256, shuffle=shuffle, seed=1)
                    secs, n = time_loader(StreamingDataLoader(sd, num_workers=workers), touch_count)
                    assert n == ds.num_samples, (n, ds.num_samples)
                    fetched = sd.stats()["bytes_fetched"]
                    row = {"name": f"{arm}, {workers} workers, shuffle={shuffle}", "seconds": secs,
                           "mb_s": total / secs / 1e6, "of_ceiling": total / secs / ceiling,
                           "fetched_over_needed": fetched / needed,
                           "held_mib": peak[0] / 2**20 if workers == 0 else None}
                    rows.append(row)
                    print(f"{row['name']:62s} {secs:6.2f} s  {row['mb_s']:7,.0f} MB/s  {row['of_ceiling']:.2f}x ceiling"
                          f"  fetched {row['fetched_over_needed']:.2f}x the samples' bytes"
                          + (f"  held at most {peak[0] / 2**20:,.0f} MiB" if workers == 0 else ""), flush=True)
        segments.GAP_BYTES, segments.SEGMENT_BYTES = real
    dest = Path(__file__).resolve().parent / "results" / "nocache.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps({"count": args.count, "shard_bytes": total, "sample_bytes": needed,
                                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                                "command": "python -m benchmarks.bench_nocache " + " ".join(sys.argv[1:]),
                                "pin_server": args.pin_server, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
