"""Hdf5Source, NpySource and the .npy header helper."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

from shardkit.errors import SourceError, SourceNotFoundError  # noqa: E402
from shardkit.packing.sample import PackSample, StreamedField  # noqa: E402
from shardkit.packing.sources import npy as npymod  # noqa: E402
from shardkit.packing.sources.hdf5 import Hdf5Source  # noqa: E402
from shardkit.packing.sources.npy import CHUNK_BYTES, NpySource, npy_header  # noqa: E402
from shardkit.packing.writer import tar_size  # noqa: E402


def saved(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def body(value) -> bytes:
    """Materialise a field, checking the StreamedField contract on the way."""
    if isinstance(value, StreamedField):
        parts = list(value.chunks())
        assert all(len(p) <= CHUNK_BYTES for p in parts)
        data = b"".join(parts)
        assert len(data) == value.size
        return data
    return value


def bodies(sample: PackSample) -> dict[str, bytes]:
    return {k: body(v) for k, v in sample.fields.items()}


# -- npy_header ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "dtype",
    ["<f4", ">f8", "<i2", ">u4", "|b1", "|u1", "<c16", "|S7", "<U3", "<M8[ns]",
     [("a", "<i4"), ("b", ">f8", (2, 3))]],
)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 0, 7), (10**10, 3)])
def test_npy_header_matches_np_save(dtype, shape):
    dt = np.dtype(dtype)
    # np.save's header only depends on dtype and shape; a zero-stride view avoids allocating.
    arr = np.lib.stride_tricks.as_strided(np.zeros(1, dt), shape=shape, strides=(0,) * len(shape))
    buf = _HeaderOnly()
    with _quiet(), pytest.raises(_Done) if np.prod(shape) else _quiet():
        np.save(buf, arr)  # stops at the first data write: only the header is compared
    assert npy_header(dt, shape) == buf.header
    if 0 < np.prod(shape) < 100:
        real = np.zeros(shape, dt)
        assert saved(real).startswith(npy_header(dt, shape))
        assert saved(real) == npy_header(dt, shape) + real.tobytes()


def test_npy_header_version_2_for_huge_header():
    dt = np.dtype([(f"field_{i:05d}", "<f4") for i in range(3000)])
    header = npy_header(dt, (2,))
    assert header[6] == 2
    with _quiet():
        assert saved(np.zeros(2, dt)) == header + np.zeros(2, dt).tobytes()


def test_npy_header_refuses_objects():
    with pytest.raises(SourceError):
        npy_header(np.dtype(object), (3,))


class _Done(Exception):
    pass


class _HeaderOnly(io.RawIOBase):
    """A sink that keeps np.save's first write (the header) and stops it at the next."""

    header = b""

    def writable(self):
        return True

    def write(self, b):
        if self.header:
            raise _Done
        self.header = bytes(b)
        return len(b)


class _quiet:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


# -- Hdf5Source: datasets mode ---------------------------------------------------------------

@pytest.fixture
def h5file(tmp_path):
    path = tmp_path / "data.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["b_first"] = rng.standard_normal((4, 5)).astype("<f4")
        f.create_dataset("big_endian", data=np.arange(12, dtype=">i4").reshape(3, 4))
        g = f.create_group("grp/sub")
        d = g.create_dataset("chunked", data=rng.integers(0, 255, (64, 32, 3), dtype=np.uint8),
                             chunks=(7, 32, 3), compression="gzip")
        d.attrs["scale"] = 0.5
        d.attrs["name"] = "cam0"
        d.attrs["vector"] = np.arange(3)  # not a scalar: left out of meta
        f["scalar"] = np.float64(3.25)
        f["strings"] = np.array([b"ab", b"cde"], dtype="S3")
        f["empty"] = np.zeros((0, 4), dtype="<i8")
    return path


