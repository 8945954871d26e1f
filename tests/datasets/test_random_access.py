"""ShardDataset against SeaweedFS: ranged reads of single samples, by_key, the cache path,
DistributedSampler coverage, partial .npy reads, corruption; and ranged.read_into resume."""

from __future__ import annotations

import io
import pickle
import uuid
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.storage import ranged, resumable
from shardkit.storage import retry as storage
from shardkit.errors import IntegrityError
from shardkit.errors import SampleNotFoundError
from shardkit.storage.store import Store

pytestmark = pytest.mark.s3

N = 40
DTYPES = [np.float32, np.float64, np.int16, np.uint8, np.int64, np.complex64, ">i4", np.bool_]


def _jpeg(rng: np.random.Generator) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=80)
    return buf.getvalue()


def _items() -> list[dict[str, Any]]:
    rng = np.random.default_rng(1234)
    items = []
    for k in range(N):
        dtype = np.dtype(DTYPES[k % len(DTYPES)])
        shape = [(k % 7) + 1, 3, 5][: 1 + k % 3]
        arr = (rng.standard_normal(shape) * 50).astype(dtype)
        items.append({"__key__": f"k{(k * 7919) % 100003:06d}", "npy": arr, "jpg": _jpeg(rng), "cls": k % 10,
                      "fort.npy": np.asfortranarray(rng.integers(0, 1000, (6, 4), dtype=np.int32))})
    items.append({"__key__": "scalar", "npy": np.array(3.5), "jpg": _jpeg(rng), "cls": 0,
                  "fort.npy": np.zeros((0, 4), np.int32)})
    return items


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


@pytest.fixture(scope="module")
def packed(s3_server: Any) -> Any:
    """A dataset of N+1 samples in several shards on its own bucket: (url, options, items)."""
    bucket = f"ra-{uuid.uuid4().hex[:12]}"
    fs = s3_server.filesystem()
    fs.mkdir(bucket)
    items = _items()
    url = f"s3://{bucket}/ds"
    opts = s3_server.storage_options()
    shardkit.pack(iter(items), url, shard_bytes=12_000, storage_options=opts, progress=False)
    yield url, opts, items
    try:
        fs.rm(bucket, recursive=True)
    except OSError:
        pass


def test_random_access_returns_packed_bytes(packed: Any) -> None:
    url, opts, items = packed
    ds = shardkit.ShardDataset(url, storage_options=opts)
    assert len(ds) == len(items)
    assert ds.ds.num_shards > 3
    order = np.random.default_rng(0).permutation(len(items))
    for i in order:
        s, it = ds[int(i)], items[int(i)]
        assert s["__key__"] == it["__key__"] and s["__index__"] == i
        assert s["jpg"] == it["jpg"]
        assert s["npy"] == _npy_bytes(it["npy"])
        assert s["fort.npy"] == _npy_bytes(it["fort.npy"])
        assert s["cls"] == str(it["cls"]).encode()
    assert ds[-1]["__key__"] == items[-1]["__key__"]
    # one ranged GET per sample: only sample bytes moved, never whole shards
    total = sum(int(b) for b in ds.ds.shards.column("bytes").to_numpy())
    assert ds.stats()["requests"] == len(items) + 1
    assert ds.stats()["bytes_fetched"] < total
    with pytest.raises(IndexError, match="out of range"):
        ds[len(items)]


def test_decode_numpy_arrays_and_images(packed: Any) -> None:
    url, opts, items = packed
    ds = shardkit.ShardDataset(url, storage_options=opts, decode="numpy")
    for i in (0, 3, 17, len(items) - 1):
        s, it = ds[i], items[i]
        for field in ("npy", "fort.npy"):
            assert s[field].dtype == it[field].dtype and s[field].shape == it[field].shape
            np.testing.assert_array_equal(s[field], it[field])
        assert s["jpg"].shape == (24, 32, 3) and s["cls"] == it["cls"]


def test_by_key(packed: Any) -> None:
    url, opts, items = packed
    ds = shardkit.ShardDataset(url, storage_options=opts, decode="numpy")
    for i in np.random.default_rng(1).permutation(len(items))[:15]:
        it = items[int(i)]
        s = ds.by_key(it["__key__"])
        assert s["__index__"] == i and s["__key__"] == it["__key__"]
        np.testing.assert_array_equal(s["npy"], it["npy"])
    with pytest.raises(SampleNotFoundError, match="nope"):
        ds.by_key("nope")
    with pytest.raises(KeyError):  # the built-in users catch
        ds.by_key("k")


