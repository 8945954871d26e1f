"""Pre-resized packs against a full-size pack of the same ~100 KB JPEGs, end to end.

    python -m benchmarks.bench_resize [--images 2000] [--rounds 2] [--out DIR]

Packs one folder of 640 x 640 JPEGs (~100 KB each, quality 92; the matrix's pool) four ways
with the CLI, each a fresh ``shardkit pack`` process (local engine) against a throwaway
SeaweedFS (the time is the command's wall time, interpreter start included): as they are,
``--resize 256`` (re-encoded as JPEG at PIL's default quality, 75), ``--resize 256 --reencode
jpeg:90``, ``--reencode webp`` (quality 80) and ``--resize 256 --reencode webp``. Then, for each pack: its bytes, the raw read rate from the
warm node cache, and the decoded samples/s of the same decode function for all
(``shardkit.CenterCrop(224, as_field="img")`` in ``StreamingDataLoader``'s 2 workers, warm
cache, the best of ``--rounds`` epochs), and how far its 224 x 224 crops are from the
full-size pack's (PSNR over the first 64 images). Writes ``<out>/resize.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import BENCH_DIR, REPO_ROOT, Weed, boto3_client, machine_facts, write_json  # noqa: E402
from benchmarks.matrix_measure import timed_epoch  # noqa: E402

VARIANTS = [("full size (as packed)", []), ("--resize 256", ["--resize", "256"]),
            ("--resize 256 --reencode jpeg:90", ["--resize", "256", "--reencode", "jpeg:90"]),
            ("--reencode webp", ["--reencode", "webp"]), ("--resize 256 --reencode webp", ["--resize", "256", "--reencode", "webp"])]


def pack_cli(folder: Path, url: str, extra: list[str], env: dict[str, str]) -> float:
    """``shardkit pack FOLDER URL --labels-from-dirs --shard-size 64MB --quiet EXTRA`` in a new
    process; its wall seconds."""
    cmd = [sys.executable, "-m", "shardkit.cli", "pack", str(folder), url, "--labels-from-dirs", "--shard-size", "64MB",
           "--quiet", *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def crops(url: str, opts: dict[str, Any], n: int) -> Any:
    """The 224 x 224 crops of the first ``n`` samples (one process, no cache)."""
    import numpy as np

    import shardkit

    ds = shardkit.StreamingDataset(url, storage_options=opts, decode=shardkit.CenterCrop(224, as_field="img"))
    out = []
    for s in ds:
        out.append(np.asarray(s["img"], dtype=np.float64))
        if len(out) == n:
            break
    return np.stack(out)


def psnr(a: Any, b: Any) -> float:
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def read_rows(url: str, opts: dict[str, Any], cache: Path, n: int, rounds: int) -> dict[str, Any]:
    """Raw warm read rate and decoded warm samples/s of one pack (the cache filled untimed)."""
    import shardkit

    def loader(decode: Any) -> Any:
        ds = shardkit.StreamingDataset(url, cache_dir=cache, storage_options=opts, batch_size=256, decode=decode)
        return shardkit.StreamingDataLoader(ds, num_workers=2, persistent_workers=False)

    fill = timed_epoch(loader(None))  # fills the cache (cold), also a raw cold figure
    raw = min((timed_epoch(loader(None)) for _ in range(rounds)), key=lambda r: r["seconds"])
    dec = min((timed_epoch(loader(shardkit.CenterCrop(224, as_field="img"))) for _ in range(rounds)),
              key=lambda r: r["seconds"])
    for name, r in (("raw cold", fill), ("raw warm", raw), ("decoded warm", dec)):
        if r["samples"] != n:
            raise RuntimeError(f"{url}: {name} epoch gave {r['samples']} samples, expected {n}")
    return {"raw_cold_samples_per_s": round(n / fill["seconds"], 1), "raw_warm_samples_per_s": round(n / raw["seconds"], 1),
            "decoded_samples_per_s": round(n / dec["seconds"], 1), "decoded_seconds": round(dec["seconds"], 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_resize", description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2000, help="~100 KB JPEGs (640 x 640, quality 92)")
    ap.add_argument("--rounds", type=int, default=2, help="warm epochs per read row (the best counts)")
    ap.add_argument("--out", default=str(BENCH_DIR / "results"))
    args = ap.parse_args(argv)
    import torch  # noqa: F401 - imported before any clock

    import shardkit
    from benchmarks.matrix import jpeg_folder

    started = time.time()
    load_start = os.getloadavg()
    folder = jpeg_folder(args.images)
    src_bytes = sum(p.stat().st_size for p in folder.rglob("*.jpg"))
    work = Path(tempfile.mkdtemp(prefix="shardkit-bench-resize-"))
    rows: list[dict[str, Any]] = []
    try:
        with Weed() as server:
            os.environ.update(server.env())
            boto3_client(server.env()).create_bucket(Bucket="bench")
            opts = server.storage_options()
            env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
            reference = None
            for i, (name, extra) in enumerate(VARIANTS):
                url = f"s3://bench/v{i}"
                seconds = pack_cli(folder, url, extra, env)
                ds = shardkit.open_dataset(url, opts)
                nbytes = sum(s.bytes for s in ds.shard_list)
                n = ds.num_samples
                row: dict[str, Any] = {"name": name, "cli": " ".join(extra), "pack_seconds": round(seconds, 2),
                                       "pack_images_per_s": round(n / seconds, 1), "samples": n, "shard_bytes": nbytes,
                                       "bytes_per_sample": round(nbytes / n), "fields": ds.fields}
                row.update(read_rows(url, opts, work / f"cache-{i}", n, args.rounds))
                got = crops(url, opts, 64)
                if reference is None:
                    reference = got
                row["psnr_vs_full_db"] = round(psnr(got, reference), 2)
                rows.append(row)
                print(f"{name:34s} pack {seconds:6.1f} s  {nbytes / 1e6:7.1f} MB  decoded {row['decoded_samples_per_s']:7.1f}/s"
                      f"  raw warm {row['raw_warm_samples_per_s']:9.1f}/s  PSNR {row['psnr_vs_full_db']} dB", flush=True)
                shutil.rmtree(work / f"cache-{i}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    full = rows[0]
    for r in rows:
        r["bytes_vs_full"] = round(r["shard_bytes"] / full["shard_bytes"], 3)
        r["decoded_vs_full"] = round(r["decoded_samples_per_s"] / full["decoded_samples_per_s"], 2)
        r["pack_time_vs_full"] = round(r["pack_seconds"] / full["pack_seconds"], 2)
    out = Path(args.out)
    write_json(out / "resize.json", {
        "command": "python -m benchmarks.bench_resize " + " ".join(argv if argv is not None else sys.argv[1:]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "load_avg_start": [round(x, 2) for x in load_start], "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "machine": machine_facts(), "images": args.images, "source_bytes": src_bytes, "rows": rows})
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
