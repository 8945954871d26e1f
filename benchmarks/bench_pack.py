"""Packing throughput next to raw PUT of the same bytes, local and on 1- and 2-node Ray clusters, in one run.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_pack [--images 1500] [--h5-mb 300] [--shard-size 64MB] [--rounds 1]

Data (generated once, cached under ``demo-data/bench-pack/``): an ImageFolder of real-ish
~65 KB JPEGs (:func:`shardkit.dev.sampledata.make_image_folder`), and one HDF5 file with two
float32 datasets of ~``--h5-mb`` MB each (one sample each). For each data set, on one SeaweedFS:

* raw PUT: the same total bytes, as objects of the sizes the pack produced, uploaded with
  s3fs ``pipe`` (one PUT), boto3 ``put_object`` (one PUT) and boto3 multipart with 16 MiB
  parts of ``shardkit.packing.tar_shard.PART_BYTES`` (what the shard writer sends; one PUT below that);
* shardkit pack, local engine (modules imported before timing, as the raw rows' clients are
  made before theirs);
* shardkit pack, Ray engine on a 1-node cluster (``ray start --head``, 1 CPU);
* shardkit pack, Ray engine on a real 2-node cluster (``ray start --head`` + ``ray start
  --address`` on 127.0.0.1, 1 CPU each: ``tests/cluster/raycluster.py``, the tests' cluster).

Not timed: the data, SeaweedFS and both clusters' start (before the first row; both stay up
for the whole run), and for each Ray row the driver's connection to its cluster plus a tiny
pack on it (each connection is a new Ray job, whose workers start and import shardkit: that
is start-up, not packing). Before round 1 each data set is packed once, untimed, with the
local engine: it warms the page cache and SeaweedFS and gives the raw rows their object sizes.

``--rounds R`` runs every row R times, rows alternating (round 2 runs them in reverse order,
round 3 forward again...), and reports the median seconds of each row; ratios are of medians.
Each row also records the CPU seconds spent during it by this process, SeaweedFS, each
cluster, and the whole machine (other users' work included: the machine may be shared).

Rates are MB/s of dataset bytes (shard bytes); ratios: pack against the best raw PUT and the
boto3 multipart row, and the 2-node Ray row against the 1-node one (with the best the plan's
task sizes allow on 2 nodes). Writes ``benchmarks/results/pack.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.bench_cluster_pack import node_env  # the nodes' environment, as the cluster benchmark gives it
from benchmarks.common import REPO_ROOT, Weed, boto3_client, machine_facts, package_versions, write_json
from shardkit.packing.tar_shard import PART_BYTES as PART  # the raw multipart row sends the shard writer's parts

sys.path.insert(0, str(REPO_ROOT / "tests" / "cluster"))
from raycluster import RayCluster  # noqa: E402 - tests/cluster: the cluster the tests start

RAW_ROWS = ("raw PUT, s3fs pipe", "raw PUT, boto3 put_object",
            f"raw PUT, boto3 multipart {PART >> 20} MiB (shard writer parts)")
LOCAL_ROW = "shardkit pack, local engine"
RAY1_ROW = "shardkit pack, Ray engine, 1-node cluster (1 CPU)"
RAY2_ROW = "shardkit pack, Ray engine, 2-node cluster (1 CPU each)"
ROWS = (*RAW_ROWS, LOCAL_ROW, RAY1_ROW, RAY2_ROW)


class HeadOnly(RayCluster):
    """:class:`RayCluster` without its worker node: the 1-node cluster, the same head as the 2-node one's."""

    def _start(self, node: Any, args: list[str], env: dict[str, str], shim: bool = False) -> None:
        if node is not self.worker:
            super()._start(node, args, env, shim)

    def wait_nodes(self, alive: int, timeout: float = 60.0) -> None:
        super().wait_nodes(min(alive, 1), timeout)


