"""Large samples (~300 MB float32 arrays): h5py (advised and default), np.load, shardkit.

Reuses benchmarks/bench_large.py's generator when it is there (its arrays have a fixed
shape of ~300 MB), else makes arrays of ``size_mb`` itself. One process, samples read whole,
each reduced with ``sum()`` so lazily mapped data is really read. shardkit rows need
``shardkit.ShardDataset``; without it they are reported "not available".
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from benchmarks.common import failed_row, row  # noqa: E402
from benchmarks.peers._base import finish, guarded, load_config  # noqa: E402

TOOLS = {"h5py": "h5py", "np": "numpy", "sk": "shardkit"}


def inputs(root: Path, n: int, size_mb: int) -> tuple[list[Path], Path, Path, int]:
    """(npy files, advised .h5, default .h5, bytes per sample)."""
    try:
        from benchmarks import bench_large

        npys, advised, default = bench_large.write_inputs(root, n)
        return npys, advised, default, int(bench_large.NBYTES)
    except ImportError:
        pass
    import h5py

    rows_ = max(4, size_mb * 2**20 // (256 * 128 * 4))
    shape = (rows_, 256, 128)
    npys, advised, default = [], root / "advised.h5", root / "default.h5"
    with h5py.File(advised, "w") as fa, h5py.File(default, "w") as fd:
        for k in range(n):
            arr = np.random.default_rng(k).random(shape, dtype=np.float32)
            p = root / f"s{k}.npy"
            np.save(p, arr)
            npys.append(p)
            fa.create_dataset(f"s{k}", data=arr, chunks=(rows_ // 4, 256, 128))
            fd.create_dataset(f"s{k}", data=arr)
    return npys, advised, default, int(np.prod(shape)) * 4


def timed_rows(name: str, tool: str, n: int, size: int, fn: Callable[[int], np.ndarray]) -> dict[str, Any]:
    t0 = time.perf_counter()
    for k in range(n):
        arr = fn(k)
        float(arr.sum())
        del arr
    return row(name, "large", tool, samples=n, seconds=time.perf_counter() - t0, nbytes=n * size)


def main() -> None:
    import h5py

    import shardkit

    cfg = load_config()
    n, work = int(cfg["count"]), Path(cfg["work"])
    rows: list[dict[str, Any]] = []
    npys, advised, default, size = inputs(work, n, int(cfg["size_mb"]))

    def h5(path: Path, **kw: Any) -> Callable[[int], np.ndarray]:
        f = h5py.File(path, "r", **kw)
        return lambda k: f[f"s{k}"][...]

    nm = "h5py, quarter-sample chunks + 1 GiB cache"
    guarded(rows, nm, "large", "h5py", lambda: timed_rows(nm, "h5py", n, size, h5(advised, rdcc_nbytes=2**30)))
    nm2 = "h5py, default layout and cache"
    guarded(rows, nm2, "large", "h5py", lambda: timed_rows(nm2, "h5py", n, size, h5(default)))
    nm3 = "np.load per sample (page cache)"
    guarded(rows, nm3, "large", "numpy", lambda: timed_rows(nm3, "numpy", n, size, lambda k: np.load(npys[k])))

    cold, warm = "shardkit ShardDataset, cold (S3)", "shardkit ShardDataset, warm (node cache)"
    if not hasattr(shardkit, "ShardDataset") and "ShardDataset" not in getattr(shardkit, "__all__", []):
        rows += [failed_row(x, "large", "shardkit", "shardkit.ShardDataset not available", status="not available")
                 for x in (cold, warm)]
        finish(rows, ["h5py", "numpy", "shardkit"])
        return
    from shardkit.packing.sources.hdf5 import Hdf5Source

    opts = {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "region_name": "us-east-1"}}
    url = f"s3://{cfg['bucket']}/large"
    try:
        t0 = time.perf_counter()
        shardkit.pack(Hdf5Source(default), url, shard_bytes="64MB", storage_options=opts, progress=False,
                      overwrite=True)
        rows.append(row("shardkit pack of the HDF5 file", "pack", "shardkit", kind="pack", samples=n,
                        seconds=time.perf_counter() - t0, nbytes=n * size))
        keys = shardkit.open_dataset(url, opts).samples.column("key").to_pylist()
        order = [next(j for j, key in enumerate(keys) if re.search(rf"_?s{i}(-|$)", key)) for i in range(n)]
    except Exception as exc:  # noqa: BLE001
        rows += [failed_row(x, "large", "shardkit", f"pack: {type(exc).__name__}: {exc}") for x in (cold, warm)]
        finish(rows, ["h5py", "numpy", "shardkit"])
        return
    cache = work / "sk-cache"

    def sk(cache_dir: Path | None, fill: bool = False) -> Callable[[int], np.ndarray]:
        # cold: the first access downloads the sample's shard into the node cache (cache_shards)
        ds = shardkit.ShardDataset(url, cache_dir=cache_dir, storage_options=opts, decode="numpy", cache_shards=fill)
        return lambda k: ds[order[k]]["npy"]

    guarded(rows, cold, "large", "shardkit", lambda: timed_rows(cold, "shardkit", n, size, sk(cache, True)))
    guarded(rows, warm, "large", "shardkit", lambda: timed_rows(warm, "shardkit", n, size, sk(cache)))
    finish(rows, ["h5py", "numpy", "shardkit"])


if __name__ == "__main__":
    main()
