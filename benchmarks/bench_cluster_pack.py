"""The must-show at full size: an ImageFolder of 20,000 objects in SeaweedFS (one object per
image) packed with the Ray engine on a real 2-node cluster, byte-identical to the local engine's
pack of the same folder from local disk, with tasks on both nodes.

    .venv/bin/python -m benchmarks.bench_cluster_pack [--images 20000] [--side 64] [--shards 32]

(too slow for CI on a 2-core machine; ``tests/cluster/test_cluster_pack.py`` packs 2,000 objects,
a file list of URLs, an HDF5 file and a Zarr group the same way.)

Setup: ``images`` JPEGs of ``side`` px (shardkit.dev.sampledata, kept in the temp dir for later
runs) in a throwaway SeaweedFS, put by 16 threads; a head and a worker node
(``tests/cluster/raycluster.py``: ``ray start --head`` + ``ray start --address`` on 127.0.0.1,
one CPU each, their own temp dirs), whose environment holds the S3 keys but not the endpoint (the
driver's travels with each task). Shards of 1/``shards`` of the images' bytes.

Timed, one after the other: the listing alone (``ImageFolderSource.list_items()``), the Ray pack
from S3 (this process the driver; the time to its first task planned, and the tasks each node
ran), the local engine's pack of the folder on disk to S3, and the local engine's pack of the
objects (this one process reading S3: what the reads cost without Ray). Then the datasets are
compared shard byte for shard byte and row for row. Prints a table; writes results/cluster_pack.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "cluster"))

from benchmarks.common import Weed, boto3_client  # noqa: E402
from raycluster import RayCluster  # noqa: E402 - tests/cluster: the cluster the tests start


def node_env(s3_env: dict[str, str]) -> dict[str, str]:
    """The nodes' environment: loopback Ray, this checkout on PYTHONPATH, the S3 keys (no endpoint)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "AWS_"))}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=str(REPO), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.update({k: v for k, v in s3_env.items() if not k.startswith("AWS_ENDPOINT_URL")})
    return env


def put_tree(env: dict[str, str], local: Path, bucket: str, prefix: str) -> float:
    """Upload every file under ``local`` to ``bucket/prefix`` from 16 threads; the seconds it took."""
    client = boto3_client(env, max_pool=16)
    files = [p for p in sorted(local.rglob("*")) if p.is_file() and not p.name.startswith(".")]

    def put(path: Path) -> None:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(local).as_posix()}", Body=path.read_bytes())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files))
    return time.perf_counter() - t0


def same(url_a: str, url_b: str, so: dict[str, Any]) -> dict[str, bool]:
    """Whether two datasets hold the same shard bytes, shard rows and sample rows."""
    import shardkit

    a = shardkit.open_dataset(url_a, storage_options=so)
    b = shardkit.open_dataset(url_b, storage_options=so)
    paths = a.shards.column("path").to_pylist()
    return {"shard_rows": a.shards.equals(b.shards), "sample_rows": a.samples.equals(b.samples),
            "shard_bytes": paths == b.shards.column("path").to_pylist()
            and all(a.store.read_bytes(p) == b.store.read_bytes(p) for p in paths)}