def _make_hdf5(path: Path, mb: int) -> Path:
    import h5py
    import numpy as np

    marker = path.with_suffix(f".{mb}.ok")
    if marker.exists() and path.exists():
        return path
    rows = max(1, mb * 10**6 // (1024 * 1024 * 4))
    with h5py.File(path, "w") as f:
        for n, name in enumerate(("a", "b")):
            d = f.create_dataset(name, shape=(rows, 1024, 1024), dtype="float32", chunks=(min(2, rows), 1024, 1024))
            rng = np.random.default_rng(n)
            block = rng.standard_normal((2, 1024, 1024), dtype=np.float32)
            for i in range(0, rows, 2):
                d[i:i + 2] = block[: min(2, rows - i)] + i
    marker.write_text("ok\n")
    return path


def _payloads(src: Path, sizes: list[int]) -> list[bytes]:
    """Source bytes cut into objects of the given sizes (real data, not zeros)."""
    files = sorted(p for p in src.rglob("*") if p.is_file() and not p.name.startswith("."))
    out: list[bytes] = []
    it = iter(files)
    pending = bytearray()
    for size in sizes:
        while len(pending) < size:
            try:
                with open(next(it), "rb") as f:
                    pending += f.read(size - len(pending) + 1)
            except StopIteration:
                pending += bytes(size - len(pending))
        out.append(bytes(pending[:size]))
        del pending[:size]
    return out


def _h5_payloads(path: Path, sizes: list[int]) -> list[bytes]:
    """The HDF5 file's own bytes cut to the shard sizes (zero-padded past its end)."""
    out = []
    with open(path, "rb") as f:
        for size in sizes:
            b = f.read(size)
            out.append(b + bytes(size - len(b)))
    return out


# --------------------------------------------------------------------------- CPU accounting

_TICK = os.sysconf("SC_CLK_TCK")


def _session_cpu(sids: set[int]) -> dict[int, float]:
    """CPU seconds (user + system) so far of every live process in each session of ``sids``."""
    out = dict.fromkeys(sids, 0.0)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            sid = os.getsid(int(entry))
            if sid not in out:
                continue
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[sid] += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
        except (OSError, ValueError, IndexError):
            pass
    return out


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:8]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks) - idle) / _TICK, sum(ticks) / _TICK


class CpuMeter:
    """CPU seconds spent while a row runs, by party: this process, SeaweedFS, each cluster, the machine.

    Processes that exit during a row lose their share (Ray keeps its workers, so little is lost).
    """

    def __init__(self, weed_sid: int, clusters: dict[str, RayCluster]) -> None:
        self.parties = {"seaweedfs": {weed_sid}}
        for name, c in clusters.items():
            self.parties[name] = {n.sid for n in (c.head, c.worker) if n.sid}

    def _now(self) -> dict[str, float]:
        sids = set().union(*self.parties.values())
        per_sid = _session_cpu(sids)
        out = {name: sum(per_sid[s] for s in ss) for name, ss in self.parties.items()}
        t = os.times()
        out["this process"] = t.user + t.system
        out["machine busy"], out["machine total"] = _machine_busy()
        return out

    def measure(self, fn: Callable[[], Any]) -> tuple[float, Any, dict[str, float]]:
        """Run ``fn``; returns (seconds, its result, CPU seconds by party, plus the machine's busy share)."""
        before = self._now()
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        after = self._now()
        cpu = {k: round(after[k] - before[k], 2) for k in before if k != "machine total"}
        cpu["machine busy share"] = round((after["machine busy"] - before["machine busy"])
                                          / max(after["machine total"] - before["machine total"], 1e-9), 2)
        return seconds, out, cpu


# --------------------------------------------------------------------------- rows


