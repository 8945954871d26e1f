"""The benchmark matrix: shard size x sample size x loader mode x cold/warm, with the ceilings
and the peers of every cell in the same run. One command:

    python -m benchmarks.matrix [--quick] [--no-peers] [--no-knobs] [--out DIR]

Cells: shard size {64, 256, 512 MB} x sample size {~4 KB tokens, ~100 KB JPEGs, ~2 MB arrays};
each cell's dataset is a few shards (4 of 64 MB, 2 of 256 or 512 MB), packed by every tool from
the same samples (benchmarks/matrix_data.py) into its own throwaway SeaweedFS. Per cell:

- shardkit (benchmarks/matrix_rows.py): plain DataLoader per sample (2 workers),
  StreamingDataLoader (2 workers), num_workers=0 with read threads, zero-copy; a cold epoch
  (empty cache) then the best of ``--warm-epochs`` warm ones; first batch and peak RSS of the
  loading process and of each worker; a no-cache row; knob rows (prefetch, ranged-GET part
  size, read threads) against the defaults;
- ceilings: ranged GETs of the same shard bytes, a bare GET of the first batch's bytes, and
  ``cat`` of the cached shard files;
- peers (benchmarks/peers/matrix_peers.py, in benchmarks/.peers-venv): webdataset (no cache,
  and cache_dir), MosaicML Streaming, LitData.

Every row runs in its own process, forked from a server that imported torch and the loader
libraries once (benchmarks/forkrun.py): a crash or a timeout fails that row, not the run.
Writes ``<out>/matrix.json``, ``<out>/matrix.md`` (the tables) and one chart per axis
(``<out>/matrix-*.png``; benchmarks/matrix_report.py). ``--replot JSON`` redraws them only.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (BENCH_DIR, REPO_ROOT, Weed, boto3_client, machine_facts, one_line, package_versions,
                               write_json)
from benchmarks.matrix_data import KINDS, MODES as MODE_NAMES, load_pool
from benchmarks.matrix_report import write_outputs
from benchmarks.run import MAIN_PACKAGES, PEER_PACKAGES, ensure_peers_venv, peers_python, peers_ready

__all__ = ["main", "plan_cells", "Forker"]

DATA_CACHE = BENCH_DIR / ".cache"
FULL_SHARDS = {"64MB": 4, "256MB": 2, "512MB": 2}  # shards per cell's dataset, by shard size
# At most this many shards for a kind: 2 shards of ~4 KB samples are already 21k-168k samples,
# which the per-sample peers read at 1.3-3k samples/s (LitData, webdataset): minutes per cell.
MAX_SHARDS = {"tokens": 2}
QUICK_SHARDS = {"1MB": 3, "4MB": 2}
MODE_ORDER = ("per_sample", "workers", "threads", "zero_copy")
# Knob rows against the defaults (StreamingDataset: prefetch 2 per worker, 4 with num_workers=0;
# read_threads 2; shard_source.FETCH_PART_SIZE 16 MiB). read_threads matters warm as well. Each
# mode's defaults run again among its knob rows ({"again": 1}): a knob is compared with both
# default rows, and their spread says how much of a difference the machine's noise makes.
KNOBS: list[tuple[str, dict[str, int], bool]] = [
    ("workers", {"prefetch": 1}, False), ("workers", {"prefetch": 4}, False), ("workers", {"again": 1}, False),
    ("workers", {"part_mib": 8}, False), ("workers", {"part_mib": 32}, False),
    ("threads", {"read_threads": 1}, True), ("threads", {"read_threads": 4}, True), ("threads", {"again": 1}, True),
    ("threads", {"prefetch": 2}, False), ("threads", {"prefetch": 8}, False),
]
PEER_ROWS = [("webdataset", "wds_pack", [("webdataset, no cache", "wds_row", False),
                                         ("webdataset + cache_dir", "wds_row", True)]),
             ("mosaicml-streaming", "mds_pack", [("MosaicML Streaming", "mds_row", True)]),
             ("litdata", "litdata_pack", [("LitData", "litdata_row", True)])]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.matrix", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny cells (1 and 4 MB shards), no peers, no knobs: a smoke run")
    p.add_argument("--shards", default="", help="shard sizes, comma separated (default 64MB,256MB,512MB)")
    p.add_argument("--kinds", default="", help=f"sample kinds, comma separated (default {','.join(KINDS)})")
    p.add_argument("--modes", default=",".join(MODE_ORDER), help="shardkit loader modes")
    peers = p.add_mutually_exclusive_group()
    peers.add_argument("--peers", action="store_true", help="run the peers even with --quick")
    peers.add_argument("--no-peers", action="store_true", help="shardkit and the ceilings only")
    p.add_argument("--no-knobs", action="store_true", help="leave out the prefetch / part size / read threads rows")
    p.add_argument("--warm-epochs", type=int, default=None, help="warm epochs per row, the best counts (default 2)")
    p.add_argument("--jpegs", type=int, default=None, help="distinct ~100 KB JPEGs in the pool (default 2000)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per row")
    p.add_argument("--out", default=str(BENCH_DIR / "results"), help="where matrix.json/.md/-*.png go")
    p.add_argument("--replot", metavar="JSON", help="only rewrite the table and charts from a matrix.json")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- the forking servers


class Forker:
    """A ``benchmarks.forkrun`` server: one job at a time, each in its own forked process."""

    def __init__(self, python: str, modules: list[str], env: dict[str, str], log: Path) -> None:
        self.cmd = [python, "-m", "benchmarks.forkrun", *modules]
        self.env, self.log = env, log
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "a"), cwd=REPO_ROOT, env=self.env, text=True)
        ready = self._reply(180.0)
        if ready is None or ready.get("status") != "ready":
            raise RuntimeError(f"{' '.join(self.cmd[2:])} did not start: {one_line(self.log.read_text())}")

    def _reply(self, timeout: float) -> dict[str, Any] | None:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        return json.loads(line) if line.strip() else None

    def run(self, call: str, args: dict[str, Any], env: dict[str, str], timeout: float, log: Path) -> dict[str, Any]:
        """Run one row; its reply (``status`` ok with ``result``, or failed with ``reason``)."""
        try:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            assert self.proc is not None and self.proc.stdin is not None
            job = {"id": call, "call": call, "args": args, "env": env, "timeout": timeout, "log": str(log)}
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            reply = self._reply(timeout + 60.0)
        except (OSError, RuntimeError, ValueError) as exc:
            reply = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        if reply is None:  # the server itself died or hung: start a new one for the next row
            self.close()
            reply = {"status": "failed", "reason": f"forkrun server gave no reply; see {log}"}
        return reply

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # by its own pid
            self.proc.wait()
        self.proc = None


# --------------------------------------------------------------------------- cells


def tar_bytes_per_sample(pool: list[bytes]) -> float:
    """Average bytes a sample takes in a tar shard: payload and label members, 512-byte blocks."""
    return sum(-(-len(p) // 512) * 512 for p in pool) / len(pool) + 3 * 512


def plan_cells(shards: dict[str, int], kinds: list[str], jpeg_dir: str, quick: bool) -> list[dict[str, Any]]:
    """One entry per (shard size, kind): sample count for ~``n`` shards of that size."""
    from shardkit.config import parse_size

    cells = []
    for kind in kinds:
        per = tar_bytes_per_sample(load_pool(kind, jpeg_dir, quick))
        for shard, n in shards.items():
            n = min(n, MAX_SHARDS.get(kind, n))
            count = max(4, int(n * parse_size(shard, "shard") * 0.97 / per))
            cells.append({"shard": shard, "shards_planned": n, "kind": kind, "count": count,
                          "batch": KINDS[kind].batch, "label": KINDS[kind].label})
    return cells


def _row(cell: dict[str, Any], tool: str, name: str, mode: str, reply: dict[str, Any],
         knobs: dict[str, int] | None = None) -> dict[str, Any]:
    out = {"shard": cell["shard"], "kind": cell["kind"], "tool": tool, "name": name, "mode": mode,
           "knobs": knobs or {}, "status": reply.get("status", "failed"), "reason": reply.get("reason", ""),
           "row_seconds": reply.get("seconds")}
    res = reply.get("result") or {}
    for key in ("cold", "warm", "rss", "open_s"):
        if key in res:
            out[key] = res[key]
    if out["status"] == "ok" and any(res.get(p, {}).get("status") == "failed" for p in ("cold", "warm")):
        out["status"] = "failed"
        out["reason"] = next(res[p]["reason"] for p in ("cold", "warm") if res.get(p, {}).get("status") == "failed")
    return out


def run_cell(cell: dict[str, Any], z: Forker, peers: Forker | None, args: argparse.Namespace, base: dict[str, Any],
             logs: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every row of one cell against its own SeaweedFS; (cell facts, rows)."""
    tag = f"{cell['shard']}-{cell['kind']}"
    print(f"matrix: cell {tag}: {cell['count']:,} samples ...", flush=True)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"shardkit-matrix-{tag}-"))
    rows: list[dict[str, Any]] = []
    facts = dict(cell)
    weed = Weed()
    try:
        server = weed.start()
        boto3_client(server.env()).create_bucket(Bucket="bench")
        env = {**server.env(), "AWS_EC2_METADATA_DISABLED": "true"}
        common = {**base, "bucket": "bench", "kind": cell["kind"], "shard_bytes": cell["shard"], "count": cell["count"],
                  "work": str(work)}

        def z_run(call: str, extra: dict[str, Any], label: str) -> dict[str, Any]:
            reply = z.run(f"benchmarks.matrix_rows:{call}", {**common, **extra}, env, args.timeout,
                          logs / f"{tag}-{label}.log")
            if reply["status"] != "ok":
                print(f"matrix:   {label}: FAILED {reply.get('reason')}", flush=True)
            return reply

        pack = z_run("pack_row", {}, "pack")
        if pack["status"] != "ok":
            facts["pack"] = {"status": "failed", "reason": pack.get("reason")}
            return facts, [_row(cell, "shardkit", "shardkit pack", "pack", pack)]
        packed = pack["result"]
        facts["pack"] = {k: packed[k] for k in ("seconds", "num_shards", "num_samples", "first_batch_end")}
        facts["payload_bytes"] = common["payload_bytes"] = packed["payload_bytes"]
        facts["shard_bytes_total"] = sum(b for _, b in packed["objects"])
        ceil = z_run("ceiling_row", {"objects": packed["objects"], "first_batch_end": packed["first_batch_end"],
                                     "passes": 1 if args.quick else 2}, "ceiling")
        facts["ceiling"] = ceil.get("result") or {"status": "failed", "reason": ceil.get("reason")}
        warm = args.warm_epochs
        for mode in args.mode_list:
            cache = str(work / f"cache-{mode}")
            reply = z_run("loader_row", {"mode": mode, "cache_dir": cache, "warm_epochs": warm,
                                         "keep_cache": mode == "threads"}, mode)
            rows.append(_row(cell, "shardkit", MODE_NAMES[mode], mode, reply))
            if mode == "threads":
                cat = z_run("cat_row", {"cache_dir": cache}, "cat")
                facts["cat"] = cat.get("result") or {"status": "failed", "reason": cat.get("reason")}
                shutil.rmtree(cache, ignore_errors=True)
        reply = z_run("loader_row", {"mode": "nocache", "warm_epochs": 0}, "nocache")
        rows.append(_row(cell, "shardkit", MODE_NAMES["nocache"], "nocache", reply))
        for mode, knobs, with_warm in ([] if args.no_knobs else KNOBS):
            label = f"{mode}-" + "-".join(f"{k}{v}" for k, v in knobs.items())
            reply = z_run("loader_row", {"mode": mode, "knobs": knobs, "cache_dir": str(work / f"cache-{label}"),
                                         "warm_epochs": warm if with_warm else 0}, label)
            name = f"{MODE_NAMES[mode]}, " + ("defaults again" if "again" in knobs else
                                               ", ".join(f"{k}={v}" for k, v in knobs.items()))
            rows.append(_row(cell, "shardkit", name, mode, reply, knobs))
        for tool, pack_call, loaders in (PEER_ROWS if peers else []):
            assert peers is not None
            reply = peers.run(f"benchmarks.peers.matrix_peers:{pack_call}", common, env, args.timeout,
                              logs / f"{tag}-{tool}-pack.log")
            facts.setdefault("peer_packs", {})[tool] = reply.get("result") or {"status": "failed",
                                                                                 "reason": reply.get("reason")}
            for name, call, cached in loaders:
                if reply["status"] != "ok":
                    rows.append(_row(cell, tool, name, "peer", {"status": "failed",
                                                                 "reason": f"pack failed: {reply.get('reason')}"}))
                    continue
                extra = {"urls": reply["result"].get("urls"), "warm_epochs": warm,
                         "cache_dir": str(work / f"cache-{call}-{cached}") if cached else None}
                got = peers.run(f"benchmarks.peers.matrix_peers:{call}", {**common, **extra}, env, args.timeout,
                                logs / f"{tag}-{call}-{cached}.log")
                if got["status"] != "ok":
                    print(f"matrix:   {name}: FAILED {got.get('reason')}", flush=True)
                rows.append(_row(cell, tool, name, "peer", got))
    except Exception as exc:  # noqa: BLE001 - the server or the bucket: this cell fails, not the run
        facts["error"] = f"{type(exc).__name__}: {exc}"
        print(f"matrix: cell {tag} failed: {facts['error']}", flush=True)
    finally:
        weed.stop()
        shutil.rmtree(work, ignore_errors=True)
    facts["seconds"] = round(time.monotonic() - t0, 1)
    print(f"matrix: cell {tag} done in {facts['seconds']:.0f}s", flush=True)
    return facts, rows



