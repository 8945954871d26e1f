"""Ray and local engines give the same dataset: real local Ray, real SeaweedFS.

Also home of the small helpers the other pack tests import (``compare_datasets`` ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.dev.sampledata import make_image_folder

pytestmark = [pytest.mark.s3, pytest.mark.ray]


def image_folder(root: Path, count: int = 60, side: int = 160, seed: int = 0) -> Path:
    """``count`` real JPEGs (crops of bundled photos) in an ImageFolder; >= 3 classes."""
    return make_image_folder(root, count, side=side, quality=85, seed=seed)


def make_hdf5(path: Path, big_mb: int = 40) -> Path:
    """Several datasets: one of ``big_mb`` MB (streamed), small ones, rows for rows mode."""
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        n = big_mb * 10**6 // 4 // 1024
        big = f.create_dataset("volumes/big", shape=(n, 1024), dtype="float32", chunks=(256, 1024))
        for start in range(0, n, 2048):
            stop = min(n, start + 2048)
            big[start:stop] = np.arange(start * 1024, stop * 1024, dtype=np.float32).reshape(-1, 1024)
        big.attrs["units"] = "mm"
        f.create_dataset("small/a", data=rng.integers(0, 255, (64, 64), dtype=np.uint8))
        f.create_dataset("small/b", data=rng.standard_normal((10, 3)).astype(np.float64))
        f.create_dataset("images", data=rng.integers(0, 255, (40, 32, 32, 3), dtype=np.uint8), chunks=(4, 32, 32, 3))
        f.create_dataset("labels", data=np.arange(40, dtype=np.int64))
    return path


def list_objects(ds: Any) -> dict[str, bytes]:
    """Every shard file of an opened dataset: relative path -> bytes."""
    return {p: ds.store.read_bytes(p) for p in ds.shards.column("path").to_pylist()}


def compare_datasets(url_a: str, url_b: str, opts: dict[str, Any] | None = None,
                     ignore_info: tuple[str, ...] = ("created", "pack")) -> tuple[Any, Any]:
    """Assert two datasets hold byte-identical shards and equal manifests; returns both."""
    a = shardkit.open_dataset(url_a, storage_options=opts)
    b = shardkit.open_dataset(url_b, storage_options=opts)
    assert a.shards.equals(b.shards)
    assert a.samples.equals(b.samples)
    assert list_objects(a) == list_objects(b)
    ia = {k: v for k, v in a.info.items() if k not in ignore_info}
    ib = {k: v for k, v in b.info.items() if k not in ignore_info}
    assert ia == ib
    if "pack" in ignore_info:
        pa_, pb_ = dict(a.info["pack"]), dict(b.info["pack"])
        pa_.pop("engine"), pb_.pop("engine")
        assert pa_ == pb_
    return a, b


def _pack_both(src: Any, bucket: str, opts: dict[str, Any], **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    ray_info = shardkit.pack(src, f"{bucket}/ray", engine="ray", storage_options=opts, progress=False, **kw)
    local_info = shardkit.pack(src, f"{bucket}/local", engine="local", storage_options=opts, progress=False, **kw)
    return ray_info, local_info


def test_imagefolder_ray_equals_local(tmp_path, ray_local, s3_server, s3_bucket):
    src = image_folder(tmp_path / "imgs")
    opts = s3_server.storage_options()
    total = sum(p.stat().st_size for p in src.rglob("*.jpg"))
    shard_bytes = total // 10
    ray_info, local_info = _pack_both(str(src), s3_bucket, opts, shard_bytes=shard_bytes, labels_from_dirs=True)
    assert ray_info["tasks"] >= 4 and ray_info["num_shards"] >= 4
    assert ray_info["pack"]["engine"] == "ray" and local_info["pack"]["engine"] == "local"
    # where the tasks ran: the one node of the local Ray packed them all
    assert list(ray_info["nodes"].values()) == [ray_info["tasks"]] and "nodes" not in local_info
    a, _ = compare_datasets(f"{s3_bucket}/ray", f"{s3_bucket}/local", opts)
    assert a.num_samples == 60 and len(a.labels) >= 3
    a.verify(deep=True)
    got = {s["__key__"]: bytes(s["jpg"]) for s in a.iter_samples()}
    want = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*.jpg")}
    assert sorted(got.values()) == sorted(want.values())
    # no leftovers of the pack machinery once committed
    fs = s3_server.filesystem()
    assert not fs.exists(f"{s3_bucket[5:]}/ray/_pack/plan.json")


@pytest.mark.parametrize("rows", [None, "images,labels"], ids=["datasets", "rows"])
def test_hdf5_ray_equals_local(tmp_path, ray_local, s3_server, s3_bucket, rows):
    src = make_hdf5(tmp_path / "vol.h5")
    opts = s3_server.storage_options()
    ray_info, local_info = _pack_both(str(src), s3_bucket, opts, shard_bytes="2MB" if rows is None else "16KB",
                                      hdf5_rows=rows)
    a, _ = compare_datasets(f"{s3_bucket}/ray", f"{s3_bucket}/local", opts)
    a.verify(deep=True)
    if rows is None:
        assert a.num_samples == 5
        big = [r for r in a.samples.to_pylist() if "big" in r["key"]][0]
        assert big["attr_units"] == "mm" and big["size"] > 39 * 10**6
        sample = next(s for s in a.iter_samples(decode="numpy") if "big" in s["__key__"])
        arr = sample["npy"]
        assert arr.dtype == np.float32 and arr.shape[1] == 1024
        assert arr[3, 5] == 3 * 1024 + 5 and arr[-1, -1] == arr.size - 1
    else:
        assert a.num_samples == 40 and ray_info["tasks"] >= 4
        s = next(a.iter_samples(decode="numpy"))
        assert s["images.npy"].shape == (32, 32, 3) and int(s["labels.npy"]) == 0
    assert a.info["source"] == local_info["source"]


# -- ray job submit against a real head ---------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_head(temp_dir: Path) -> None:
    """Stop the head this test started, by PID: its processes name its unique temp dir.

    Never ``ray stop``: that kills every Ray on the machine (the session's local Ray and
    anyone else's), not only ours.
    """
    import os
    import signal
    import time

    def ours() -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if str(temp_dir).encode() in f.read():
                            pids.append(int(entry))
                except OSError:
                    pass
        return pids

    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for pid in ours():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while ours() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not ours():
            return


@pytest.mark.slow
def test_ray_job_submit(tmp_path, s3_server, s3_bucket):
    """``ray start --head`` + ``ray job submit ... python ray_jobs/pack.py SRC DEST``."""
    import os
    import shutil
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[2]
    venv_bin = Path(sys.executable).parent
    ray_cli = venv_bin / "ray"
    if not ray_cli.exists():
        pytest.fail("the 'ray' CLI is missing from the environment (pip install 'ray[default]')")
    src = image_folder(tmp_path / "imgs", count=40, side=96)
    port, dash = _free_port(), _free_port()
    # Ray's socket paths must stay short.
    temp_dir = Path("/tmp") / f"skray{os.getpid()}{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "AWS_"))}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}")
    start = [str(ray_cli), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--temp-dir={temp_dir}", "--num-cpus=2",
             "--include-dashboard=true", "--disable-usage-stats",
             f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
             f"--min-worker-port={20000 + port % 1000 * 10}", f"--max-worker-port={20009 + port % 1000 * 10}"]
    try:
        started = subprocess.run(start, env=env, capture_output=True, timeout=90, cwd=tmp_path)
        assert started.returncode == 0, started.stderr.decode()[-3000:]
        # The working dir is a checkout's code only (this repo also holds GBs of benchmark data).
        workdir = tmp_path / "checkout"
        for part in ("shardkit", "ray_jobs"):
            shutil.copytree(repo / part, workdir / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        shutil.copy(repo / "pyproject.toml", workdir / "pyproject.toml")
        runtime_env = {"excludes": ["__pycache__"], "env_vars": {**s3_server.env(), "PYTHONPATH": "."}}
        import json

        submit = [str(ray_cli), "job", "submit", "--address", f"http://127.0.0.1:{dash}",
                  "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env), "--",
                  "python", "ray_jobs/pack.py", str(src), f"{s3_bucket}/ds", "--labels-from-dirs",
                  "--shard-size", "50KB", "--quiet"]
        t0 = time.monotonic()
        job = subprocess.run(submit, env=env, capture_output=True, timeout=120, cwd=workdir)
        out = job.stdout.decode() + job.stderr.decode()
        assert job.returncode == 0, out[-4000:]
        assert "packed 40 samples" in out and "succeeded" in out, out[-4000:]
        assert time.monotonic() - t0 < 90
    finally:
        _stop_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    ds = shardkit.open_dataset(f"{s3_bucket}/ds", storage_options=s3_server.storage_options())
    assert ds.num_samples == 40 and ds.info["pack"]["engine"] == "ray" and ds.num_shards > 1
    ds.verify(deep=True)


# -- memory bound on 300 MB samples -------------------------------------------------------------

_MEASURE = r"""
import json, sys
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
import boto3, h5py, numpy, pyarrow, pyarrow.parquet, s3fs, xxhash, shardkit.packing.pack, shardkit.packing.sources.hdf5
try:  # pyarrow imports pandas on its first conversion when it is installed (ray[data] and datasets bring it)
    import pandas
except ImportError:
    pass
base = hwm()
info = shardkit.packing.pack.pack(sys.argv[1], sys.argv[2], shard_bytes="400MB", engine="local", progress=False)
print(json.dumps({"baseline": base, "peak": hwm(), "samples": info["num_samples"], "bytes": info["total_bytes"]}))
"""


@pytest.mark.slow
def test_pack_300mb_samples_bounded_memory(tmp_path, s3_server, s3_bucket):
    """Packing two ~300 MB HDF5 samples to S3 keeps peak RSS < import baseline + 150 MB.

    The bound: the HDF5 reader streams 8 MiB slabs (one reused buffer + the bytes object it
    yields, ~16 MiB), h5py's chunk cache is 32 MiB, the writer holds up to three 8 MiB part
    buffers (filling, two uploading side by side, reused as spares) and each upload its
    connection's buffers, the boto3 client's service model ~20 MB (boto3 itself is imported in
    the baseline, like s3fs and pandas), and interpreter/allocator slack: ~130 MB measured here
    (with one 16 MiB part uploading at a time, as with two 8 MiB ones). A 300 MB sample held
    whole anywhere would blow through it.
    """
    h5py = pytest.importorskip("h5py")
    import os
    import subprocess
    import sys

    import numpy as np

    path = tmp_path / "big.h5"
    rows = 300 * 10**6 // (1024 * 1024 * 4)  # ~300 MB of float32 per dataset
    with h5py.File(path, "w") as f:
        for name in ("a", "b"):
            d = f.create_dataset(name, shape=(rows, 1024, 1024), dtype="float32", chunks=(2, 1024, 1024))
            block = np.ones((2, 1024, 1024), dtype=np.float32)
            for i in range(0, rows, 2):
                d[i:i + 2] = block[: min(2, rows - i)] * i
    env = {**os.environ, **s3_server.env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    res = subprocess.run([sys.executable, "-c", _MEASURE, str(path), f"{s3_bucket}/big"], env=env,
                         capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    got = json.loads(res.stdout.decode().strip().splitlines()[-1])
    assert got["samples"] == 2 and got["bytes"] > 2 * 290 * 10**6
    grown = (got["peak"] - got["baseline"]) / 10**6
    assert grown < 150, f"peak RSS grew {grown:.0f} MB over the import baseline (bound 150 MB)"
    ds = shardkit.open_dataset(f"{s3_bucket}/big", storage_options=s3_server.storage_options())
    ds.verify()


def test_unreachable_ray_address_fails_at_once(tmp_path):
    """``--ray-address host:port`` with nothing listening: one line naming it, in seconds, not
    Ray's ~14 minutes of GCS retries (a subprocess: this session's Ray may be initialised)."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from shardkit.errors import ShardkitError
    from shardkit.packing.engines.ray import probe_ray_address

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("x")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "shardkit.cli", "pack", str(src), str(tmp_path / "ds"), "--engine", "ray",
                        "--ray-address", f"127.0.0.1:{port}", "--quiet"],
                       capture_output=True, text=True, env=env, cwd=repo, timeout=120)
    assert time.monotonic() - started < 60
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "Traceback" not in r.stderr, r.stderr
    with pytest.raises(ShardkitError, match=f"ray://127.0.0.1:{port}"):
        probe_ray_address(f"ray://127.0.0.1:{port}")
    for left_to_ray in ("local", "auto", "ray://auto"):
        probe_ray_address(left_to_ray)
    with socket.socket() as server:  # something listening: passes
        server.bind(("127.0.0.1", 0))
        server.listen()
        probe_ray_address(f"127.0.0.1:{server.getsockname()[1]}")
