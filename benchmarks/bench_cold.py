"""Where a cold epoch's time goes: wall seconds and CPU seconds (this process and the S3
server) of the GET ceiling, of the same GETs plus the least a verified caching batch loader
adds (hash, cache write, batch copy, the consumer's read: a floor for any such loader), of the
same GETs into new files, and of shardkit cold epochs with and without landing fills,
interleaved over a few rounds in one run.

    .venv/bin/python -m benchmarks.bench_cold [--count 20000] [--rounds 3] [--pin-server]

On the 2-core benchmark box the GET ceiling keeps both cores busy, so a cold epoch can only
come near it by spending no more CPU than the GETs themselves. ``--pin-server`` gives SeaweedFS
one CPU and the loader the other (common.pin_server_apart), as if the store were remote.
Writes results/cold.json (cold_pinned.json with ``--pin-server``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (CEILING_PARTS, add_pin_server_flag, bench_images, drop_cache,  # noqa: E402
                               floor_buffers, get_and_finish, new_file_maps, packed_on_weed, part_jobs,
                               ranged_get_into, settle_disk, time_loader, touch_count)

_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def measured(fn: Callable[[], Any], server_pid: int) -> dict[str, float]:
    c0, s0, t0 = own_cpu(), process_cpu(server_pid), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    client, server = own_cpu() - c0, process_cpu(server_pid) - s0
    return {"wall_s": wall, "client_cpu_s": client, "server_cpu_s": server, "cores_busy": (client + server) / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    add_pin_server_flag(ap)
    args = ap.parse_args()

    import torch  # noqa: F401 - imported before the clocks (the first loader would import it)

    import shardkit
    from shardkit import StreamingDataLoader, StreamingDataset

    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="shardkit-bench-cold-"))
    folder = bench_images(args.count)
    rows: dict[str, list[dict[str, float]]] = {}

    def rec(name: str, m: dict[str, float]) -> None:
        rows.setdefault(name, []).append(m)
        print(f"{name:44s} {m['wall_s']:6.2f} s   client CPU {m['client_cpu_s']:5.2f} s   server CPU "
              f"{m['server_cpu_s']:5.2f} s   {m['cores_busy']:.2f} cores busy", flush=True)

    with packed_on_weed(folder, pin_server=args.pin_server) as (server, client, url):
        ds = shardkit.open_dataset(url)
        objects = [(f"ds/{i.path}", i.bytes) for i in ds.shard_list]
        total = sum(b for _, b in objects)

        def cold(landing: bool, cache: Path) -> None:
            os.environ["SHARDKIT_LANDING_BYTES"] = "512MiB" if landing else "0"
            sd = StreamingDataset(url, cache_dir=cache, batch_size=256, shuffle=False)
            settle_disk()
            rec(f"shardkit cold, 2 read threads, {'landing fill' if landing else 'map fill'}",
                measured(lambda: time_loader(StreamingDataLoader(sd, num_workers=0), touch_count), server.pid))
            drop_cache(cache)

        # Untimed: one cold epoch through maps, so that imports, S3 clients and manifest reads
        # are paid before the first row (the first landing row still pays its buffers' first touch).
        os.environ["SHARDKIT_LANDING_BYTES"] = "0"
        time_loader(StreamingDataLoader(StreamingDataset(url, cache_dir=work / "warm-up", batch_size=256,
                                                         shuffle=False), num_workers=0), touch_count)
        drop_cache(work / "warm-up")
        for r in range(args.rounds):
            bufs = {k: bytearray(b) for k, b in objects}  # allocated before the clock, as in bench_read
            for part in CEILING_PARTS:  # the round's ceiling: the fastest of these (common.get_ceiling)
                jobs = part_jobs(objects, part)
                rec(f"GET x8 into memory, {part >> 20} MiB parts", measured(
                    lambda: ranged_get_into(client, "bench", jobs, bufs), server.pid))
            bufs.clear()
            # The floor: the same GETs plus what any verified caching batch loader must add
            # (common.get_and_finish), into page-aligned buffers touched before the clock.
            aligned = floor_buffers(objects)
            settle_disk()
            rec("GET x8 + xxh3 + O_DIRECT write + batch copy + consumer read, 16 MiB parts",
                measured(lambda: get_and_finish(client, "bench", objects, aligned, work / f"floor-{r}", 16 << 20),
                         server.pid))
            aligned.clear()
            shutil.rmtree(work / f"floor-{r}")
            into = work / f"files-{r}"
            maps = new_file_maps(into, objects)
            settle_disk()
            rec("GET x8 into new files, through maps, 16 MiB parts", measured(
                lambda: ranged_get_into(client, "bench", part_jobs(objects, 16 << 20), maps), server.pid))
            for m in maps.values():
                m.close()
            shutil.rmtree(into)
            for landing in ((True, False) if r % 2 == 0 else (False, True)):
                cold(landing, work / f"cache-{r}-{landing}")
    shutil.rmtree(work, ignore_errors=True)
    dest = Path(__file__).resolve().parent / "results" / ("cold_pinned.json" if args.pin_server else "cold.json")
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps({"count": args.count, "shard_bytes": total,
                                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                                "command": "python -m benchmarks.bench_cold " + " ".join(sys.argv[1:]),
                                "pin_server": args.pin_server,
                                "load_avg_end": os.getloadavg(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