def test_distributed_sampler_two_ranks_cover_everything(packed: Any) -> None:
    from torch.utils.data import DataLoader, DistributedSampler

    url, opts, items = packed
    ds = shardkit.ShardDataset(url, storage_options=opts)
    seen: list[str] = []
    for rank in range(2):
        replica = pickle.loads(pickle.dumps(ds))  # what a spawned rank or worker receives
        sampler = DistributedSampler(replica, num_replicas=2, rank=rank, shuffle=True, seed=3)
        loader = DataLoader(replica, sampler=sampler, batch_size=4, num_workers=rank,  # rank 1 via a worker
                            collate_fn=lambda batch: [s["__key__"] for s in batch])
        for keys in loader:
            seen.extend(keys)
    assert sorted(set(seen)) == sorted(it["__key__"] for it in items)
    assert len(seen) == len(items) + (len(items) % 2)  # the sampler pads to an even split


def test_partial_reads_small(packed: Any) -> None:
    url, opts, items = packed
    ds = shardkit.ShardDataset(url, storage_options=opts)
    i = next(k for k, it in enumerate(items) if it["npy"].ndim >= 2 and it["npy"].shape[0] >= 5)
    a = items[i]["npy"]
    for rows in (slice(1, 3), slice(0, None), slice(None, None, 2), slice(None, None, -1), slice(-3, -1), 2, -1,
                 slice(4, 1), None):
        got = ds.read_array(i, "npy", rows=rows)
        want = a if rows is None else a[rows]
        assert got.dtype == want.dtype and got.shape == want.shape, rows
        np.testing.assert_array_equal(got, want)
    f = items[i]["fort.npy"]
    np.testing.assert_array_equal(ds.read_array(i, "fort.npy", rows=slice(1, 4)), f[1:4])
    hdr = ds.npy_header(i, "npy")
    assert hdr.shape == a.shape and hdr.dtype == a.dtype and not hdr.fortran
    key = items[i]["__key__"]
    with pytest.raises(IndexError, match=f"{key}.*'npy'.*row 99"):
        ds.read_array(i, "npy", rows=99)
    with pytest.raises(IndexError, match="slice bound"):
        ds.read_array(i, "npy", rows=slice(0, a.shape[0] + 1))
    with pytest.raises(ValueError, match=f"{key}.*no field 'x.npy'"):
        ds.read_array(i, "x.npy")
    with pytest.raises(IndexError, match="0-d"):
        ds.read_array(len(items) - 1, "npy", rows=0)
    np.testing.assert_array_equal(ds.read_array(len(items) - 1, "npy"), np.array(3.5))
    assert ds.read_array(len(items) - 1, "fort.npy").shape == (0, 4)


def test_cached_shards_give_zero_copy_readonly_arrays(packed: Any, tmp_path: Any) -> None:
    url, opts, items = packed
    warm = shardkit.ShardDataset(url, cache_dir=tmp_path, storage_options=opts, cache_shards=True)
    assert warm[5]["__key__"] == items[5]["__key__"]  # downloads shard of sample 5 into the cache
    shard_bytes = shardkit.open_dataset(url, storage_options=opts).shard_list[warm.locate(5)[0]].bytes
    assert warm.stats() == {"bytes_fetched": shard_bytes, "requests": 1}  # one GET of the whole shard, counted
    warm.close()
    ds = shardkit.ShardDataset(url, cache_dir=tmp_path, storage_options=opts, decode="numpy")
    s = ds[5]
    np.testing.assert_array_equal(s["npy"], items[5]["npy"])
    assert not s["npy"].flags.writeable  # a view over the mapped cache file
    part = ds.read_array(5, "fort.npy", rows=slice(2, 5))
    np.testing.assert_array_equal(part, items[5]["fort.npy"][2:5])
    assert not part.flags.writeable
    assert ds.stats()["bytes_fetched"] == 0  # nothing came from storage
    far = len(items) - 2  # a shard not in the cache: read by range, not downloaded
    assert ds[far]["__key__"] == items[far]["__key__"]
    assert 0 < ds.stats()["bytes_fetched"] < 12_000
    ds.close()


def test_read_array_gives_the_stored_dtype_from_storage_and_cache(packed: Any, tmp_path: Any) -> None:
    url, opts, items = packed
    i = next(k for k, it in enumerate(items) if it["npy"].dtype == np.dtype(">i4") and it["npy"].shape[0] >= 3)
    cold = shardkit.ShardDataset(url, storage_options=opts)
    warm = shardkit.ShardDataset(url, cache_dir=tmp_path, storage_options=opts, cache_shards=True)
    for ds in (cold, warm):
        for rows in (None, slice(0, 2), slice(-1, None)):
            got = ds.read_array(i, "npy", rows=rows)
            want = items[i]["npy"] if rows is None else items[i]["npy"][rows]
            assert got.dtype == np.dtype(">i4"), (ds.cache_dir, rows)  # as np.load gives it
            np.testing.assert_array_equal(got, want)
    assert warm.stats()["bytes_fetched"] > 0 and warm.read_array(i, "npy").base is not None  # zero-copy from the cache
    cold.close()
    warm.close()


