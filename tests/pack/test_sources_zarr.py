"""ZarrSource: both modes round-trip exactly, S3 equals local disk, Ray, bad input, the install hint."""

from __future__ import annotations

import io
import os
import pickle
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

import shardkit  # noqa: E402
from shardkit.cli import main as cli_main  # noqa: E402
from shardkit.errors import ConfigError, SourceError, SourceNotFoundError  # noqa: E402
from shardkit.packing.sources import zarr as zarrmod  # noqa: E402
from shardkit.packing.sources.resolve import resolve_source  # noqa: E402
from shardkit.packing.sources.zarr import ZarrSource  # noqa: E402

N = 300
ROWS = "x,grp/img,y"


def saved(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def make_group(path: Path, n: int = N, big: bool = False) -> Path:
    """A Zarr v3 group: compressed chunks that straddle read blocks and end short of a whole
    chunk, a big-endian int array in a subgroup, an uncompressed 1-D array, attributes."""
    rng = np.random.default_rng(0)
    g = zarr.open_group(str(path), mode="w")
    x = g.create_array("x", shape=(n, 16), chunks=(37, 16), dtype="<f4")
    x[:] = rng.standard_normal((n, 16)).astype("<f4")
    x.attrs.update({"units": "mm", "scale": 0.5, "ok": True, "axes": ["t", "c"]})
    img = g.create_array("grp/img", shape=(n, 5, 3), chunks=(64, 5, 3), dtype=">i4")
    img[:] = rng.integers(-(1 << 30), 1 << 30, (n, 5, 3))
    y = g.create_array("y", shape=(n,), chunks=(100,), dtype="<i8", compressors=None)
    y[:] = np.arange(n) * 7
    g.create_array("scalar", shape=(), dtype="<f8")[()] = 3.25
    if big:  # over CHUNK_BYTES: streamed slab by slab
        b = g.create_array("vol/big", shape=(2100, 1024), chunks=(256, 1024), dtype="<f4")
        b[:] = np.arange(2100 * 1024, dtype=np.float32).reshape(2100, 1024)
    return path


def arrays_of(path: Path) -> dict[str, np.ndarray]:
    g = zarr.open_group(str(path), mode="r")
    return {name: arr[...] for name, arr in g.members(max_depth=None) if isinstance(arr, zarr.Array)}


def test_arrays_mode_round_trips_exactly(tmp_path):
    store = make_group(tmp_path / "cube.zarr", big=True)
    want = arrays_of(store)
    url = str(tmp_path / "ds")
    info = shardkit.pack(str(store), url, shard_bytes="4MB", progress=False)
    assert info["num_samples"] == len(want) == 5 and info["fields"] == ["npy"]
    assert info["source"] == {"type": "zarr", "url": str(store), "mode": "arrays", "arrays": None}
    ds = shardkit.open_dataset(url)
    rows = {r["source"]: r for r in ds.samples.to_pylist()}
    assert set(rows) == {f"cube.zarr::/{name}" for name in want}
    assert rows["cube.zarr::/x"]["attr_units"] == "mm" and rows["cube.zarr::/x"]["attr_scale"] == 0.5
    assert rows["cube.zarr::/x"]["attr_ok"] is True and "attr_axes" not in rows["cube.zarr::/x"]
    by_key = {s["__key__"]: s for s in ds.iter_samples()}
    for name, arr in want.items():
        key = shardkit.packing.sample.safe_key(f"cube/{name}")
        assert rows[f"cube.zarr::/{name}"]["key"] == key
        assert bytes(by_key[key]["npy"]) == saved(arr), name      # bytes, dtype, byte order, shape
    decoded = {s["__key__"]: s["npy"] for s in ds.iter_samples(decode="numpy")}
    big = decoded[shardkit.packing.sample.safe_key("cube/vol/big")]
    assert big.dtype == np.float32 and big.shape == (2100, 1024) and big[3, 5] == 3 * 1024 + 5
    assert decoded[shardkit.packing.sample.safe_key("cube/grp/img")].dtype == np.dtype(want["grp/img"].dtype)


def test_rows_mode_round_trips_exactly(tmp_path):
    store = make_group(tmp_path / "rows.zarr")
    want = arrays_of(store)
    url = str(tmp_path / "ds")
    info = shardkit.pack(str(store), url, zarr_rows=ROWS, shard_bytes="64KB", progress=False)
    assert info["num_samples"] == N and info["num_shards"] > 1
    assert info["fields"] == ["img.npy", "x.npy", "y.npy"]
    ds = shardkit.ShardDataset(url)
    streamed = list(shardkit.StreamingDataset(url, cache_dir=None))
    assert [s["__key__"] for s in streamed] == [f"rows_{i:09d}" for i in range(N)]
    for i in range(N):
        s = ds[i]
        assert s["__key__"] == f"rows_{i:09d}"
        assert {k: bytes(v) for k, v in streamed[i].items() if k.endswith(".npy")} == {
            k: bytes(v) for k, v in s.items() if k.endswith(".npy")}
        assert bytes(s["x.npy"]) == saved(want["x"][i])
        assert bytes(s["img.npy"]) == saved(want["grp/img"][i])
        assert bytes(s["y.npy"]) == saved(want["y"][i])
    assert shardkit.open_dataset(url).samples.column("source").to_pylist()[:2] == ["rows.zarr::0", "rows.zarr::1"]


def test_rows_are_read_in_chunk_aligned_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(zarrmod, "_BLOCK_BYTES", 64 * 40)  # x: 40 rows of 64 bytes -> 37 (one chunk) per block
    store = make_group(tmp_path / "rows.zarr")
    reads: list[tuple[str, int, int]] = []
    real = zarrmod.read_block

    def spy(arr, sel, dtype, ref, what):
        reads.append((ref.rsplit("/", 1)[-1], sel[0].start, sel[0].stop))
        return real(arr, sel, dtype, ref, what)

    monkeypatch.setattr(zarrmod, "read_block", spy)
    src = ZarrSource(store, arrays="x,y", mode="rows")
    items = src.list_items()
    assert reads == []  # listing reads metadata only
    for it in items:
        src.load(it)
    src.task_done()
    x_reads = [(a, b) for name, a, b in reads if name == "x"]
    assert x_reads == [(s, min(s + 37, N)) for s in range(0, N, 37)]   # one read per chunk, not per row
    assert [(a, b) for name, a, b in reads if name == "y"] == [(0, 300)]   # 320 rows fit: 3 whole chunks


def test_rows_over_chunk_bytes_stream_slab_by_slab(tmp_path, monkeypatch):
    from shardkit.packing.sample import StreamedField
    from shardkit.packing.sources import zarr_read

    monkeypatch.setattr(zarrmod, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(zarr_read, "CHUNK_BYTES", 4096)
    vol = zarr.open_group(str(tmp_path / "v.zarr"), mode="w").create_array(
        "vol", shape=(6, 40, 40), chunks=(2, 8, 40), dtype=">f4")
    vol[:] = np.arange(6 * 40 * 40, dtype=">f4").reshape(6, 40, 40)
    src = ZarrSource(tmp_path / "v.zarr", arrays="vol", mode="rows")
    want = zarr.open_array(str(tmp_path / "v.zarr" / "vol"), mode="r")
    for i, item in enumerate(src.list_items()):
        field = src.load(item).fields["vol.npy"]
        assert isinstance(field, StreamedField)
        parts = list(field.chunks())
        assert len(parts) > 2 and all(len(p) <= 4096 for p in parts)
        assert b"".join(parts) == saved(want[i]) and field.size == len(saved(want[i]))


def test_listing_reads_no_chunk(tmp_path):
    store = make_group(tmp_path / "meta.zarr")
    for chunk in (store / "x" / "c").rglob("*"):
        if chunk.is_file():
            chunk.write_bytes(b"not a chunk")  # any data read would fail
    assert len(ZarrSource(store, arrays="x,y", mode="rows").list_items()) == N
    assert len(ZarrSource(store).list_items()) == 4


def test_a_store_that_is_one_array(tmp_path):
    arr = zarr.create_array(str(tmp_path / "seq.zarr"), shape=(50, 4), chunks=(8, 4), dtype="<u2")
    arr[:] = np.arange(200, dtype="<u2").reshape(50, 4)
    whole = shardkit.pack(str(tmp_path / "seq.zarr"), str(tmp_path / "a"), progress=False)
    assert whole["num_samples"] == 1
    s = next(shardkit.open_dataset(str(tmp_path / "a")).iter_samples())
    assert s["__key__"] == "seq" and bytes(s["npy"]) == saved(arr[...])
    rows = shardkit.pack(str(tmp_path / "seq.zarr"), str(tmp_path / "r"), zarr_rows="seq", progress=False)
    assert rows["num_samples"] == 50 and rows["fields"] == ["seq.npy"]
    assert bytes(shardkit.ShardDataset(str(tmp_path / "r"))[7]["seq.npy"]) == saved(arr[7])


def test_source_pickles_without_open_store(tmp_path):
    store = make_group(tmp_path / "p.zarr")
    src = ZarrSource(store, arrays="x", mode="rows")
    items = src.list_items()
    src.load(items[0])
    assert src._open is not None
    copy = pickle.loads(pickle.dumps(src))
    assert copy._open is None and copy.load(items[1]).fields["x.npy"] == src.load(items[1]).fields["x.npy"]


# -- bad input ---------------------------------------------------------------------------------------------


def _one_line(exc: BaseException, *parts: str) -> None:
    msg = str(exc)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


def test_rows_mode_refuses_a_missing_array_and_unequal_lengths(tmp_path):
    store = make_group(tmp_path / "bad.zarr")
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(store), str(tmp_path / "a"), zarr_rows="x,nope", progress=False)
    _one_line(err.value, f"{store}::/nope", "no such array", "it holds")
    g = zarr.open_group(str(store), mode="a")
    g.create_array("short", shape=(N - 1,), dtype="<i4")
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(store), str(tmp_path / "b"), zarr_rows="x,short", on_error="skip", progress=False)
    _one_line(err.value, f"{store}::/short", f"has {N - 1} rows", f"{store}::/x has {N}", "equal length")


