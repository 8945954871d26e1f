"""Per-sample reading, decoded batches and streaming without a cache, against the peers and
against the decoder's own bound, optionally before and after a change, in one run.

    .venv/bin/python -m benchmarks.bench_persample [--images 20000] [--side 672] [--shard-size 256MB]
        [--rounds 2] [--before TREE] [--no-peers]

The issue 22 setup: ~100 KB JPEGs (``shardkit.dev.sampledata``, 672 px, quality 90) packed
into 256 MB shards on a throwaway SeaweedFS; 2 DataLoader workers, batch 256. Each row runs in
a fresh process:

- shardkit: per-sample dicts through a plain ``torch.utils.data.DataLoader`` (2 workers,
  batch 256, ``collate_fn=shardkit.batch.collate.collate``): cold (the first epoch into an
  empty cache), warm (the best of 3 epochs), decoded (``CenterCrop(224)``, warm cache) and
  without a cache; decoded batches through ``StreamingDataLoader`` (2 workers; and
  ``num_workers=0``, with ``decode_threads=2`` where the tree has it), warm cache.
- the decoder's bound: ``CenterCrop(224)`` alone over every sample's bytes (read into
  memory first), in 2 forked processes (the cores the loaders use) and in 1.
- peers: ``benchmarks/peers/{wds,mds,litdata}_peer.py`` in ``benchmarks/.peers-venv`` (each
  packs the same images at the same shard size; decoded = the same ``CenterCrop(224)``).

With ``--before TREE`` (a directory holding another ``shardkit`` package, e.g. ``git archive
main shardkit | tar -x -C /tmp/before``) every shardkit row also runs on that code, the two
alternating, ``--rounds`` times; the peers and the bound run once. Writes
results/persample.json and prints a table (medians over rounds, every round listed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BATCH, WORKERS, WARM_EPOCHS = 256, 2, 3
ROWS = {  # kind -> (row names, group); each kind is one child process
    "persample-cache": (["per-sample dicts, plain DataLoader, cold", "per-sample dicts, plain DataLoader, warm"],
                        ["cold", "warm"]),
    "persample-nocache": (["per-sample dicts, plain DataLoader, no cache"], ["cold"]),
    "persample-decoded": (["per-sample dicts, plain DataLoader, decoded"], ["decoded"]),
    "sdl-decoded": (["StreamingDataLoader decoded batches, 2 workers"], ["decoded"]),
    "sdl-decoded-main": (["StreamingDataLoader decoded batches, num_workers=0, decode_threads=2"], ["decoded"]),
}


def cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children (DataLoader workers)."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


# --------------------------------------------------------------------------- child rows


def epoch(make: Any) -> tuple[float, int, float]:
    """One epoch of a new loader: (seconds, samples, CPU seconds with its workers)."""
    from benchmarks.common import settle_disk, touch_count

    settle_disk()
    loader = make()
    c0, t0, n = cpu_seconds(), time.perf_counter(), 0
    for batch in loader:
        n += touch_count(batch)
    seconds = time.perf_counter() - t0
    del loader  # its workers are reaped: their CPU counts
    return seconds, n, cpu_seconds() - c0


def child(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of one kind, measured in this process (shardkit imported from spec["tree"])."""
    import torch  # noqa: F401 - imported before any clock
    from torch.utils.data import DataLoader

    import shardkit
    from shardkit.batch.collate import collate

    kind, url, cache, n = spec["kind"], spec["url"], spec["cache"], spec["num_images"]
    crop = shardkit.CenterCrop(224)

    def stream(cache_dir: str | None, **kw: Any) -> Any:
        return shardkit.StreamingDataset(url, cache_dir=cache_dir, cache_limit="50GB", **kw)

    def plain(ds: Any) -> Any:
        return lambda: DataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=collate)

    out: list[dict[str, Any]] = []

    def add(name: str, group: str, runs: list[tuple[float, int, float]]) -> None:
        good = [r for r in runs if r[1] == n]
        if not good:
            out.append({"name": name, "group": group, "status": "failed",
                        "reason": f"epoch gave {runs[0][1]} samples, expected {n}"})
            return
        seconds, _, cpu = min(good)
        out.append({"name": name, "group": group, "status": "ok", "seconds": round(seconds, 3),
                    "samples_per_s": round(n / seconds, 1), "cpu_seconds": round(cpu, 2),
                    "epoch_seconds": [round(r[0], 3) for r in runs]})

    if kind == "decode-bound":
        return decode_bound(url, cache, crop)
    names, groups = ROWS[kind]
    if kind == "persample-cache":
        shutil.rmtree(cache, ignore_errors=True)
        add(names[0], groups[0], [epoch(plain(stream(cache)))])
        add(names[1], groups[1], [epoch(plain(stream(cache))) for _ in range(WARM_EPOCHS)])
    elif kind == "persample-nocache":
        add(names[0], groups[0], [epoch(plain(stream(None)))])
    elif kind == "persample-decoded":
        add(names[0], groups[0], [epoch(plain(stream(cache, decode=crop)))])
    elif kind == "sdl-decoded":
        add(names[0], groups[0], [epoch(lambda: shardkit.StreamingDataLoader(
            stream(cache, decode=crop, batch_size=BATCH), num_workers=WORKERS))])
    elif kind == "sdl-decoded-main":
        try:
            ds = stream(cache, decode=crop, batch_size=BATCH, decode_threads=2)
        except TypeError:
            return [{"name": names[0], "group": groups[0], "status": "skipped", "reason": "no decode_threads"}]
        add(names[0], groups[0], [epoch(lambda: shardkit.StreamingDataLoader(ds, num_workers=0))])
    return out