def _flip_byte(s3_server: Any, url: str, shard_path: str, at: int) -> None:
    fs = s3_server.filesystem()
    obj = url[len("s3://"):] + "/" + shard_path
    data = bytearray(fs.cat_file(obj))
    data[at] ^= 0xFF
    fs.pipe_file(obj, bytes(data))


def test_corrupt_bytes_on_storage_raise_integrity_error(s3_server: Any, s3_bucket: str) -> None:
    items = _items()[:6]
    url = f"{s3_bucket}/corrupt"
    opts = s3_server.storage_options()
    shardkit.pack(iter(items), url, shard_bytes=12_000, storage_options=opts, progress=False)
    ds = shardkit.ShardDataset(url, storage_options=opts)
    shard, pos = ds.locate(3)
    rows = ds.ds.shard_rows(shard)
    names, offs, _ = rows.fields(pos)
    npy_at = int(offs[names.index("npy")]) + 130
    _flip_byte(s3_server, url, ds.ds.shard_list[shard].path, npy_at)
    fresh = shardkit.ShardDataset(url, storage_options=opts)
    with pytest.raises(IntegrityError, match=f"{items[3]['__key__']}.*index 3.*checksum"):
        fresh[3]
    other = next(i for i in range(len(items)) if fresh.locate(i)[0] != shard)
    assert fresh[other]["__key__"] == items[other]["__key__"]
    for rows in (None, slice(0, 1), 0):  # a small sample: read whole for its checksum, even for one row
        with pytest.raises(IntegrityError, match=f"{items[3]['__key__']}.*index 3.*checksum"):
            fresh.read_array(3, "npy", rows=rows)
    np.testing.assert_array_equal(fresh.read_array(other, "npy"), items[other]["npy"])


BIG_ROWS, ROW = 96, 32 * 1024  # a 3 MiB float32 array: three blocks of block checksums
TWO_ROWS = slice(60, 62)       # inside block 1, away from the header's block 0


