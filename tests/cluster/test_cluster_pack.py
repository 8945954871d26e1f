"""Packing on a real two-node Ray cluster: ``ray job submit``, a killed worker node, a killed driver.

The cluster is two ``ray start`` nodes on 127.0.0.1 (:mod:`raycluster`), the storage the
session's SeaweedFS. Where a test needs tasks at a known point (on both nodes at once, or
mid-pack when something is killed) their loads wait at a :class:`gate.Gate`; the output is
always compared byte for byte with the local engine's pack of the same folder.

The worker-node kill is the module's last test: the cluster has one node after it.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import shardkit
from shardkit.packing.sources import ImageFolderSource

from gate import marked_nodes  # tests/cluster and tests/pack, on sys.path by conftest
from raycluster import RayCluster
from test_pack_ray import compare_datasets, image_folder, list_objects

pytestmark = [pytest.mark.s3, pytest.mark.ray, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _driver_env(cluster: RayCluster, s3_server: Any, **gate: str) -> dict[str, str]:
    """A driver on the cluster's head (``RAY_ADDRESS``), with S3's endpoint and the gate's settings."""
    return {**cluster.env, **s3_server.env(), "RAY_ADDRESS": cluster.address,
            **{f"SK_GATE_{k.upper()}": v for k, v in gate.items()}}


def _wait(what: str, ready: Any, proc: subprocess.Popen[bytes] | None = None, timeout: float = 60.0) -> None:
    """Wait (bounded) until ``ready()``; fail naming ``what`` and the driver's output if it ended."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the driver ended (exit {proc.returncode}) before {what}: {(out + err).decode()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"not seen within {timeout:.0f}s: {what}")
        time.sleep(0.05)


def _local_pack(src: Path, dest: str, opts: dict[str, Any], shard: int) -> None:
    shardkit.pack(str(src), dest, shard_bytes=shard, labels_from_dirs=True, engine="local", storage_options=opts,
                  progress=False)


def test_job_submit_runs_on_both_nodes_identical_to_local(tmp_path, ray_cluster, s3_server, s3_bucket):
    """``ray job submit ... python gated_pack.py SRC DEST`` (ray_jobs/pack.py with its loads
    held until tasks on both nodes reached them): the summary names both nodes, and the dataset
    is byte-identical to the local engine's."""
    src = image_folder(tmp_path / "imgs", count=40, side=96)
    shard = sum(p.stat().st_size for p in src.rglob("*.jpg")) // 8
    marks = tmp_path / "marks"
    marks.mkdir()
    # The job's working dir: a checkout's code (the repository also holds benchmark data).
    workdir = tmp_path / "checkout"
    for part in ("shardkit", "ray_jobs"):
        shutil.copytree(REPO / part, workdir / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for f in (REPO / "pyproject.toml", HERE / "gate.py", HERE / "gated_pack.py"):
        shutil.copy(f, workdir / f.name)
    runtime_env = {"excludes": ["__pycache__"],
                   "env_vars": {**s3_server.env(), "PYTHONPATH": ".", "SK_GATE_MARKS": str(marks),
                                "SK_GATE_NODES": "2"}}
    submit = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", ray_cluster.dashboard,
              "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env), "--",
              "python", "gated_pack.py", str(src), f"{s3_bucket}/ray", "--labels-from-dirs", "--shard-size",
              str(shard), "--quiet"]
    job = subprocess.run(submit, env=ray_cluster.env, capture_output=True, timeout=180, cwd=workdir)
    out = job.stdout.decode() + job.stderr.decode()
    assert job.returncode == 0 and "succeeded" in out, out[-4000:]
    assert "packed 40 samples" in out, out[-4000:]
    head, worker = ray_cluster.head.node_id, ray_cluster.worker.node_id
    assert marked_nodes(marks) == {head, worker}
    line = next(ln for ln in out.splitlines() if ln.startswith("ran on "))
    assert line.startswith("ran on 2 Ray nodes: ") and head[:8] in line and worker[:8] in line, line

    opts = s3_server.storage_options()
    _local_pack(src, f"{s3_bucket}/local", opts, shard)
    a, _ = compare_datasets(f"{s3_bucket}/ray", f"{s3_bucket}/local", opts)
    assert a.num_samples == 40 and a.num_shards >= 4 and a.info["pack"]["engine"] == "ray"
    a.verify(deep=True)