def jpeg_folder(count: int) -> Path:
    """``count`` ~100 KB JPEGs (640 x 640, quality 92) from shardkit.dev.sampledata, made once."""
    from shardkit.dev.sampledata import make_image_folder

    root = DATA_CACHE / f"jpegs-640-q92-{count}"
    t0 = time.monotonic()
    make_image_folder(root, count, side=640, quality=92)
    files = list(root.rglob("*.jpg"))
    if len(files) != count:
        raise RuntimeError(f"{root} holds {len(files)} JPEGs, expected {count}: delete it and rerun")
    print(f"matrix: {count} JPEGs, {sum(f.stat().st_size for f in files) / count / 1e3:.0f} KB each, in {root} "
          f"({time.monotonic() - t0:.0f}s)", flush=True)
    return root


def server_env(peer: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    path = str(REPO_ROOT)
    if peer:  # LitData's obstore needs allow_http for the loopback server (peers/_litdata_site)
        path = os.pathsep.join([str(BENCH_DIR / "peers" / "_litdata_site"), path])
        env["AWS_ALLOW_HTTP"] = "true"
    env.update(PYTHONPATH=path, PYTHONUNBUFFERED="1", AWS_CONFIG_FILE=os.devnull,
               AWS_SHARED_CREDENTIALS_FILE=os.devnull, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               TOKENIZERS_PARALLELISM="false", DO_NOT_TRACK="1")
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(argv) if argv is not None else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        print(write_outputs(json.loads(Path(args.replot).read_text()), out))
        return 0
    shards = QUICK_SHARDS if args.quick else FULL_SHARDS
    if args.shards:
        shards = {s.strip(): shards.get(s.strip(), 2) for s in args.shards.split(",") if s.strip()}
    kinds = [k.strip() for k in (args.kinds or ",".join(KINDS)).split(",") if k.strip()]
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [k for k in kinds if k not in KINDS] + [m for m in args.mode_list if m not in MODE_ORDER]
    if bad:
        raise SystemExit(f"unknown kind or mode: {bad}; kinds {list(KINDS)}, modes {list(MODE_ORDER)}")
    if args.quick:
        args.no_knobs = True
    args.warm_epochs = args.warm_epochs if args.warm_epochs is not None else (1 if args.quick else 2)
    want_peers = not args.no_peers and (args.peers or not args.quick)
    notes: list[str] = []
    started = time.time()
    load_start = os.getloadavg()
    jpeg_dir = str(jpeg_folder(args.jpegs or (48 if args.quick else 2000))) if "jpeg" in kinds else ""
    cells = plan_cells(shards, kinds, jpeg_dir, args.quick)
    logs = out / "matrix-logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    z = Forker(sys.executable, ["benchmarks.matrix_rows"], server_env(False), logs / "forkrun-main.log")
    peers: Forker | None = None
    if want_peers:
        why = ensure_peers_venv() if not peers_ready() else None
        if why is None:
            peers = Forker(str(peers_python()), ["benchmarks.peers.matrix_peers"], server_env(True),
                           logs / "forkrun-peers.log")
        else:
            notes.append(f"peers not run: {why}")
    elif not args.no_peers:
        notes.append("peers not run (--quick without --peers)")
    else:
        notes.append("peers not run (--no-peers)")
    base = {"jpeg_dir": jpeg_dir, "quick": args.quick}
    facts: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    result = {
        "command": "python -m benchmarks.matrix " + " ".join(argv if argv is not None else sys.argv[1:]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_seconds": 0.0, "load_avg_start": [round(x, 2) for x in load_start], "load_avg_end": [],
        "machine": machine_facts(),
        "versions": {"main": package_versions(MAIN_PACKAGES), "peers": peers_versions() if peers else {}},
        "settings": {"shards": shards, "kinds": {k: KINDS[k].label for k in kinds}, "modes": args.mode_list,
                     "warm_epochs": args.warm_epochs, "knobs": not args.no_knobs, "num_workers": 2,
                     "batch": {k: KINDS[k].batch for k in kinds}, "jpegs": args.jpegs or (48 if args.quick else 2000),
                     "shuffle": False, "storage": "SeaweedFS weed mini, loopback, one server per cell"},
        "notes": notes, "cells": facts, "rows": rows,
    }

    def save(partial: bool) -> None:
        result.update(wall_seconds=round(time.time() - started, 1), partial=partial,
                      load_avg_end=[round(x, 2) for x in os.getloadavg()])
        write_json(out / "matrix.json", result)

    try:
        for cell in cells:
            f, r = run_cell(cell, z, peers, args, base, logs)
            facts.append(f)
            rows.extend(r)
            save(partial=True)  # a run cut short keeps the cells it finished (--replot draws them)
    finally:
        z.close()
        if peers:
            peers.close()
    save(partial=False)
    print(write_outputs(result, out))
    print(f"\nwrote {out / 'matrix.json'}, {out / 'matrix.md'} and {out}/matrix-*.png "
          f"({result['wall_seconds']:.0f} s)")
    return 0


def peers_versions() -> dict[str, str | None]:
    code = ("import json, importlib.metadata as m\nout = {}\nfor n in %r:\n    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: out[n] = None\nprint(json.dumps(out))") % (PEER_PACKAGES,)
    try:
        return json.loads(subprocess.check_output([str(peers_python()), "-c", code], text=True, timeout=60))
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


if __name__ == "__main__":
    raise SystemExit(main())