def first_task_clock() -> dict[str, float]:
    """Note when the pack's TaskStream starts listing (``made``) and hands out its first task (``first``)."""
    from shardkit.packing import plan_stream

    seen: dict[str, float] = {}
    cls = plan_stream.TaskStream
    real_init, real_iter = cls.__init__, cls.__iter__

    def init(self: Any, *a: Any, **kw: Any) -> None:
        seen.setdefault("made", time.perf_counter())
        real_init(self, *a, **kw)

    def iterate(self: Any) -> Any:
        for task in real_iter(self):
            seen.setdefault("first", time.perf_counter())
            yield task

    cls.__init__ = init  # type: ignore[method-assign]
    cls.__iter__ = iterate  # type: ignore[method-assign]
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=20_000)
    ap.add_argument("--side", type=int, default=64)
    ap.add_argument("--shards", type=int, default=32, help="shards of 1/SHARDS of the images' bytes")
    args = ap.parse_args()

    import shardkit
    from shardkit.dev.sampledata import make_image_folder
    from shardkit.packing.sources.imagefolder import ImageFolderSource

    t0 = time.perf_counter()
    folder = make_image_folder(Path(tempfile.gettempdir()) / f"shardkit-bench-cluster-{args.images}-{args.side}",
                               args.images, side=args.side, quality=85)
    make_s = time.perf_counter() - t0
    image_bytes = sum(p.stat().st_size for p in folder.rglob("*.jpg"))
    shard_bytes = image_bytes // args.shards
    first = first_task_clock()
    with Weed() as server:
        env = server.env()
        os.environ.update(env)
        so = server.storage_options()
        boto3_client(env).create_bucket(Bucket="bench")
        put_s = put_tree(env, folder, "bench", "raw/imgs")
        url = "s3://bench/raw/imgs/"
        t0 = time.perf_counter()
        listed = len(ImageFolderSource(url, so).list_items())
        list_s = time.perf_counter() - t0
        root = Path(tempfile.mkdtemp(prefix="skb", dir="/tmp"))  # Ray's socket paths must stay short
        cluster = RayCluster(root, node_env(env))
        try:
            cluster.start()
            os.environ.update(RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
            t0 = time.perf_counter()
            ray_info = shardkit.pack(url, "s3://bench/ray", shard_bytes=shard_bytes, labels_from_dirs=True,
                                     engine="ray", ray_address=cluster.address, storage_options=so, progress=False)
            ray_s = time.perf_counter() - t0
            nodes = {("head" if n == cluster.head.node_id else "worker" if n == cluster.worker.node_id else n): c
                     for n, c in ray_info["nodes"].items()}
        finally:
            import ray

            if ray.is_initialized():
                ray.shutdown()
            cluster.stop()
        t0 = time.perf_counter()
        shardkit.pack(str(folder), "s3://bench/local", shard_bytes=shard_bytes, labels_from_dirs=True, engine="local",
                      storage_options=so, progress=False)
        local_s = time.perf_counter() - t0
        identical = same("s3://bench/ray", "s3://bench/local", so)
        t0 = time.perf_counter()  # the same objects read by this one process: what reading from S3 costs
        shardkit.pack(url, "s3://bench/local-s3", shard_bytes=shard_bytes, labels_from_dirs=True, engine="local",
                      storage_options=so, progress=False)
        local_s3_s = time.perf_counter() - t0
        identical_s3 = same("s3://bench/local-s3", "s3://bench/local", so)
    load = os.getloadavg()
    row = {"images": args.images, "side": args.side, "image_mb": round(image_bytes / 1e6, 1), "shard_bytes": shard_bytes,
           "make_images_s": round(make_s, 1), "upload_s": round(put_s, 1), "listed": listed, "list_s": round(list_s, 2),
           "ray_2_nodes_s": round(ray_s, 1), "first_task_s": round(first["first"] - first["made"], 2),
           "tasks": ray_info["tasks"], "nodes": nodes, "local_engine_from_disk_s": round(local_s, 1),
           "local_engine_from_s3_s": round(local_s3_s, 1), "identical": identical,
           "local_from_s3_identical": identical_s3, "load_average_end": [round(x, 1) for x in load]}
    print(json.dumps(row, indent=1))
    print("| images | MB | listing s | Ray, 2 nodes, from S3: s | first task planned s | tasks (head/worker) | "
          "local engine, from S3: s | local engine, from disk: s | identical |")
    print("|---:|---:|---:|---:|---:|---|---:|---:|---|")
    print(f"| {args.images:,} | {row['image_mb']} | {row['list_s']} | {row['ray_2_nodes_s']} | {row['first_task_s']} | "
          f"{row['tasks']} ({nodes.get('head', 0)}/{nodes.get('worker', 0)}) | {row['local_engine_from_s3_s']} | "
          f"{row['local_engine_from_disk_s']} | {all(identical.values()) and all(identical_s3.values())} |")
    out = REPO / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "cluster_pack.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