def test_a_ragged_chunk_names_store_array_and_row_or_is_skipped(tmp_path):
    store = make_group(tmp_path / "rag.zarr")
    chunk = store / "y" / "c" / "1"  # rows 100-199 of the uncompressed array, cut short
    chunk.write_bytes(chunk.read_bytes()[:123])
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(store), str(tmp_path / "a"), zarr_rows="x,y", progress=False)
    _one_line(err.value, f"{store}::/y", "rows 100-199 (row 100)", "truncated or corrupt", "on_error='skip'")
    info = shardkit.pack(str(store), str(tmp_path / "b"), zarr_rows="x,y", on_error="skip", progress=False)
    assert info["num_samples"] == N - 100
    assert sorted(s["key"] for s in info["skipped"]) == [f"rag_{i:09d}" for i in range(100, 200)]
    assert all(f"{store}::/y" in s["reason"] for s in info["skipped"])
    keys = shardkit.open_dataset(str(tmp_path / "b")).samples.column("key").to_pylist()
    assert keys == [f"rag_{i:09d}" for i in [*range(100), *range(200, N)]]


def test_a_corrupt_chunk_in_arrays_mode_is_named_or_skipped(tmp_path):
    store = make_group(tmp_path / "cor.zarr")
    (store / "x" / "c" / "2" / "0").write_bytes(b"\x28\xb5\x2f\xfd garbage that is no zstd frame")
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(store), str(tmp_path / "a"), progress=False)
    _one_line(err.value, f"{store}::/x", "cannot decode Zarr data")
    info = shardkit.pack(str(store), str(tmp_path / "b"), on_error="skip", progress=False)
    assert info["num_samples"] == 3 and [s["ref"] for s in info["skipped"]] == [f"{store}::/x"]