def decode_bound(url: str, cache: str, crop: Any) -> list[dict[str, Any]]:
    """CenterCrop alone over every sample's bytes (read into memory before the clock), in 2
    forked processes (each half the samples) and in 1."""
    import shardkit

    samples = [{"__key__": s["__key__"], "jpg": s["jpg"], "cls": s["cls"]}
               for s in shardkit.StreamingDataset(url, cache_dir=cache, cache_limit="50GB")]
    rows = []
    for procs in (WORKERS, 1):
        c0, t0 = cpu_seconds(), time.perf_counter()
        pids = []
        for w in range(procs):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the forked decoder
                code = 0
                try:
                    for s in samples[w::procs]:
                        crop(s)
                except BaseException:  # noqa: BLE001 - reported through the exit status
                    code = 1
                os._exit(code)
            pids.append(pid)
        failed = sum(os.waitpid(pid, 0)[1] != 0 for pid in pids)
        seconds = time.perf_counter() - t0
        name = f"decode bound: CenterCrop(224) alone, {procs} process{'es' if procs > 1 else ''}"
        rows.append({"name": name, "group": "decoded", "status": "failed" if failed else "ok",
                     "seconds": round(seconds, 3), "samples_per_s": round(len(samples) / seconds, 1),
                     "cpu_seconds": round(cpu_seconds() - c0, 2), "kind": "ceiling"})
    return rows


# --------------------------------------------------------------------------- parent