def test_hdf5_datasets_mode_roundtrip(h5file):
    src = Hdf5Source(str(h5file))
    items = src.list_items()
    names = [it.ref.split("::")[1] for it in items]
    assert names == sorted(names)
    assert names == ["/b_first", "/big_endian", "/empty", "/grp/sub/chunked", "/scalar", "/strings"]
    src = pickle.loads(pickle.dumps(src))  # what a Ray task receives
    with h5py.File(h5file) as f:
        for it in items:
            name = it.ref.split("::")[1]
            sample = src.load(it)
            data = bodies(sample)["npy"]
            expected = saved(f[name][()])
            assert data == expected, name
            assert it.nbytes == tar_size(sample)  # what the sample takes in a shard, headers included
            assert sample.key == it.key
            assert sample.meta["source"] == f"{h5file}::{name}"
            loaded = np.load(io.BytesIO(data))
            assert loaded.dtype == f[name].dtype and loaded.shape == f[name].shape
    chunked = src.load(next(it for it in items if it.ref.endswith("chunked")))
    assert chunked.meta["attr_scale"] == 0.5 and chunked.meta["attr_name"] == "cam0"
    assert "attr_vector" not in chunked.meta
    assert items[0].key == "data_b_first-" + items[0].key.split("-")[-1]  # safe_key of "data/b_first"
    assert len({it.key for it in items}) == len(items)


def test_hdf5_dataset_filter(h5file):
    items = Hdf5Source(h5file, datasets="grp/*,scalar").list_items()
    assert [it.ref.split("::")[1] for it in items] == ["/grp/sub/chunked", "/scalar"]


def test_hdf5_stems_clash_use_relative_paths(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        with h5py.File(tmp_path / d / "x.h5", "w") as f:
            f["v"] = np.arange(3)
    items = Hdf5Source(tmp_path).list_items()
    assert len({it.key for it in items}) == 2


@pytest.mark.slow
def test_hdf5_large_dataset_streams_in_bounded_chunks(tmp_path):
    path = tmp_path / "big.h5"
    arr = np.arange(64 * 1024 * 1024 // 4, dtype="<f4").reshape(256, 256, 256)  # 64 MB
    with h5py.File(path, "w") as f:
        f["vol"] = arr
        f.create_dataset("chunked", data=arr[:, :128], chunks=(3, 128, 256))
        f["wide"] = arr.reshape(2, -1)  # rows bigger than the chunk bound: split inside a row
    src = Hdf5Source(path)
    for it in src.list_items():
        sample = src.load(it)
        field = sample.fields["npy"]
        assert isinstance(field, StreamedField)
        sizes = []
        h = io.BytesIO()
        for part in field.chunks():
            sizes.append(len(part))
            h.write(part)
        assert max(sizes) <= CHUNK_BYTES
        assert len(sizes) > 4
        with h5py.File(path) as f:
            assert h.getvalue() == saved(f[it.ref.split("::")[1]][()])


# -- Hdf5Source: rows mode -------------------------------------------------------------------

def test_hdf5_rows_mode(tmp_path):
    path = tmp_path / "train.h5"
    images = np.random.default_rng(1).integers(0, 255, (5, 8, 8, 3), dtype=np.uint8)
    labels = np.arange(5, dtype="<i8")
    with h5py.File(path, "w") as f:
        f["data/image"] = images
        f["label"] = labels
    src = Hdf5Source([path], datasets="data/image, label", mode="rows")
    items = src.list_items()
    assert [it.key for it in items] == [f"train_{i:09d}" for i in range(5)]
    for i, it in enumerate(items):
        s = src.load(it)
        got = bodies(s)
        assert set(got) == {"image.npy", "label.npy"}
        assert got["image.npy"] == saved(images[i])
        assert got["label.npy"] == saved(labels[i])
        assert it.nbytes == tar_size(s)
        assert s.meta["source"] == f"{path}::{i}"


def test_hdf5_rows_large_rows_stream(tmp_path):
    path = tmp_path / "r.h5"
    arr = np.arange(3 * 3 * 1024 * 1024, dtype="<f4").reshape(3, 3 * 1024, 1024)  # 12 MB rows
    with h5py.File(path, "w") as f:
        f["x"] = arr
    src = Hdf5Source(path, datasets="x", mode="rows")
    for i, it in enumerate(src.list_items()):
        field = src.load(it).fields["x.npy"]
        assert isinstance(field, StreamedField)
        assert body(field) == saved(arr[i])


def test_hdf5_rows_mismatched_lengths(tmp_path):
    path = tmp_path / "m.h5"
    with h5py.File(path, "w") as f:
        f["a"] = np.zeros(3)
        f["b"] = np.zeros(4)
    with pytest.raises(SourceError, match="b"):
        Hdf5Source(path, datasets="a,b", mode="rows").list_items()


def test_hdf5_rows_needs_datasets(tmp_path):
    with pytest.raises(SourceError, match="rows"):
        Hdf5Source(tmp_path / "x.h5", mode="rows")


def test_hdf5_rows_with_a_source_that_is_not_hdf5_is_refused(tmp_path):
    import subprocess
    import sys

    import shardkit
    from shardkit.errors import ConfigError

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="hdf5_rows .*HDF5 sources only.*folder"):
        shardkit.pack(str(src), str(tmp_path / "ds"), hdf5_rows="data", progress=False)
    assert not (tmp_path / "ds").exists()
    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "shardkit.cli", "pack", str(src), str(tmp_path / "ds"), "--hdf5-rows", "data"],
                       capture_output=True, text=True, cwd=repo, timeout=60)
    assert r.returncode == 2 and "--hdf5-rows" in r.stderr and "Traceback" not in r.stderr, r.stderr
    h5 = tmp_path / "ok.h5"
    with h5py.File(h5, "w") as f:
        f["data"] = np.zeros((2, 3))
    assert shardkit.pack(str(h5), str(tmp_path / "ds2"), hdf5_rows="data", progress=False)["num_samples"] == 2


