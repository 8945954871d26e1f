"""A ~300 MB array sample (packed from HDF5) on SeaweedFS: partial row reads move only the
rows' bytes and the rest of the 1 MiB blocks they lie in (each block checked), parallel whole-sample reads are exact, and reading through the cache memmap
keeps peak RSS far below the sample size (measured in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit

pytestmark = [pytest.mark.s3, pytest.mark.slow]

SHAPE = (2400, 256, 128)  # float32: 314,572,800 bytes
ROW_BYTES = 256 * 128 * 4
BLOCK = 2**20  # rows are read in whole blocks of the sample, to check them against its block checksums
RSS_BOUND = 64 * 2**20  # peak RSS rise allowed for reading through the cache memmap


def _rows(a: int, b: int) -> np.ndarray:
    """Rows a..b of the big array, computed (the test never holds all 300 MB at once)."""
    r = np.arange(a, b, dtype=np.float32)[:, None, None]
    j = np.arange(256, dtype=np.float32)[None, :, None]
    k = np.arange(128, dtype=np.float32)[None, None, :]
    return r * 1000.0 + j * 0.5 + k * 0.001


@pytest.fixture(scope="module")
def big(s3_server: Any, tmp_path_factory: Any) -> Any:
    """(url, options, index of the big sample) for a dataset packed with Hdf5Source."""
    import h5py

    from shardkit.packing.sources.hdf5 import Hdf5Source

    h5 = tmp_path_factory.mktemp("h5") / "vol.h5"
    with h5py.File(h5, "w") as f:
        d = f.create_dataset("big", shape=SHAPE, dtype=np.float32, chunks=(100, 256, 128))
        for a in range(0, SHAPE[0], 400):
            d[a:a + 400] = _rows(a, a + 400)
        f.create_dataset("small", data=np.arange(30, dtype=np.int16).reshape(10, 3))
    bucket = f"big-{uuid.uuid4().hex[:12]}"
    fs = s3_server.filesystem()
    fs.mkdir(bucket)
    url = f"s3://{bucket}/ds"
    opts = s3_server.storage_options()
    shardkit.pack(Hdf5Source(h5), url, shard_bytes="64MB", storage_options=opts, progress=False)
    h5.unlink()
    keys = shardkit.open_dataset(url, opts).samples.column("key").to_pylist()
    index = next(i for i, k in enumerate(keys) if "big" in k)
    yield url, opts, index
    try:
        fs.rm(bucket, recursive=True)
    except OSError:
        pass


def test_row_slice_moves_about_the_slice(big: Any) -> None:
    url, opts, i = big
    ds = shardkit.ShardDataset(url, storage_options=opts, part_size="16MB", concurrency=8)
    hdr = ds.npy_header(i)
    assert hdr.shape == SHAPE and hdr.dtype == np.float32 and not hdr.fortran
    before = ds.stats()["bytes_fetched"]
    got = ds.read_array(i, rows=slice(1000, 1300))  # ~39 MB: three parallel parts
    moved = ds.stats()["bytes_fetched"] - before
    np.testing.assert_array_equal(got, _rows(1000, 1300))
    assert 300 * ROW_BYTES <= moved <= 300 * ROW_BYTES + 2 * BLOCK, moved
    before = ds.stats()["bytes_fetched"]
    one = ds.read_array(i, rows=7)  # header cached: the one or two blocks holding the row move
    assert ROW_BYTES < ds.stats()["bytes_fetched"] - before <= 2 * BLOCK
    np.testing.assert_array_equal(one, _rows(7, 8)[0])
    strided = ds.read_array(i, rows=slice(10, 20, 3))
    np.testing.assert_array_equal(strided, _rows(10, 20)[::3])
    for far in (slice(0, 2400, 800), slice(2000, 99, -950)):  # rows ~100 MB apart: each read alone
        before = ds.stats()["bytes_fetched"]
        got = ds.read_array(i, rows=far)
        picked = range(*far.indices(SHAPE[0]))
        np.testing.assert_array_equal(got, np.stack([_rows(r, r + 1)[0] for r in picked]))
        assert ds.stats()["bytes_fetched"] - before <= len(picked) * 2 * BLOCK  # was the ~200 MB between them
    with pytest.raises(IndexError, match="row 2400 out of range for 2400 rows"):
        ds.read_array(i, rows=2400)


def test_whole_sample_parallel_get_is_exact(big: Any) -> None:
    url, opts, i = big
    ds = shardkit.ShardDataset(url, storage_options=opts, decode="numpy", part_size="16MB", concurrency=8)
    s = ds[i]  # checksum verified over all ~300 MB before returning
    arr = s["npy"]
    assert arr.shape == SHAPE and arr.dtype == np.float32
    for a in (0, 1111, 2399):
        np.testing.assert_array_equal(arr[a:a + 1], _rows(a, a + 1))
    st = ds.stats()
    assert st["requests"] >= 18  # 300 MB in 16 MB parts
    assert np.prod(SHAPE) * 4 <= st["bytes_fetched"] <= np.prod(SHAPE) * 4 + 4096


_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import shardkit

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    url, cache_dir, i = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ds = shardkit.ShardDataset(url, cache_dir=cache_dir, decode="numpy")
    try:
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak to the current RSS
    except OSError:
        pass
    base = hwm()
    part = ds.read_array(i, rows=slice(1000, 1100))          # ~13 MB slice of the memmap
    total = float(part.sum())
    s = ds[i]                                                # whole sample, zero-copy
    total += float(s["npy"][2000:2050].sum())
    print(json.dumps({"base": base, "peak": hwm(), "bytes": ds.stats()["bytes_fetched"],
                      "writeable": bool(s["npy"].flags.writeable), "sum": total}))
""")


def test_cached_read_peak_rss_stays_small(big: Any, tmp_path: Path, s3_server: Any) -> None:
    url, opts, i = big
    cache_dir = tmp_path / "cache"
    warm = shardkit.ShardDataset(url, cache_dir=cache_dir, storage_options=opts, cache_shards=True)
    np.testing.assert_array_equal(warm.read_array(i, rows=3), _rows(3, 4)[0])  # downloads the shard
    warm.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env())
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", _CHILD, url, str(cache_dir), str(i)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    rise = res["peak"] - res["base"]
    assert res["bytes"] == 0  # served from the cache, nothing fetched
    assert not res["writeable"]
    assert rise < RSS_BOUND, f"peak RSS rose {rise / 2**20:.1f} MiB reading a 300 MB sample through the cache"