def run_child(spec: dict[str, Any], work: Path, env: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    path = work / f"child-{spec['kind']}-{spec['label']}.json"
    path.write_text(json.dumps(spec))
    print(f"bench: {spec['label']} {spec['kind']} ...", flush=True)
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(path)], env=env,
                              capture_output=True, text=True, timeout=timeout, cwd=REPO)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired:
        out, err, rc = "", f"timed out after {timeout:.0f}s", -1
    from benchmarks.common import one_line, parse_emitted

    got = parse_emitted(out)
    if rc != 0 or got is None:
        names, groups = ROWS.get(spec["kind"], (["decode bound"], ["decoded"]))
        return [{"name": nm, "group": g, "status": "failed", "reason": one_line(err)} for nm, g in zip(names, groups)]
    return got["rows"]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_persample", description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--side", type=int, default=672, help="JPEG side in pixels (672: ~100 KB at quality 90)")
    ap.add_argument("--shard-size", default="256MB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--before", default="", help="a directory holding the shardkit package to compare with")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--kinds", default=",".join(ROWS), help="shardkit row kinds to run (comma-separated)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(Path(args.child).read_text())
        sys.path[:0] = [spec["tree"], str(REPO)]
        from benchmarks.common import emit

        emit({"rows": child(spec)})
        return

    sys.path.insert(0, str(REPO))
    import shardkit
    from benchmarks.common import Weed, boto3_client, machine_facts
    from benchmarks.run import peers_python, peers_ready, run_module
    from shardkit.dev.sampledata import make_image_folder

    started = time.time()
    folder = make_image_folder(Path(tempfile.gettempdir()) / f"shardkit-bench-images-{args.images}-{args.side}",
                               args.images, side=args.side)
    total = sum(p.stat().st_size for p in folder.rglob("*.jpg"))
    print(f"bench: {args.images} JPEGs, {total / args.images / 1e3:.0f} KB each", flush=True)
    trees = [("after", str(REPO))] + ([("before", str(Path(args.before).resolve()))] if args.before else [])
    work = Path(tempfile.mkdtemp(prefix="shardkit-persample-"))
    rows: list[dict[str, Any]] = []
    weed = Weed()
    try:
        server = weed.start()
        os.environ.update(server.env())
        boto3_client(server.env()).create_bucket(Bucket="bench")
        url = "s3://bench/ds"
        shardkit.pack(str(folder), url, shard_bytes=args.shard_size, labels_from_dirs=True, progress=False)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(server.env(), AWS_EC2_METADATA_DISABLED="true", PYTHONUNBUFFERED="1",
                   NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        kinds = [k for k in args.kinds.split(",") if k]
        per_round: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            order = trees if r % 2 == 0 else trees[::-1]
            for kind in kinds:
                for label, tree in order:
                    spec = {"kind": kind, "label": label, "tree": tree, "url": url, "num_images": args.images,
                            "cache": str(work / f"cache-{label}")}
                    for got in run_child(spec, work, env, args.timeout):
                        per_round.setdefault((label, got["name"]), []).append(got)
        for (label, name), runs in per_round.items():
            ok = [x for x in runs if x.get("status") == "ok"]
            base = dict(runs[0])
            if ok:
                base.update(status="ok", seconds=statistics.median(x["seconds"] for x in ok),
                            cpu_seconds=statistics.median(x["cpu_seconds"] for x in ok),
                            rounds_samples_per_s=[x["samples_per_s"] for x in ok])
                base["samples_per_s"] = round(args.images / base["seconds"], 1)
            rows.append({**base, "tool": "shardkit", "tree": label})
        spec = {"kind": "decode-bound", "label": "after", "tree": str(REPO), "url": url, "num_images": args.images,
                "cache": str(work / "cache-after")}
        rows += [{**x, "tool": "ceiling", "tree": "after"} for x in run_child(spec, work, env, args.timeout)]
        if not args.no_peers and peers_ready():
            penv = {**env, "PYTHONPATH": str(REPO)}
            for module in ("wds_peer", "mds_peer", "litdata_peer"):
                mwork = work / module
                mwork.mkdir()
                cfg = {"images_dir": str(folder), "num_images": args.images, "total_bytes": total, "bucket": "bench",
                       "work": str(mwork), "shard_bytes": args.shard_size, "quick": False}
                got, _ = run_module(module, str(peers_python()), cfg, penv, args.timeout, work)
                rows += [x for x in got if x.get("group") != "pack"]
        elif not args.no_peers:
            print("bench: peers skipped: benchmarks/.peers-venv is not ready "
                  "(python -m benchmarks.run --peers makes it)")
    finally:
        weed.stop()
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    result = {"command": "python -m benchmarks.bench_persample " + " ".join(sys.argv[1:]),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
              "wall_seconds": round(time.time() - started, 1), "load_average_at_end": [round(x, 2) for x in load],
              "machine": machine_facts(), "images": args.images, "image_bytes": total, "shard_size": args.shard_size,
              "rows": rows}
    dest = REPO / "benchmarks" / "results" / "persample.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps(result, indent=1))
    print_table(rows)
    print(f"\nload average at the end: {load[0]:.1f}; wrote {dest}")


def print_table(rows: list[dict[str, Any]]) -> None:
    """Rows by group, fastest first; shardkit rows name their tree."""
    for group in ("cold", "warm", "decoded"):
        print(f"\n{group}:")
        mine = [x for x in rows if x.get("group") == group]
        for x in sorted(mine, key=lambda x: -(x.get("samples_per_s") or 0)):
            who = x.get("tree", x.get("tool", ""))
            rate = (f"{x['samples_per_s']:>9,.0f}/s" if x.get("samples_per_s")
                    else f"{x.get('status')}: {x.get('reason', '')}")
            cpu = f"  cpu {x['cpu_seconds']:.1f} s" if x.get("cpu_seconds") is not None else ""
            rounds = f"  rounds {x['rounds_samples_per_s']}" if x.get("rounds_samples_per_s") else ""
            print(f"  {x['name'][:72]:72s} {who:10s} {rate}{cpu}{rounds}")


if __name__ == "__main__":
    main()