# -- Hdf5Source: bad input -------------------------------------------------------------------

def test_hdf5_missing_file(tmp_path):
    missing = tmp_path / "nope.h5"
    with pytest.raises(SourceNotFoundError, match="nope.h5"):
        Hdf5Source(missing).list_items()
    with pytest.raises(FileNotFoundError):
        Hdf5Source(missing).list_items()


def test_hdf5_not_hdf5(tmp_path):
    bad = tmp_path / "fake.h5"
    bad.write_bytes(b"this is not hdf5" * 100)
    with pytest.raises(SourceError, match="fake.h5"):
        Hdf5Source(bad).list_items()


@pytest.mark.parametrize("make", ["vlen_str", "object_compound", "reference"])
def test_hdf5_unsupported_dtype(tmp_path, make):
    path = tmp_path / "odd.h5"
    with h5py.File(path, "w") as f:
        if make == "vlen_str":
            f.create_dataset("weird", data=["a", "bc"], dtype=h5py.string_dtype())
        elif make == "object_compound":
            dt = np.dtype([("n", "<i4"), ("s", h5py.string_dtype())])
            f.create_dataset("weird", (2,), dtype=dt)
        else:
            f["target"] = np.zeros(2)
            f.create_dataset("weird", (1,), dtype=h5py.ref_dtype)
    with pytest.raises(SourceError, match=r"odd\.h5::/weird"):
        Hdf5Source(path).list_items()