def _big_items() -> list[dict[str, Any]]:
    big = np.arange(BIG_ROWS * ROW // 4, dtype=np.float32).reshape(BIG_ROWS, -1)
    return [{"__key__": "small", "npy": np.arange(10, dtype=np.int16)}, {"__key__": "big", "npy": big},
            {"__key__": "fort", "npy": np.asfortranarray(big[:40])}]


def _row_at(ds: Any, index: int, row: int) -> int:
    """Shard byte offset of ``row`` of sample ``index``'s npy member."""
    return ds.npy_header(index).data_offset + row * ROW


def test_partial_reads_of_big_samples_check_only_the_blocks_they_fetch(s3_server: Any, s3_bucket: str) -> None:
    from shardkit.format.checksums import BLOCK_BYTES

    items = _big_items()
    url = f"{s3_bucket}/blocks"
    opts = s3_server.storage_options()
    shardkit.pack(iter(items), url, storage_options=opts, progress=False)
    ds = shardkit.ShardDataset(url, storage_options=opts)
    got = ds.read_array(1, "npy", rows=TWO_ROWS)
    np.testing.assert_array_equal(got, items[1]["npy"][TWO_ROWS])
    moved = ds.stats()["bytes_fetched"]  # the header's block, and the block holding the two rows
    assert 2 * ROW < moved <= 2 * BLOCK_BYTES, moved
    shard_path = ds.ds.shard_list[0].path
    _flip_byte(s3_server, url, shard_path, _row_at(ds, 1, 90))  # block 2 of "big"
    _flip_byte(s3_server, url, shard_path, _row_at(ds, 2, 30) + 5)  # in the Fortran-ordered "fort"
    fresh = shardkit.ShardDataset(url, storage_options=opts)
    np.testing.assert_array_equal(fresh.read_array(1, "npy", rows=TWO_ROWS), items[1]["npy"][TWO_ROWS])
    for rows in (None, slice(89, 91), 90, slice(0, None, 7)):
        with pytest.raises(IntegrityError, match=r"'big' \(index 1\) in shards/.*: block 2 .*fails its checksum"):
            fresh.read_array(1, "npy", rows=rows)
    with pytest.raises(IntegrityError, match=r"'fort' \(index 2\).*block"):
        fresh.read_array(2, "npy", rows=slice(0, 2))  # Fortran order: every block of the array is read
    np.testing.assert_array_equal(fresh.read_array(0, "npy", rows=slice(2, 5)), items[0]["npy"][2:5])


def test_manifests_without_block_checksums_still_read_and_check_whole_arrays(s3_server: Any, s3_bucket: str) -> None:
    """A dataset packed before block checksums existed: whole arrays and small samples are
    still checked (read whole); a partial read of a big sample moves only its rows, unchecked."""
    import pyarrow.parquet as pq

    items = _big_items()
    url = f"{s3_bucket}/old"
    opts = s3_server.storage_options()
    shardkit.pack(iter(items), url, storage_options=opts, progress=False)
    fs = s3_server.filesystem()
    for frag in fs.glob(url[len("s3://"):] + "/manifest/samples-*.parquet"):
        with fs.open(frag, "rb") as f:
            table = pq.read_table(f)
        table = table.drop_columns(["block_checksums"]).replace_schema_metadata(None)
        buf = io.BytesIO()
        pq.write_table(table, buf)
        fs.pipe_file(frag, buf.getvalue())
    ds = shardkit.ShardDataset(url, storage_options=opts)
    assert "block_checksums" not in ds.ds.samples.column_names
    np.testing.assert_array_equal(ds.read_array(1, "npy", rows=TWO_ROWS), items[1]["npy"][TWO_ROWS])
    _flip_byte(s3_server, url, ds.ds.shard_list[0].path, _row_at(ds, 1, 90))
    fresh = shardkit.ShardDataset(url, storage_options=opts)
    np.testing.assert_array_equal(fresh.read_array(1, "npy", rows=TWO_ROWS), items[1]["npy"][TWO_ROWS])
    before = fresh.stats()["bytes_fetched"]
    fresh.read_array(1, "npy", rows=90)  # unchecked, as documented: exactly the row's bytes move
    assert fresh.stats()["bytes_fetched"] - before == ROW
    with pytest.raises(IntegrityError, match=r"'big' \(index 1\).*fails its checksum"):
        fresh.read_array(1, "npy")
    with pytest.raises(IntegrityError, match=r"'big' \(index 1\).*fails its checksum"):
        fresh[1]
    np.testing.assert_array_equal(fresh.read_array(0, "npy", rows=slice(2, 5)), items[0]["npy"][2:5])


# --------------------------------------------------------------------------- ranged.read_into


def test_read_into_resumes_a_failed_part_from_the_byte_it_reached(tmp_path: Any, monkeypatch: Any) -> None:
    data = np.random.default_rng(5).integers(0, 255, 3_000_000, dtype=np.uint8).tobytes()
    (tmp_path / "obj").write_bytes(data)
    store = Store(str(tmp_path))
    real = resumable._FsspecBody.readinto
    failed: list[int] = []

    def flaky(body: Any, out: memoryview) -> int:
        pos = body._src.tell()
        if not failed and pos == 1_000_000:  # second part: land some bytes, then reset
            return real(body, out[:123_456])
        if not failed and pos == 1_123_456:
            failed.append(pos)
            raise ConnectionResetError("connection reset by peer")
        return real(body, out)

    monkeypatch.setattr(resumable._FsspecBody, "readinto", flaky)
    monkeypatch.setattr(storage, "backoff_delay", lambda attempt: 0.0)  # pause_before_retry sleeps it
    out = bytearray(len(data) - 1000)
    counter = ranged.ByteCounter()
    ranged.read_into(store, "obj", 1000, len(data), out, part_size=999_000, concurrency=3, counter=counter,
                     transport="fsspec")
    assert bytes(out) == data[1000:]
    assert failed == [1_123_456]
    assert counter.snapshot() == {"bytes": len(out), "requests": 5}  # 4 parts + 1 resume, no byte twice


def test_read_into_gives_up_on_permanent_faults(tmp_path: Any) -> None:
    store = Store(str(tmp_path))
    with pytest.raises(shardkit.errors.StorageError, match="missing"):
        ranged.read_into(store, "missing", 0, 10, bytearray(10))
    with pytest.raises(ValueError, match="holds 5 bytes"):
        ranged.read_into(store, "missing", 0, 10, bytearray(5))


def test_s3_client_from_store_options(s3_server: Any, s3_bucket: str, monkeypatch: Any) -> None:
    opts = s3_server.storage_options()
    s3_server.filesystem().pipe_file(s3_bucket[5:] + "/x/obj", b"0123456789" * 1000)
    store = Store(f"{s3_bucket}/x", opts)
    assert ranged.choose_transport(store) == "boto3"
    out = ranged.read_range(store, "obj", 5, 9995, part_size=1000, concurrency=4)
    assert out.tobytes() == (b"0123456789" * 1000)[5:9995]
    # endpoint and keys from the standard variables only
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    env_store = Store(f"{s3_bucket}/x")
    assert ranged.read_range(env_store, "obj", 0, 10).tobytes() == b"0123456789"
    assert s3_server.secret not in repr(ranged.s3_client(env_store.storage_options))
    assert ranged.choose_transport(Store(f"{s3_bucket}/x", {**opts, "requester_pays": True})) == "fsspec"