class Bench:
    """The rows of one data set, each runnable once per round."""

    def __init__(self, server: Any, bucket: str, clusters: dict[str, RayCluster], meter: CpuMeter,
                 shard_size: str) -> None:
        import s3fs

        self.server, self.bucket, self.clusters, self.meter = server, bucket, clusters, meter
        self.shard_size = shard_size
        self.opts = server.storage_options()
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.opts)
        self.client = boto3_client(server.env())
        self.connected: str | None = None

    def connect(self, name: str, warm_src: Path) -> dict[str, Any]:
        """Join this driver to cluster ``name`` (a new Ray job) and run a tiny pack on it, so its
        workers exist on every node and have imported shardkit. Returns the seconds it took
        (untimed) and the warm-up's tasks per node."""
        import ray

        import shardkit

        if self.connected == name:
            return {"cluster": name, "seconds": 0.0}
        t0 = time.perf_counter()
        if ray.is_initialized():
            ray.shutdown()
        ray.init(address=self.clusters[name].address, log_to_driver=False, logging_level=logging.WARNING)
        self.connected = name
        info = shardkit.pack(str(warm_src), f"s3://{self.bucket}/warm/{name}/{time.monotonic_ns()}",
                             shard_bytes="1MB", engine="ray", storage_options=self.opts, progress=False)
        c = self.clusters[name]
        nodes = {("head" if n == c.head.node_id else "worker"): k for n, k in info["nodes"].items()}
        return {"cluster": name, "seconds": round(time.perf_counter() - t0, 1), "warm_up_tasks": nodes}

    def raw(self, row: str, key: str, payloads: list[bytes]) -> Callable[[], None]:
        fs, client, bucket = self.fs, self.client, self.bucket

        def s3fs_pipe() -> None:
            for i, p in enumerate(payloads):
                fs.pipe_file(f"{bucket}/{key}/{i:06d}", p)

        def boto_put() -> None:
            for i, p in enumerate(payloads):
                client.put_object(Bucket=bucket, Key=f"{key}/{i:06d}", Body=p)

        def boto_multipart() -> None:
            for i, p in enumerate(payloads):
                k = f"{key}/{i:06d}"
                if len(p) <= PART:
                    client.put_object(Bucket=bucket, Key=k, Body=p)
                    continue
                up = client.create_multipart_upload(Bucket=bucket, Key=k)["UploadId"]
                parts = []
                for n, start in enumerate(range(0, len(p), PART), 1):
                    r = client.upload_part(Bucket=bucket, Key=k, UploadId=up, PartNumber=n, Body=p[start:start + PART])
                    parts.append({"PartNumber": n, "ETag": r["ETag"]})
                client.complete_multipart_upload(Bucket=bucket, Key=k, UploadId=up, MultipartUpload={"Parts": parts})

        return dict(zip(RAW_ROWS, (s3fs_pipe, boto_put, boto_multipart)))[row]

    def pack(self, src: Path, dest: str, engine: str, **kw: Any) -> Callable[[], dict[str, Any]]:
        import shardkit

        return lambda: shardkit.pack(str(src), dest, shard_bytes=self.shard_size, engine=engine,
                                     storage_options=self.opts, progress=False, **kw)