def test_hdf5_unsupported_dataset_is_skipped_with_on_error_skip(tmp_path):
    """--on-error skip left an HDF5 dataset .npy cannot hold in place: the whole pack stopped on
    it, where a Zarr array of the same dtype is left out and listed under ``skipped``."""
    import shardkit

    path = tmp_path / "odd.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=np.arange(6, dtype=">i4").reshape(2, 3))
        f.create_dataset("names", data=["a", "bc"], dtype=h5py.string_dtype())
        f.create_dataset("z", data=np.float32(2.5))
    with pytest.raises(SourceError, match=r"odd\.h5::/names: unsupported dtype"):
        shardkit.pack(str(path), str(tmp_path / "raise"), progress=False)
    info = shardkit.pack(str(path), str(tmp_path / "skip"), on_error="skip", progress=False)
    assert info["num_samples"] == 2 and [s["ref"] for s in info["skipped"]] == [f"{path}::/names"]
    got = {s["__key__"]: np.load(io.BytesIO(bytes(s["npy"])))
           for s in shardkit.open_dataset(str(tmp_path / "skip")).iter_samples()}
    assert len(got) == 2
    assert any(v.dtype == np.dtype(">i4") and np.array_equal(v, np.arange(6).reshape(2, 3)) for v in got.values())
    assert any(v.shape == () and v == np.float32(2.5) for v in got.values())


# -- NpySource -------------------------------------------------------------------------------

@pytest.fixture
def npy_dir(tmp_path):
    root = tmp_path / "arrays"
    (root / "sub").mkdir(parents=True)
    np.save(root / "a.npy", np.arange(10, dtype="<i4"))
    np.save(root / "sub" / "fortran.npy", np.asfortranarray(np.arange(12.0).reshape(3, 4)))
    np.save(root / "sub" / "be.npy", np.arange(6, dtype=">f8").reshape(2, 3))
    np.savez(root / "pair.npz", image=np.ones((2, 2), np.uint8), label=np.int64(7))
    np.savez_compressed(root / "sub" / "z.npz", x=np.arange(1000.0))
    (root / "notes.txt").write_text("ignored")
    return root


def test_npy_source_dir(npy_dir):
    src = pickle.loads(pickle.dumps(NpySource(npy_dir)))
    items = src.list_items()
    refs = [it.ref for it in items]
    assert [r.split("arrays/")[1] for r in refs] == ["a.npy", "pair.npz", "sub/be.npy", "sub/fortran.npy", "sub/z.npz"]
    by_rel = {s.meta["source"]: s for s in (src.load(it) for it in items)}
    for rel in ("a.npy", "sub/fortran.npy", "sub/be.npy"):
        assert bodies(by_rel[rel])["npy"] == (npy_dir / rel).read_bytes()  # verbatim copy
    fort = np.load(io.BytesIO(bodies(by_rel["sub/fortran.npy"])["npy"]))
    assert np.isfortran(fort)
    pair = bodies(by_rel["pair.npz"])
    assert set(pair) == {"image.npy", "label.npy"}
    assert pair["image.npy"] == saved(np.ones((2, 2), np.uint8))
    assert pair["label.npy"] == saved(np.int64(7))
    z = bodies(by_rel["sub/z.npz"])
    assert z["x.npy"] == saved(np.arange(1000.0))
    keys = [it.key for it in items]
    assert keys[0] == "a" and len(set(keys)) == len(keys)
    size = (npy_dir / "a.npy").stat().st_size
    assert items[0].nbytes == 512 + size + -size % 512  # its tar header, body and padding
    assert [it.nbytes for it in items] == [tar_size(src.load(it)) for it in items]