def test_killed_driver_rerun_completes_identical(tmp_path, ray_cluster, s3_server, s3_bucket):
    """SIGKILL a driver on the cluster once its first tasks are committed to storage and later
    ones are mid-load; a plain rerun of ray_jobs/pack.py reuses the finished tasks and the
    dataset is byte-identical to the local engine's."""
    src = image_folder(tmp_path / "imgs", count=60, side=64)
    shard = sum(p.stat().st_size for p in src.rglob("*.jpg")) // 12
    dest = f"{s3_bucket}/ray"
    marks, flag = tmp_path / "marks", tmp_path / "hold"
    marks.mkdir()
    flag.touch()
    args = [str(src), dest, "--labels-from-dirs", "--shard-size", str(shard)]
    env = _driver_env(ray_cluster, s3_server, marks=str(marks), flag=str(flag), held_from="30")
    fs = s3_server.filesystem()

    def fragments() -> int:
        try:
            return len(fs.ls(f"{dest[5:]}/manifest", refresh=True))
        except FileNotFoundError:
            return 0

    driver = subprocess.Popen([sys.executable, str(HERE / "gated_pack.py"), *args, "--quiet"], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait("a finished task's fragment and a held load", lambda: fragments() >= 1 and marked_nodes(marks), driver)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.communicate()
        flag.unlink()
    assert not fs.exists(f"{dest[5:]}/dataset.json")

    env.pop("SK_GATE_FLAG")
    rerun = subprocess.run([sys.executable, str(REPO / "ray_jobs" / "pack.py"), *args, "--json"],
                           env=env, cwd=REPO, capture_output=True, timeout=180)
    assert rerun.returncode == 0, rerun.stderr.decode()[-3000:]
    info = json.loads(rerun.stdout)  # stdout is the JSON alone, whatever Ray printed
    assert 0 < info["reused_tasks"] < info["tasks"], info
    assert sum(info["nodes"].values()) == info["tasks"] - info["reused_tasks"]

    opts = s3_server.storage_options()
    _local_pack(src, f"{s3_bucket}/local", opts, shard)
    a, _ = compare_datasets(dest, f"{s3_bucket}/local", opts)
    assert a.num_samples == 60
    a.verify(deep=True)


def _put_tree(s3_server: Any, local: Path, url: str) -> None:
    """Upload every file under ``local`` to the prefix ``url``, 10 PUTs at once (the client's pool)."""
    from concurrent.futures import ThreadPoolExecutor

    from shardkit.storage.store import Store

    client = Store(url, s3_server.storage_options()).boto3_client()
    bucket, _, prefix = url[5:].partition("/")
    files = [p for p in sorted(local.rglob("*")) if p.is_file()]

    def put(path: Path) -> None:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(local).as_posix()}", Body=path.read_bytes())

    with ThreadPoolExecutor(10) as pool:
        list(pool.map(put, files))


def _same_but_source(a_url: str, b_url: str, opts: dict[str, Any]) -> Any:
    """Byte-identical shards and shard rows, equal sample rows but for ``source`` (where each
    sample came from: a URL on one side, a path on the other)."""
    a = shardkit.open_dataset(a_url, storage_options=opts)
    b = shardkit.open_dataset(b_url, storage_options=opts)
    assert a.shards.equals(b.shards) and list_objects(a) == list_objects(b)
    assert a.samples.drop_columns(["source"]).equals(b.samples.drop_columns(["source"]))
    return a