def task_split_bound(task_bytes: list[int]) -> float:
    """The best speed-up over one node the plan's tasks allow on 2 nodes with a core each of
    their own, cost proportional to bytes (a task is never split): the total over the larger
    half of the best split (exact up to 20 tasks, largest-first to the less loaded node above)."""
    if not task_bytes:
        return 0.0
    total = sum(task_bytes)
    if len(task_bytes) <= 20:
        sums = {0}
        for b in task_bytes:
            sums |= {x + b for x in sums}
        busiest = min(max(x, total - x) for x in sums)
    else:
        loads = [0, 0]
        for b in sorted(task_bytes, reverse=True):
            loads[loads.index(min(loads))] += b
        busiest = max(loads)
    return round(total / busiest, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1500)
    ap.add_argument("--h5-mb", type=int, default=300)
    ap.add_argument("--shard-size", default="64MB")
    ap.add_argument("--rounds", type=int, default=1, help="run every row R times, alternating; report medians")
    ap.add_argument("--data-dir", default=str(REPO_ROOT / "demo-data" / "bench-pack"))
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "pack.json"))
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: must be >= 1, got {args.rounds}")

    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ[k] = v
    import shardkit
    import shardkit.packing.pack  # noqa: F401 - pyarrow, s3fs... imported outside the timed rows
    from shardkit.dev.sampledata import make_image_folder

    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    images = make_image_folder(data_dir / f"images-{args.images}", args.images)
    h5 = _make_hdf5(data_dir / "two.h5", args.h5_mb)
    warm_src = _make_hdf5(data_dir / "warm.h5", 4)  # 2 samples of 4 MiB: 2 tasks at 1MB shards, one per node
    print(f"data ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    load_start = os.getloadavg()

    rows: list[dict[str, Any]] = []
    starts: dict[str, float] = {}
    connects: list[dict[str, Any]] = []
    data_sets: tuple[tuple[str, Path, dict[str, Any]], ...] = (("images", images, {"labels_from_dirs": True}),
                                                                ("hdf5", h5, {}))
    with Weed() as server:
        clusters: dict[str, RayCluster] = {}
        try:
            env = node_env(server.env())
            for name, kind in (("1 node", HeadOnly), ("2 nodes", RayCluster)):
                c = kind(Path(tempfile.mkdtemp(prefix="skpb", dir="/tmp")), env)  # short: Ray's socket paths
                clusters[name] = c
                t0 = time.perf_counter()
                c.start()
                starts[name] = round(time.perf_counter() - t0, 1)
            print(f"clusters up (not timed): {starts}", file=sys.stderr)
            bench = Bench(server, "bench-pack", clusters, CpuMeter(server.pid, clusters), args.shard_size)
            bench.fs.mkdir("bench-pack")
            sizes: dict[str, list[int]] = {}
            payloads: dict[str, list[bytes]] = {}
            tasks: dict[str, list[int]] = {}
            for data, src, kw in data_sets:  # untimed: warms caches, gives the raw rows their sizes
                dest = f"s3://bench-pack/warm/{data}"
                warm = bench.pack(src, dest, "local", **kw)()
                shards = shardkit.open_dataset(dest, storage_options=bench.opts).shards
                sizes[data] = shards.column("bytes").to_pylist()
                payloads[data] = _payloads(src, sizes[data]) if src.is_dir() else _h5_payloads(src, sizes[data])
                tasks[data] = _task_bytes(shards, warm["tasks"])
            for rnd in range(args.rounds):
                order = ROWS if rnd % 2 == 0 else ROWS[::-1]
                for data, src, kw in data_sets:
                    for row in order:
                        key = f"r{rnd}/{ROWS.index(row)}/{data}"
                        fn: Callable[[], Any]
                        if row in RAW_ROWS:
                            fn = bench.raw(row, key, payloads[data])
                        elif row == LOCAL_ROW:
                            fn = bench.pack(src, f"s3://bench-pack/{key}", "local", **kw)
                        else:
                            name = "1 node" if row == RAY1_ROW else "2 nodes"
                            connects.append(bench.connect(name, warm_src))
                            fn = bench.pack(src, f"s3://bench-pack/{key}", "ray", **kw)
                        seconds, info, cpu = bench.meter.measure(fn)
                        r: dict[str, Any] = {"round": rnd + 1, "data": data, "row": row,
                                             "bytes": sum(sizes[data]), "seconds": round(seconds, 3), "cpu": cpu}
                        if isinstance(info, dict):
                            r["tasks"] = info["tasks"]
                            if "nodes" in info:
                                c = clusters["1 node" if row == RAY1_ROW else "2 nodes"]
                                r["nodes"] = {("head" if n == c.head.node_id else "worker"
                                               if n == c.worker.node_id else n): k for n, k in info["nodes"].items()}
                        rows.append(r)
                        print(f"round {rnd + 1} {data:6s} {row:56s} {seconds:7.2f} s", file=sys.stderr)
        finally:
            import ray

            if ray.is_initialized():
                ray.shutdown()
            for c in clusters.values():
                c.stop()
    load_end = os.getloadavg()
    summary = summarize(rows, tasks)
    payload = {"benchmark": "pack",
               "command": "python -m benchmarks.bench_pack " + " ".join(sys.argv[1:] if argv is None else argv),
               "shard_size": args.shard_size, "images": args.images, "h5_mb_per_sample": args.h5_mb,
               "rounds": args.rounds, "cluster_start_seconds": starts, "connect_and_warm_seconds": connects,
               "task_bytes": tasks, "load_average_start": [round(x, 1) for x in load_start],
               "load_average_end": [round(x, 1) for x in load_end],
               "machine": machine_facts(), "versions": package_versions(["shardkit", "ray", "s3fs", "boto3", "h5py"]),
               "summary": summary, "rows": rows}
    write_json(Path(args.out), payload)
    print_tables(summary, args.rounds)
    warm_s = [c["seconds"] for c in connects if c["seconds"]] or [0.0]
    print(f"(not timed: cluster start {starts} s; connect + warm-up before a Ray row {min(warm_s)}-{max(warm_s)} s; "
          f"load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end; wrote {args.out})")
    return 0


def _task_bytes(shards: Any, tasks: int) -> list[int]:
    """Bytes per planned task of a pack, from its shard table: each task writes one samples
    file (its manifest fragment), so shards sharing one are a task's. [] if that does not
    hold (``tasks`` fragments expected)."""
    per: dict[Any, int] = {}
    for f, b in zip(shards.column("samples_file").to_pylist(), shards.column("bytes").to_pylist()):
        per[f] = per.get(f, 0) + b
    return list(per.values()) if len(per) == tasks else []


def summarize(rows: list[dict[str, Any]], tasks: dict[str, list[int]]) -> list[dict[str, Any]]:
    """One row per (data, row): median seconds over the rounds, MB/s and the ratios of medians."""
    out: list[dict[str, Any]] = []
    for data in dict.fromkeys(r["data"] for r in rows):
        med: dict[str, dict[str, Any]] = {}
        for row in ROWS:
            mine = [r for r in rows if r["data"] == data and r["row"] == row]
            secs = [r["seconds"] for r in mine]
            s = statistics.median(secs)
            nbytes = mine[0]["bytes"]
            cpu = {k: round(statistics.median(r["cpu"][k] for r in mine), 2) for k in mine[0]["cpu"]}
            med[row] = {"data": data, "row": row, "bytes": nbytes, "seconds": round(s, 3), "per_round": secs,
                        "mb_per_s": round(nbytes / s / 1e6, 1), "cpu": cpu}
            if "tasks" in mine[0]:
                med[row]["tasks"] = mine[0]["tasks"]
            if "nodes" in mine[0]:
                med[row]["nodes"] = [r["nodes"] for r in mine]
        best = max(med[r]["mb_per_s"] for r in RAW_ROWS)
        mpu = med[RAW_ROWS[-1]]["mb_per_s"]
        for row in (LOCAL_ROW, RAY1_ROW, RAY2_ROW):
            med[row]["vs_best_raw_put"] = round(med[row]["mb_per_s"] / best, 2)
            med[row]["vs_boto3_multipart"] = round(med[row]["mb_per_s"] / mpu, 2)
        med[RAY2_ROW]["vs_1_node"] = round(med[RAY1_ROW]["seconds"] / med[RAY2_ROW]["seconds"], 2)
        one = {r["round"]: r["seconds"] for r in rows if r["data"] == data and r["row"] == RAY1_ROW}
        med[RAY2_ROW]["vs_1_node_per_round"] = [round(one[r["round"]] / r["seconds"], 2) for r in rows
                                                if r["data"] == data and r["row"] == RAY2_ROW]
        med[RAY2_ROW]["task_split_bound"] = task_split_bound(tasks.get(data, []))
        out.extend(med[row] for row in ROWS)
    return out


def print_tables(summary: list[dict[str, Any]], rounds: int) -> None:
    """The summary as two Markdown tables: speed and ratios, then the seconds of every round and
    the median CPU seconds spent during each row, by party."""
    s = "median s" if rounds > 1 else "s"
    print(f"| data | row | MB | {s} | MB/s | vs best raw PUT | vs boto3 multipart | 2 nodes / 1 node |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in summary:
        name = f"**{r['row']}**" if r["row"].startswith("shardkit") else r["row"]
        bound = f" (task split allows {r['task_split_bound']:.2f}x)" if r.get("task_split_bound") else ""
        two = f"{r['vs_1_node']:.2f}x{bound}" if "vs_1_node" in r else ""
        ratios = [f"{r[k]:.2f}x" if k in r else "" for k in ("vs_best_raw_put", "vs_boto3_multipart")]
        print(f"| {r['data']} | {name} | {r['bytes'] / 1e6:.1f} | {r['seconds']:.2f} | {r['mb_per_s']:.1f} | "
              f"{ratios[0]} | {ratios[1]} | {two} |")
    print()
    print("| data | row | s per round | tasks (head/worker) | machine busy | this run's share | this process | "
          "SeaweedFS | 1-node cluster | 2-node cluster |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in summary:
        c = r["cpu"]
        nodes = ""
        if "nodes" in r:
            split = ", ".join("/".join(str(n.get(k, 0)) for k in ("head", "worker")) for n in r["nodes"])
            nodes = f"{r.get('tasks', '')} ({split})"
        # The share of the machine's CPU this run's own processes used (the rest: other users).
        ours = (sum(c[k] for k in ("this process", "seaweedfs", "1 node", "2 nodes"))
                / ((os.cpu_count() or 1) * r["seconds"]))
        print(f"| {r['data']} | {r['row']} | {' / '.join(f'{x:.2f}' for x in r['per_round'])} | {nodes} | "
              f"{c['machine busy share']:.0%} | {ours:.0%} | {c['this process']:.1f} | {c['seaweedfs']:.1f} | "
              f"{c['1 node']:.1f} | {c['2 nodes']:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