def test_npy_source_file_list_and_streaming(tmp_path):
    big = np.arange(3 * CHUNK_BYTES // 8 + 5, dtype="<f8")
    np.save(tmp_path / "big.npy", big)
    np.savez_compressed(tmp_path / "bigz.npz", big=big)
    src = NpySource([tmp_path / "big.npy", str(tmp_path / "bigz.npz")])
    items = src.list_items()
    s = src.load(items[0])
    assert isinstance(s.fields["npy"], StreamedField)
    assert body(s.fields["npy"]) == (tmp_path / "big.npy").read_bytes()
    s = src.load(items[1])
    assert isinstance(s.fields["big.npy"], StreamedField)
    assert body(s.fields["big.npy"]) == saved(big)
    assert s.meta["source"] == "bigz.npz"


@pytest.mark.parametrize(
    "content, match",
    [
        (b"not numpy at all", "bad magic"),
        (b"\x93NUMPY\x09\x00\x10\x00" + b" " * 16, "version"),
        (b"\x93NUMPY\x01\x00\x20\x00{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", "header"),
        (b"\x93NUMPY\x01\x00\x04\x00{'de", "header"),
    ],
)
def test_npy_bad_header(tmp_path, content, match):
    bad = tmp_path / "bad.npy"
    bad.write_bytes(content)
    with pytest.raises(SourceError, match=rf"bad\.npy.*{match}"):
        NpySource(bad).list_items()


def test_npy_truncated_data(tmp_path):
    data = saved(np.arange(100.0))
    (tmp_path / "short.npy").write_bytes(data[:-8])
    with pytest.raises(SourceError, match="short.npy"):
        NpySource(tmp_path).list_items()


def test_npy_pickled_objects_refused(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(SourceError, match="obj.npy.*pickled"):
        NpySource(tmp_path).list_items()


def test_npz_bad_inputs(tmp_path):
    (tmp_path / "notzip.npz").write_bytes(b"garbage")
    with pytest.raises(SourceError, match="notzip.npz"):
        NpySource(tmp_path / "notzip.npz").list_items()
    with zipfile.ZipFile(tmp_path / "odd.npz", "w") as zf:
        zf.writestr("readme.txt", "hi")
    with pytest.raises(SourceError, match="odd.npz:readme.txt"):
        NpySource(tmp_path / "odd.npz").list_items()


def test_npy_missing(tmp_path):
    with pytest.raises(SourceNotFoundError, match="missing"):
        NpySource(tmp_path / "missing").list_items()
    with pytest.raises(SourceNotFoundError, match="gone.npy"):
        NpySource([tmp_path / "gone.npy"]).list_items()


def test_npy_empty_dir(tmp_path):
    with pytest.raises(SourceError, match="no .npy"):
        NpySource(tmp_path).list_items()


def test_chunk_bound_is_module_constant():
    assert npymod.CHUNK_BYTES <= 16 * 1024 * 1024


@pytest.mark.slow
def test_hdf5_200mb_dataset_memory_bounded(tmp_path):
    """Streaming a 200 MB dataset keeps the Python/numpy heap far below the dataset size."""
    import tracemalloc

    import xxhash

    path = tmp_path / "huge.h5"
    rows, cols = 200, 256 * 1024  # 200 rows of 1 MB (float32): 200 MB
    expected = xxhash.xxh3_64()
    expected.update(npy_header(np.dtype("<f4"), (rows, cols)))
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", (rows, cols), dtype="<f4", chunks=(4, cols))
        for start in range(0, rows, 20):
            slab = np.arange(start * cols, (start + 20) * cols, dtype="<f4").reshape(20, cols)
            d[start : start + 20] = slab
            expected.update(slab.tobytes())
    src = Hdf5Source(path)
    (item,) = src.list_items()
    size = rows * cols * 4 + len(npy_header(np.dtype("<f4"), (rows, cols)))
    assert item.nbytes == 512 + size + -size % 512
    field = src.load(item).fields["npy"]
    assert isinstance(field, StreamedField) and field.size == size
    got = xxhash.xxh3_64()
    total = biggest = 0
    tracemalloc.start()
    try:
        for part in field.chunks():
            biggest = max(biggest, len(part))
            total += len(part)
            got.update(part)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == field.size and got.hexdigest() == expected.hexdigest()
    assert biggest <= CHUNK_BYTES
    assert peak < 64 * 1024 * 1024, peak  # numpy buffers are traced; h5py's chunk cache is not


def test_hdf5_array_and_enum_types(tmp_path):
    path = tmp_path / "types.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("arr", (5,), dtype=np.dtype(("<f4", (3, 2))))
        d[:] = np.arange(30, dtype="<f4").reshape(5, 3, 2)
        big = f.create_dataset("big_arr", (2000,), dtype=np.dtype(("<f8", (1000,))), chunks=(10,))
        big[:] = np.arange(2_000_000.0).reshape(2000, 1000)
        f.create_dataset("enum", data=np.array([0, 1, 1], "u1"), dtype=h5py.enum_dtype({"a": 0, "b": 1}, basetype="u1"))
    for mode, kw in (("datasets", {}), ("rows", {"datasets": "arr"})):
        src = Hdf5Source(path, mode=mode, **kw)
        with h5py.File(path) as f, _quiet():
            for it in src.list_items():
                what = it.ref.split("::")[1]
                expected = saved(f[what][()] if mode == "datasets" else f["arr"][int(what.strip("[]"))])
                (value,) = src.load(it).fields.values()
                assert body(value) == expected, it.ref


@pytest.mark.parametrize("kind", ["h5", "npy", "folder"])
def test_relative_source_paths_load_from_any_working_directory(tmp_path, monkeypatch, kind):
    # A Ray task on an existing cluster runs in another working directory than the driver:
    # a source resolved from a relative path must still find its files there.
    from shardkit.packing.sources import resolve_source

    data = tmp_path / "data"
    data.mkdir()
    if kind == "h5":
        h5py = pytest.importorskip("h5py")
        with h5py.File(data / "vol.h5", "w") as f:
            f["a"] = np.arange(12, dtype=np.float32)
        rel = "data/vol.h5"
    elif kind == "npy":
        np.save(data / "a.npy", np.arange(5))
        rel = "data"
    else:
        (data / "k.txt").write_bytes(b"text")
        rel = "data"
    monkeypatch.chdir(tmp_path)
    src = resolve_source(rel)
    items = src.list_items()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # as a task on another node
    task_src = pickle.loads(pickle.dumps(src))
    sample = task_src.load(items[0])
    assert sample.fields, sample


@pytest.mark.parametrize("option", [{"hdf5_rows": "data"}, {"labels_from_dirs": True}])
def test_source_path_options_with_an_iterable_are_refused(tmp_path, option):
    # They were ignored: the samples were packed without what the option asked for.
    import shardkit
    from shardkit.errors import ConfigError

    with pytest.raises(ConfigError, match=f"{next(iter(option))}: applies to a source path"):
        shardkit.pack(iter([{"__key__": "a", "bin": b"x"}]), str(tmp_path / "ds"), progress=False, **option)
    assert not (tmp_path / "ds").exists()


def test_shards_of_small_npy_files_stay_within_shard_bytes(tmp_path):
    # 40 files of 1,128 bytes take 2,048 each in a tar: counted as 1,128, shards grew to 1.7x the target.
    src = tmp_path / "npys"
    src.mkdir()
    for i in range(40):
        np.save(src / f"{i:03d}.npy", np.zeros(1000, np.uint8))
    import shardkit

    info = shardkit.pack(str(src), str(tmp_path / "ds"), shard_bytes="10KB", progress=False)
    sizes = shardkit.open_dataset(str(tmp_path / "ds")).shards.column("bytes").to_pylist()
    assert info["num_samples"] == 40 and max(sizes) <= 10_000, sizes
    assert min(sizes[:-1]) > 10_000 - 2048  # and they are filled: no shard closed early


def test_member_bytes_counts_pax_headers():
    import tarfile

    from shardkit.format.tar import member_bytes, member_header

    for name, size in (("a.npy", 0), ("a.npy", 1), ("a.npy", 512), ("k" * 150 + ".npy", 700), ("café.txt", 3)):
        assert member_bytes(name, size) == len(member_header(name, size)) + size + -size % 512
    assert member_bytes("k" * 150 + ".npy", 1) > 1024  # a pax header: the name is over 100 bytes
    assert tarfile.BLOCKSIZE == 512
