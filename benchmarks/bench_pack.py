"""Packing throughput next to raw PUT of the same bytes, in one run, on one SeaweedFS.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_pack [--images 1500] [--h5-mb 300] [--shard-size 64MB]

Data (generated once, cached under ``demo-data/bench-pack/``): an ImageFolder of real-ish
~100 KB JPEGs (:func:`shardkit.dev.sampledata.make_image_folder`), and one HDF5 file with two
float32 datasets of ~``--h5-mb`` MB each (one sample each). For each data set:

* raw PUT: the same total bytes, as objects of the sizes the pack produced, uploaded with
  s3fs ``pipe`` (one PUT), boto3 ``put_object`` (one PUT) and boto3 multipart with 16 MiB
  parts (what the shard writer sends: ``shardkit.packing.writer.PART_BYTES``, one PUT below that);
* shardkit pack, local engine (modules imported before timing, as the raw rows' clients are
  made before theirs);
* shardkit pack, Ray engine (local Ray, 2 CPUs, started before timing).

Rates are MB/s of dataset bytes (shard bytes); ratios are against the best raw PUT and the
boto3 multipart row. Writes ``benchmarks/results/pack.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import REPO_ROOT, Weed, boto3_client, machine_facts, package_versions, write_json
from shardkit.packing.tar_shard import PART_BYTES as PART  # the raw multipart row sends the shard writer's parts


def _make_hdf5(path: Path, mb: int) -> Path:
    import h5py
    import numpy as np

    marker = path.with_suffix(f".{mb}.ok")
    if marker.exists() and path.exists():
        return path
    rows = mb * 10**6 // (1024 * 1024 * 4)
    with h5py.File(path, "w") as f:
        for n, name in enumerate(("a", "b")):
            d = f.create_dataset(name, shape=(rows, 1024, 1024), dtype="float32", chunks=(2, 1024, 1024))
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


def _rate(name: str, data: str, nbytes: int, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"row": name, "data": data, "bytes": nbytes, "seconds": round(seconds, 3),
            "mb_per_s": round(nbytes / seconds / 1e6, 1), **extra}


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def raw_puts(server: Any, bucket: str, data: str, payloads: list[bytes]) -> list[dict[str, Any]]:
    import s3fs

    total = sum(len(p) for p in payloads)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
    client = boto3_client(server.env())
    rows = []

    def s3fs_pipe() -> None:
        for i, p in enumerate(payloads):
            fs.pipe_file(f"{bucket}/raw-pipe/{data}/{i:06d}", p)

    def boto_put() -> None:
        for i, p in enumerate(payloads):
            client.put_object(Bucket=bucket, Key=f"raw-put/{data}/{i:06d}", Body=p)

    def boto_multipart() -> None:
        for i, p in enumerate(payloads):
            key = f"raw-mpu/{data}/{i:06d}"
            if len(p) <= PART:
                client.put_object(Bucket=bucket, Key=key, Body=p)
                continue
            up = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
            parts = []
            for n, start in enumerate(range(0, len(p), PART), 1):
                r = client.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=n, Body=p[start:start + PART])
                parts.append({"PartNumber": n, "ETag": r["ETag"]})
            client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts})

    for name, fn in (("raw PUT, s3fs pipe", s3fs_pipe), ("raw PUT, boto3 put_object", boto_put),
                     (f"raw PUT, boto3 multipart {PART >> 20} MiB (shard writer parts)", boto_multipart)):
        seconds, _ = _timed(fn)
        rows.append(_rate(name, data, total, seconds, objects=len(payloads)))
    return rows


def pack_rows(server: Any, bucket: str, data: str, src: Path, shard_size: str, **kw: Any) -> tuple[list[dict[str, Any]], list[int]]:
    import shardkit
    import shardkit.packing.pack  # pyarrow, s3fs... imported outside the timed region

    opts = server.storage_options()
    rows = []
    sizes: list[int] = []
    for engine in ("local", "ray"):
        dest = f"s3://{bucket}/pack-{engine}/{data}"
        seconds, info = _timed(lambda: shardkit.pack(str(src), dest, shard_bytes=shard_size, engine=engine,
                                                     storage_options=opts, progress=False, **kw))
        rows.append(_rate(f"shardkit pack, {engine} engine", data, info["total_bytes"], seconds,
                          samples=info["num_samples"], shards=info["num_shards"], tasks=info["tasks"]))
        if engine == "local":
            sizes = shardkit.open_dataset(dest, storage_options=opts).shards.column("bytes").to_pylist()
    return rows, sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1500)
    ap.add_argument("--h5-mb", type=int, default=300)
    ap.add_argument("--shard-size", default="64MB")
    ap.add_argument("--data-dir", default=str(REPO_ROOT / "demo-data" / "bench-pack"))
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "pack.json"))
    args = ap.parse_args(argv)

    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(k, v)
    from shardkit.dev.sampledata import make_image_folder

    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    images = make_image_folder(data_dir / f"images-{args.images}", args.images)
    h5 = _make_hdf5(data_dir / "two.h5", args.h5_mb)
    print(f"data ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    import ray

    ray_t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}}, log_to_driver=False)
    ray_start = time.perf_counter() - ray_t0
    rows: list[dict[str, Any]] = []
    try:
        with Weed() as server:
            import s3fs

            fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
            fs.mkdir("bench-pack")
            # SeaweedFS allocates a new bucket's volumes on its first write (~0.2 s): do it here,
            # or the first timed row (the pack) pays for it and the raw rows after it do not.
            fs.pipe_file("bench-pack/warm-up", b"x")
            for data, src, kw in (("images", images, {"labels_from_dirs": True}), ("hdf5", h5, {})):
                packed, sizes = pack_rows(server, "bench-pack", data, src, args.shard_size, **kw)
                raw = raw_puts(server, "bench-pack", data,
                               _payloads(src, sizes) if src.is_dir() else _h5_payloads(src, sizes))
                best = max(r["mb_per_s"] for r in raw)
                mpu = raw[-1]["mb_per_s"]
                for r in packed:
                    r["vs_best_raw_put"] = round(r["mb_per_s"] / best, 2)
                    r["vs_boto3_multipart"] = round(r["mb_per_s"] / mpu, 2)
                rows.extend(raw + packed)
    finally:
        ray.shutdown()
    load = os.getloadavg()[0]
    payload = {"benchmark": "pack", "command": "python -m benchmarks.bench_pack " + " ".join(argv or sys.argv[1:]),
               "shard_size": args.shard_size, "images": args.images, "h5_mb_per_sample": args.h5_mb,
               "ray_start_seconds": round(ray_start, 2), "load_average_end": round(load, 1),
               "machine": machine_facts(), "versions": package_versions(["shardkit", "ray", "s3fs", "boto3", "h5py"]),
               "rows": rows}
    write_json(Path(args.out), payload)
    print(f"{'data':7s} {'row':52s} {'MB':>8s} {'s':>7s} {'MB/s':>7s} {'vs best PUT':>11s} {'vs MPU':>7s}")
    for r in rows:
        print(f"{r['data']:7s} {r['row']:52s} {r['bytes'] / 1e6:8.1f} {r['seconds']:7.2f} {r['mb_per_s']:7.1f} "
              f"{r.get('vs_best_raw_put', ''):>11} {r.get('vs_boto3_multipart', ''):>7}")
    print(f"(local Ray start, not timed: {ray_start:.1f}s; load average at the end {load:.1f}; wrote {args.out})")
    return 0


def _h5_payloads(path: Path, sizes: list[int]) -> list[bytes]:
    """The HDF5 file's own bytes cut to the shard sizes (zero-padded past its end)."""
    out = []
    with open(path, "rb") as f:
        for size in sizes:
            b = f.read(size)
            out.append(b + bytes(size - len(b)))
    return out


if __name__ == "__main__":
    sys.exit(main())