def test_arrays_mode_skips_a_missing_named_array_and_an_unsupported_dtype(tmp_path):
    store = make_group(tmp_path / "sel.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.open_group(str(store), mode="a").create_array("names", shape=(2,), dtype=str)[:] = ["a", "bc"]
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(store), str(tmp_path / "a"), progress=False)
    _one_line(err.value, f"{store}::/names", "unsupported dtype")
    src = ZarrSource(store, arrays="x,gone,grp/*")
    with pytest.raises(SourceError) as err:
        src.list_items()
    _one_line(err.value, f"{store}::/gone", "no such array")
    info = shardkit.pack(src, str(tmp_path / "b"), on_error="skip", progress=False)
    assert info["num_samples"] == 2
    assert [s["ref"] for s in info["skipped"]] == [f"{store}::/gone"]
    info = shardkit.pack(str(store), str(tmp_path / "c"), on_error="skip", progress=False)
    assert info["num_samples"] == 4 and [s["ref"] for s in info["skipped"]] == [f"{store}::/names"]


def test_a_missing_chunk_reads_as_the_fill_value_as_zarr_reads_it(tmp_path):
    """Zarr writes no chunk that holds only the fill value (write_empty_chunks=False), so an
    absent chunk is valid data, not damage: packed as zarr reads it."""
    store = make_group(tmp_path / "sparse.zarr")
    (store / "y" / "c" / "2").unlink()
    shardkit.pack(str(store), str(tmp_path / "a"), zarr_rows="y", progress=False)
    assert bytes(shardkit.ShardDataset(str(tmp_path / "a"))[250]["y.npy"]) == saved(np.int64(0))