def test_sources_in_s3_pack_on_both_nodes_identical_to_local_disk(tmp_path, ray_cluster, s3_server, s3_bucket):
    """The must-show of packing from object storage on a real cluster: an ImageFolder of 1,000
    objects (one per image), a file list of URLs, an HDF5 file and a Zarr group, each in
    SeaweedFS, packed by the Ray engine of a driver on the 2-node cluster with tasks on both
    nodes (each pack's loads held until both nodes reached them), byte-identical to the local
    engine's pack of the same input from local disk. (20,000 objects: benchmarks/bench_cluster_pack.py.)"""
    import h5py
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zarr

    opts = s3_server.storage_options()
    raw = f"{s3_bucket}/raw"
    imgs = image_folder(tmp_path / "imgs", count=1000, side=24)
    _put_tree(s3_server, imgs, f"{raw}/imgs")
    listed = image_folder(tmp_path / "listed", count=60, side=48, seed=3)
    _put_tree(s3_server, listed, f"{raw}/listed")
    files = sorted(p.relative_to(listed).as_posix() for p in listed.rglob("*.jpg"))
    keys = [f.replace("/", "_").rsplit(".", 1)[0] for f in files]
    pq.write_table(pa.table({"path": [str(listed / f) for f in files], "key": keys}), tmp_path / "disk.parquet")
    data = tmp_path / "data"  # what goes to S3 beside the images: the URL list, the HDF5 file, the Zarr group
    data.mkdir()
    (data / "urls.csv").write_text("path,key\n" + "".join(f"{raw}/listed/{f},{k}\n" for f, k in zip(files, keys)))
    rng = np.random.default_rng(0)
    with h5py.File(data / "vol.h5", "w") as f:
        f.create_dataset("images", data=rng.integers(0, 255, (30, 8, 8), dtype=np.uint8), chunks=(4, 8, 8),
                         compression="gzip")
        f.create_dataset("labels", data=np.arange(30, dtype=np.int64))
    group = zarr.open_group(str(data / "cube.zarr"), mode="w")
    group.create_array("x", shape=(40, 16), chunks=(7, 16), dtype="<f4")[:] = rng.standard_normal((40, 16))
    group.create_array("y", shape=(40,), chunks=(16,), dtype="<i8")[:] = np.arange(40) * 7
    _put_tree(s3_server, data, raw)
    image_bytes = sum(p.stat().st_size for p in imgs.rglob("*.jpg"))
    one_shard_a_task = {"task_bytes": "1"}
    packs: dict[str, tuple[str, str, dict[str, Any]]] = {  # name: (source in S3, the same on disk, options)
        "imagefolder": (f"{raw}/imgs/", str(imgs), {"labels_from_dirs": True, "shard_bytes": image_bytes // 12}),
        "filelist": (f"{raw}/urls.csv", str(tmp_path / "disk.parquet"), {"shard_bytes": "24KB", **one_shard_a_task}),
        "hdf5": (f"{raw}/vol.h5", str(data / "vol.h5"), {"hdf5_rows": "images,labels", "shard_samples": 6,
                                                          **one_shard_a_task}),
        "zarr": (f"{raw}/cube.zarr", str(data / "cube.zarr"), {"zarr_rows": "x,y", "shard_samples": 8,
                                                                **one_shard_a_task}),
    }
    specs = []
    for name, (remote, local, kw) in packs.items():
        (tmp_path / f"marks-{name}").mkdir()
        specs.append({"source": remote, "dest": f"{s3_bucket}/ray-{name}", "marks": str(tmp_path / f"marks-{name}"),
                      **kw})
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    driver = subprocess.run([sys.executable, str(HERE / "pack_many.py"), str(tmp_path / "specs.json")],
                            env=_driver_env(ray_cluster, s3_server), cwd=REPO, capture_output=True, timeout=300)
    assert driver.returncode == 0, driver.stderr.decode()[-3000:]
    summaries = dict(zip(packs, json.loads(driver.stdout.decode().strip().splitlines()[-1])))
    head, worker = ray_cluster.head.node_id, ray_cluster.worker.node_id
    for name, (remote, local, kw) in packs.items():
        info = summaries[name]
        assert set(info["nodes"]) == {head, worker}, (name, info)
        assert sum(info["nodes"].values()) == info["tasks"] >= 4, (name, info)
        shardkit.pack(local, f"{s3_bucket}/local-{name}", engine="local", storage_options=opts, progress=False, **kw)
        a = _same_but_source(f"{s3_bucket}/ray-{name}", f"{s3_bucket}/local-{name}", opts)
        assert a.num_samples == {"imagefolder": 1000, "filelist": 60, "hdf5": 30, "zarr": 40}[name]
    # An ImageFolder's source column holds the same relative paths on both sides, and the labels agree.
    a, b = (shardkit.open_dataset(f"{s3_bucket}/{side}-imagefolder", storage_options=opts) for side in ("ray", "local"))
    assert a.samples.equals(b.samples) and a.info["labels"] == b.info["labels"] and len(a.info["labels"]) >= 3


def test_killed_worker_node_tasks_redone_on_head(tmp_path, ray_cluster, s3_server, s3_bucket):
    """With a task of the pack mid-load on each node, SIGKILL the worker node's raylet and its
    workers (every process of its session): Ray retries the lost task on the head, the pack
    completes with every task packed there, byte-identical to the local engine's."""
    src = image_folder(tmp_path / "imgs", count=40, side=64)
    shard = sum(p.stat().st_size for p in src.rglob("*.jpg")) // 8
    dest = f"{s3_bucket}/ray"
    marks, flag = tmp_path / "marks", tmp_path / "hold"
    marks.mkdir()
    flag.touch()
    head, worker = ray_cluster.head.node_id, ray_cluster.worker.node_id
    env = _driver_env(ray_cluster, s3_server, marks=str(marks), flag=str(flag))
    driver = subprocess.Popen([sys.executable, str(HERE / "gated_pack.py"), str(src), dest, "--labels-from-dirs",
                               "--shard-size", str(shard), "--json"], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait("a task held on each node", lambda: marked_nodes(marks) == {head, worker}, driver)
        ray_cluster.kill(ray_cluster.worker)
        flag.unlink()
        out, err = driver.communicate(timeout=180)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    assert driver.returncode == 0, err.decode()[-3000:]
    info = json.loads(out)  # the JSON alone, though Ray printed the node's death and new workers
    assert info["num_samples"] == 40 and info["reused_tasks"] == 0
    assert info["nodes"] == {head: info["tasks"]}, info["nodes"]  # the lost task too

    opts = s3_server.storage_options()
    _local_pack(src, f"{s3_bucket}/local", opts, shard)
    a, _ = compare_datasets(dest, f"{s3_bucket}/local", opts)
    assert sorted(a.samples.column("key").to_pylist()) == sorted(it.key for it in ImageFolderSource(src).list_items())
    a.verify(deep=True)
