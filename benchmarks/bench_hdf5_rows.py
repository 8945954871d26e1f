"""Packing HDF5 rows (``hdf5_rows``: one sample per row) against the same rows given to
``pack`` as an iterable of dicts (same bytes, same writer) and against h5py reading the rows
one by one (no packing at all), in one run, to a throwaway SeaweedFS.

    .venv/bin/python -m benchmarks.bench_hdf5_rows [--rows 50000]

Data: ``rows`` float32 rows of 64 values in 4096-row chunks plus an int64 label per row.
Prints rows/s per arm and the ratios; writes results/hdf5_rows.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Weed, boto3_client  # noqa: E402


def npy(value: Any) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, value)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=50_000)
    args = ap.parse_args()
    import h5py
    import numpy as np

    import shardkit

    n = args.rows
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 64), dtype=np.float32)
    y = np.arange(n, dtype=np.int64)
    with tempfile.TemporaryDirectory() as tmp, Weed() as server:
        path = os.path.join(tmp, "rows.h5")
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=x, chunks=(4096, 64))
            f.create_dataset("y", data=y)
        os.environ.update(server.env())
        boto3_client(server.env()).create_bucket(Bucket="bench")

        t0 = time.perf_counter()
        with h5py.File(path) as f:
            dx, dy = f["x"], f["y"]
            for i in range(n):
                dx[i], dy[i]
        h5 = time.perf_counter() - t0

        def rows() -> Iterator[dict[str, Any]]:
            for i in range(n):
                yield {"__key__": f"r{i:09d}", "x.npy": npy(x[i]), "y.npy": npy(y[i])}

        t0 = time.perf_counter()
        shardkit.pack(rows(), "s3://bench/iterable", progress=False)
        iterable = time.perf_counter() - t0
        t0 = time.perf_counter()
        info = shardkit.pack(path, "s3://bench/hdf5", hdf5_rows="x,y", progress=False)
        hdf5 = time.perf_counter() - t0
    assert info["num_samples"] == n
    out = {"rows": n, "h5py_rows_per_s": n / h5, "iterable_rows_per_s": n / iterable, "hdf5_rows_per_s": n / hdf5}
    print(f"h5py, rows one by one (no pack)   {n / h5:>10,.0f} rows/s")
    print(f"pack, iterable of the same rows   {n / iterable:>10,.0f} rows/s")
    print(f"pack, hdf5_rows='x,y'             {n / hdf5:>10,.0f} rows/s  "
          f"({iterable / hdf5:.2f}x the iterable, {h5 / hdf5:.2f}x h5py's read)")
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / "hdf5_rows.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