def test_missing_store_and_missing_zarr_say_so(tmp_path, monkeypatch):
    with pytest.raises(SourceNotFoundError) as err:
        ZarrSource(tmp_path / "none.zarr").list_items()
    _one_line(err.value, "none.zarr")
    store = make_group(tmp_path / "h.zarr")
    monkeypatch.setitem(sys.modules, "zarr", None)  # import zarr now raises ImportError
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(store), str(tmp_path / "a"), progress=False)
    assert str(err.value) == "ZarrSource needs zarr: pip install 'shardkit[zarr]'"


def test_resolve_and_cli_options(tmp_path, capsys):
    store = make_group(tmp_path / "c.zarr")
    plain = tmp_path / "plain"
    os.rename(store, plain)  # sniffed by its zarr.json, not by its name
    src = resolve_source(str(plain), zarr_rows="x")
    assert isinstance(src, ZarrSource) and src.mode == "rows"
    by_url = resolve_source(f"file://{plain}")
    assert isinstance(by_url, ZarrSource) and by_url.url == str(plain) and len(by_url.list_items()) == 4
    assert cli_main(["pack", str(plain), str(tmp_path / "ds"), "--zarr-rows", "x,y", "--quiet"]) == 0
    assert shardkit.open_dataset(str(tmp_path / "ds")).num_samples == N
    (tmp_path / "keyed").mkdir()
    (tmp_path / "keyed" / "a.txt").write_text("a")
    with pytest.raises(ConfigError) as err:
        resolve_source(str(tmp_path / "keyed"), zarr_rows="x")
    _one_line(err.value, "zarr_rows (--zarr-rows x) applies to Zarr sources only")
    with pytest.raises(ConfigError) as err:
        resolve_source(str(plain), hdf5_rows="x")
    _one_line(err.value, "hdf5_rows", "zarr source")
    assert cli_main(["pack", str(tmp_path / "keyed"), str(tmp_path / "d2"), "--zarr-rows", "x", "--quiet"]) == 2


# -- S3 and Ray --------------------------------------------------------------------------------------------


@pytest.mark.s3
@pytest.mark.slow  # SeaweedFS round trips: several seconds on a loaded machine
@pytest.mark.parametrize("rows", [None, ROWS], ids=["arrays", "rows"])
def test_group_in_s3_packs_identical_to_local(tmp_path, s3_server, s3_bucket, rows):
    from test_pack_ray import list_objects

    store = make_group(tmp_path / "cube.zarr", n=120)
    opts = s3_server.storage_options()
    fs = s3_server.filesystem()
    fs.put(str(store), f"{s3_bucket[5:]}/data/", recursive=True)
    remote = f"{s3_bucket}/data/cube.zarr"
    assert fs.isfile(f"{remote[5:]}/zarr.json")
    kw = {"zarr_rows": rows, "shard_bytes": "128KB", "storage_options": opts, "progress": False}
    s3_info = shardkit.pack(remote, f"{s3_bucket}/from-s3", **kw)
    local_info = shardkit.pack(str(store), f"{s3_bucket}/from-disk", **kw)
    assert s3_info["source"]["url"] == remote and s3_info["num_samples"] == local_info["num_samples"]
    a = shardkit.open_dataset(f"{s3_bucket}/from-s3", storage_options=opts)
    b = shardkit.open_dataset(f"{s3_bucket}/from-disk", storage_options=opts)
    assert a.num_samples == (120 if rows else 4) and a.shards.equals(b.shards) and a.samples.equals(b.samples)
    assert list_objects(a) == list_objects(b)
    if rows is None:  # a URL not named *.zarr is found by its zarr.json
        fs.put(str(store / "zarr.json"), f"{s3_bucket[5:]}/plain/zarr.json")
        assert isinstance(resolve_source(f"{s3_bucket}/plain", storage_options=opts), ZarrSource)
        # A prefix with no zarr.json (nor anything else) is no Zarr store: nothing to pack there.
        with pytest.raises(SourceNotFoundError, match="nothing|no objects|does not exist"):
            resolve_source(f"{s3_bucket}/empty-prefix", storage_options=opts)


@pytest.mark.s3
@pytest.mark.ray
@pytest.mark.slow
def test_ray_engine_equals_local(tmp_path, ray_local, s3_server, s3_bucket):
    from test_pack_ray import compare_datasets

    store = make_group(tmp_path / "r.zarr", n=120)
    opts = s3_server.storage_options()
    kw = {"zarr_rows": ROWS, "shard_bytes": "64KB", "task_bytes": "128KB", "storage_options": opts, "progress": False}
    ray_info = shardkit.pack(str(store), f"{s3_bucket}/ray", engine="ray", **kw)
    shardkit.pack(str(store), f"{s3_bucket}/local", **kw)
    assert ray_info["tasks"] >= 3
    compare_datasets(f"{s3_bucket}/ray", f"{s3_bucket}/local", opts)
