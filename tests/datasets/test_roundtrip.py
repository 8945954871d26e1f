"""End-to-end: real inputs -> shardkit.pack -> storage (SeaweedFS S3, local disk, memory://) -> read back.

Every check compares against the input files themselves, the on-storage format against
the format spec (docs/format.md), and the shards against independent readers (Python's tarfile, GNU tar, webdataset).
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from PIL import Image

import shardkit
from shardkit.errors import DatasetNotFoundError
from shardkit.packing.sources import FolderSource

CLASSES = ("cat", "dog", "eel")
SHARD_BYTES = "6KB"  # small: every source below spans several shards


# --------------------------------------------------------------------------- inputs


def image_bytes(seed: int, fmt: str, size: int = 24) -> bytes:
    """A real JPEG/PNG (noise, so each image differs and does not compress to nothing)."""
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def make_imagefolder(root: Path) -> dict[str, tuple[bytes, str]]:
    """root/<class>/imgNN.{jpg,png}: 3 classes x 10 images. Returns relpath -> (bytes, class)."""
    out = {}
    for c, cls in enumerate(CLASSES):
        (root / cls).mkdir(parents=True)
        for i in range(10):
            ext, fmt = ("jpg", "JPEG") if i % 2 else ("png", "PNG")
            data = image_bytes(100 * c + i, fmt)
            (root / cls / f"img{i:02d}.{ext}").write_bytes(data)
            out[f"{cls}/img{i:02d}.{ext}"] = (data, cls)
    return out


def make_folder(root: Path) -> dict[str, dict[str, bytes]]:
    """Multi-field samples: sNN.jpg + sNN.cls + sNN.json. Returns key -> field -> bytes."""
    root.mkdir(parents=True)
    out = {}
    for i in range(8):
        key = f"s{i:02d}"
        fields = {
            "jpg": image_bytes(1000 + i, "JPEG"),
            "cls": str(i % 3).encode(),
            "json": json.dumps({"i": i, "name": key}).encode(),
        }
        for f, data in fields.items():
            (root / f"{key}.{f}").write_bytes(data)
        out[key] = fields
    return out


def make_filelist(root: Path) -> tuple[Path, dict[str, dict[str, Any]]]:
    """A CSV list with metadata columns. Returns (csv, path -> row incl. bytes)."""
    (root / "files").mkdir(parents=True)
    rows = {}
    lines = ["path,label,split,weight"]
    for i in range(9):
        rel = f"files/f{i:02d}.png"
        data = image_bytes(2000 + i, "PNG")
        (root / rel).write_bytes(data)
        split = "train" if i < 6 else "val"
        lines.append(f"{rel},{i % 2},{split},{i / 4}")
        rows[rel] = {"bytes": data, "label": i % 2, "split": split, "weight": i / 4}
    csv = root / "list.csv"
    csv.write_text("\n".join(lines) + "\n")
    return csv, rows


def make_dicts() -> list[dict[str, Any]]:
    return [
        {"__key__": f"it{i:03d}", "txt": f"caption {i}", "npy": np.arange(i * 40, dtype=np.int16).reshape(-1, 4) if i else np.zeros((0, 4), np.int16),
         "bin": bytes(range(i % 256)) * 7, "__meta__": {"group": i % 4}}
        for i in range(12)
    ]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("inputs")
    csv, rows = make_filelist(base / "list")
    return {
        "imagefolder": base / "imf", "imagefolder_files": make_imagefolder(base / "imf"),
        "folder": base / "folder", "folder_files": make_folder(base / "folder"),
        "csv": csv, "csv_rows": rows,
    }


@pytest.fixture(params=["local", "memory", "s3"])
def dest(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """A fresh destination root on each backend: (url prefix, storage_options)."""
    if request.param == "local":
        yield str(tmp_path / "out"), None
    elif request.param == "memory":
        import fsspec

        url = f"memory://rt-{uuid.uuid4().hex[:8]}"
        yield url, None
        fsspec.filesystem("memory").rm(url, recursive=True)
    else:
        bucket = request.getfixturevalue("s3_bucket")
        server = request.getfixturevalue("s3_server")
        yield f"{bucket}/ds", server.storage_options()


def rows_by_key(ds: shardkit.Dataset) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in ds.samples.to_pylist()}


def read_all(ds: shardkit.Dataset) -> dict[str, dict[str, Any]]:
    out = {}
    for s in ds.iter_samples():
        assert s["__key__"] not in out
        out[s["__key__"]] = s
    return out


# --------------------------------------------------------------------------- 1. round trip


def test_roundtrip_every_source(inputs: dict[str, Any], dest: tuple[str, dict[str, Any] | None]) -> None:
    url, so = dest

    # ImageFolder: bytes exact, cls = class index, labels map in dataset.json.
    info = shardkit.pack(str(inputs["imagefolder"]), f"{url}/imf", shard_bytes=SHARD_BYTES,
                         labels_from_dirs=True, storage_options=so, progress=False)
    assert info["num_shards"] >= 3
    ds = shardkit.open_dataset(f"{url}/imf", storage_options=so)
    assert ds.labels == {c: i for i, c in enumerate(CLASSES)}
    files = inputs["imagefolder_files"]
    got, rows = read_all(ds), rows_by_key(ds)
    assert len(got) == ds.num_samples == len(files) == 30
    seen = set()
    for key, s in got.items():
        rel = rows[key]["source"]
        data, cls = files[rel]
        ext = rel.rsplit(".", 1)[1]
        assert set(s) - {"__key__", "__index__", "__shard__"} == {ext, "cls"}
        assert s[ext] == data
        assert int(s["cls"]) == ds.labels[cls] == rows[key]["label"]
        assert rows[key]["class_name"] == cls
        seen.add(rel)
    assert seen == set(files)
    assert [s["__index__"] for s in ds.iter_samples()] == list(range(30))
    assert ds.verify(deep=True)["ok"]

    # Folder of multi-field samples.
    shardkit.pack(str(inputs["folder"]), f"{url}/folder", shard_bytes=SHARD_BYTES, storage_options=so, progress=False)
    ds = shardkit.open_dataset(f"{url}/folder", storage_options=so)
    assert ds.num_shards >= 2
    got = read_all(ds)
    expected = inputs["folder_files"]
    assert set(got) == set(expected)
    for key, fields in expected.items():
        assert {k: bytes(v) for k, v in got[key].items() if not k.startswith("__")} == fields
    assert sorted(ds.fields) == ["cls", "jpg", "json"]
    assert ds.verify(deep=True)["ok"]

    # CSV file list: metadata columns land in the manifest with their types.
    shardkit.pack(str(inputs["csv"]), f"{url}/list", shard_bytes=SHARD_BYTES, storage_options=so, progress=False)
    ds = shardkit.open_dataset(f"{url}/list", storage_options=so)
    assert ds.num_shards >= 2
    table = ds.samples
    for col, typ in (("label", pa.int64()), ("split", pa.string()), ("weight", pa.float64()), ("source", pa.string())):
        assert table.schema.field(col).type == typ, col
    got, rows = read_all(ds), rows_by_key(ds)
    expected_rows = inputs["csv_rows"]
    assert len(got) == len(expected_rows)
    for key, s in got.items():
        row = expected_rows[rows[key]["source"]]
        assert s["png"] == row["bytes"]
        assert int(s["cls"]) == row["label"] == rows[key]["label"]
        assert rows[key]["split"] == row["split"] and rows[key]["weight"] == row["weight"]
    assert ds.verify(deep=True)["ok"]

    # An iterable of dicts: values encoded by type, __meta__ -> columns.
    dicts = make_dicts()
    shardkit.pack(iter(dicts), f"{url}/iter", shard_bytes=SHARD_BYTES, storage_options=so, progress=False)
    ds = shardkit.open_dataset(f"{url}/iter", storage_options=so)
    assert ds.num_shards >= 2
    got = read_all(ds)
    assert list(got) == [d["__key__"] for d in dicts]
    assert ds.samples.column("group").to_pylist() == [d["__meta__"]["group"] for d in dicts]
    for d in dicts:
        s = got[d["__key__"]]
        assert s["txt"] == d["txt"].encode()
        assert s["bin"] == d["bin"]
        arr = np.load(io.BytesIO(s["npy"]), allow_pickle=False)
        assert arr.dtype == d["npy"].dtype and np.array_equal(arr, d["npy"])
    assert ds.verify(deep=True)["ok"]


# --------------------------------------------------------------------------- 2. determinism


def shard_files(url: str, so: dict[str, Any] | None = None) -> dict[str, bytes]:
    ds = shardkit.open_dataset(url, storage_options=so)
    return {p: ds.store.read_bytes(p) for p in ds.shards.column("path").to_pylist()}


def test_packing_twice_is_byte_identical(inputs: dict[str, Any], tmp_path: Path, s3_bucket: str,
                                         s3_server: Any) -> None:
    so = s3_server.storage_options()
    for name, src, kw in (("imf", inputs["imagefolder"], {"labels_from_dirs": True}),
                          ("folder", inputs["folder"], {}), ("list", inputs["csv"], {})):
        a, b = str(tmp_path / f"a-{name}"), f"{s3_bucket}/b-{name}"
        shardkit.pack(str(src), a, shard_bytes=SHARD_BYTES, progress=False, **kw)
        shardkit.pack(str(src), b, shard_bytes=SHARD_BYTES, storage_options=so, progress=False, **kw)
        fa, fb = shard_files(a), shard_files(b, so)
        assert len(fa) >= 2 and fa == fb, name
        da, db = shardkit.open_dataset(a), shardkit.open_dataset(b, storage_options=so)
        assert da.samples.equals(db.samples), name
        assert da.shards.equals(db.shards), name
        ia, ib = dict(da.info), dict(db.info)
        ia.pop("created"), ib.pop("created")
        assert ia == ib, name

    a, b = str(tmp_path / "a-iter"), str(tmp_path / "b-iter")
    shardkit.pack(iter(make_dicts()), a, shard_bytes=SHARD_BYTES, progress=False)
    shardkit.pack(iter(make_dicts()), b, shard_bytes=SHARD_BYTES, progress=False)
    assert shard_files(a) == shard_files(b)
    assert shardkit.open_dataset(a).samples.equals(shardkit.open_dataset(b).samples)


# --------------------------------------------------------------------------- 3. format


SHARD_TYPES = {"shard": pa.int32(), "path": pa.string(), "num_samples": pa.int64(), "bytes": pa.int64(),
               "first_sample": pa.int64(), "checksum": pa.string()}
SAMPLE_TYPES = {"key": pa.string(), "shard": pa.int32(), "offset": pa.int64(), "size": pa.int64(),
                "fields": pa.list_(pa.struct([("name", pa.string()), ("offset", pa.int64()), ("size", pa.int64())])),
                "checksum": pa.uint64()}


def test_format_matches_design(inputs: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "ds"
    shardkit.pack(str(inputs["imagefolder"]), str(root), shard_bytes=SHARD_BYTES, labels_from_dirs=True, progress=False)
    info = json.loads((root / "dataset.json").read_text())
    for name in ("format", "version", "num_samples", "num_shards", "total_bytes", "fields", "created",
                 "shardkit_version", "source", "labels", "skipped"):
        assert name in info, name
    assert info["format"] == "shardkit" and info["version"] == 1
    assert info["num_samples"] == 30 and info["skipped"] == []
    assert info["labels"] == {"cat": 0, "dog": 1, "eel": 2}
    assert info["fields"] == ["cls", "jpg", "png"]
    import datetime as dt
    assert dt.datetime.fromisoformat(info["created"]).tzinfo is not None

    shards = pq.read_table(root / "manifest/shards.parquet")
    for col, typ in SHARD_TYPES.items():
        assert shards.schema.field(col).type == typ, col
    assert shards.column("shard").to_pylist() == list(range(info["num_shards"]))
    assert sum(shards.column("bytes").to_pylist()) == info["total_bytes"]
    fragments = sorted((root / "manifest").glob("samples-*.parquet"))
    assert fragments
    samples = pa.concat_tables([pq.read_table(f) for f in fragments])
    for col, typ in SAMPLE_TYPES.items():
        assert samples.schema.field(col).type == typ, col
    assert samples.column_names[:6] == list(SAMPLE_TYPES)
    assert samples.num_rows == info["num_samples"]
    keys = samples.column("key").to_pylist()
    assert len(set(keys)) == len(keys) and not any("." in k or "/" in k for k in keys)

    first = 0
    for shard in shards.to_pylist():
        data = (root / shard["path"]).read_bytes()
        assert len(data) == shard["bytes"]
        assert xxhash.xxh3_128_hexdigest(data) == shard["checksum"]
        assert shard["first_sample"] == first
        mine = [r for r in samples.to_pylist() if r["shard"] == shard["shard"]]
        assert len(mine) == shard["num_samples"]
        first += len(mine)
        end = 0
        for row in mine:
            assert row["offset"] == end  # samples tile the shard in order
            chunk = data[row["offset"]:row["offset"] + row["size"]]
            end = row["offset"] + row["size"]
            assert xxhash.xxh3_64_intdigest(chunk) == row["checksum"]
            with tarfile.open(fileobj=io.BytesIO(chunk), mode="r:") as tf:
                members = tf.getmembers()
                names = [m.name for m in members]
                assert names == sorted(f"{row['key']}.{f['name']}" for f in row["fields"])
                for m, f in zip(members, row["fields"]):
                    assert m.isfile() and m.mtime == 0 and m.uid == m.gid == 0 and m.mode == 0o644
                    body = tf.extractfile(m).read()  # type: ignore[union-attr]
                    assert len(body) == f["size"]
                    assert body == data[f["offset"]:f["offset"] + f["size"]]
        assert data[end:] == b"\0" * (len(data) - end) and len(data) - end >= 1024  # end-of-archive only

    try:
        import pandas  # noqa: F401
    except ImportError:
        return  # pandas is optional: the pyarrow checks above stand alone
    df = pd_read(fragments[0])
    assert list(df.columns[:6]) == list(SAMPLE_TYPES)
    assert str(df["shard"].dtype) == "int32" and str(df["checksum"].dtype) == "uint64"


def pd_read(path: Path) -> Any:
    import pandas as pd

    return pd.read_parquet(path)


# --------------------------------------------------------------------------- 4. foreign readers


def test_gnu_tar_and_webdataset_read_the_shards(inputs: dict[str, Any], tmp_path: Path, s3_bucket: str,
                                                s3_server: Any) -> None:
    wds = pytest.importorskip("webdataset")
    so = s3_server.storage_options()
    url = f"{s3_bucket}/folder"
    shardkit.pack(str(inputs["folder"]), url, shard_bytes=SHARD_BYTES, storage_options=so, progress=False)
    ds = shardkit.open_dataset(url, storage_options=so)
    local = tmp_path / "dl"
    local.mkdir()
    paths = []
    for p in ds.shards.column("path").to_pylist():
        out = local / p.rsplit("/", 1)[1]
        out.write_bytes(ds.store.read_bytes(p))
        paths.append(str(out))
    assert len(paths) >= 2
    ours = [{k: (v if k == "__key__" else bytes(v)) for k, v in s.items() if k not in ("__index__", "__shard__")}
            for s in ds.iter_samples()]

    # GNU tar lists and extracts each shard to exactly its members.
    listed = []
    for i, p in enumerate(paths):
        names = subprocess.run(["tar", "-tf", p], check=True, capture_output=True, text=True).stdout.split()
        listed += names
        dest = tmp_path / f"x{i}"
        dest.mkdir()
        subprocess.run(["tar", "-xf", p, "-C", str(dest)], check=True, capture_output=True)
        with tarfile.open(p) as tf:
            members = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}  # type: ignore[union-attr]
        assert sorted(names) == sorted(members)
        assert {f.name: f.read_bytes() for f in dest.iterdir()} == members
    assert listed == [f"{s['__key__']}.{f}" for s in ours for f in sorted(k for k in s if k != "__key__")]
    assert {f"{k}.{f}": b for k, fields in inputs["folder_files"].items() for f, b in fields.items()} == \
        {f"{s['__key__']}.{f}": s[f] for s in ours for f in s if f != "__key__"}

    # The webdataset library yields the same samples, keys and bytes.
    theirs = [{k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"}
              for s in wds.WebDataset(paths, shardshuffle=False, empty_check=False)]
    assert theirs == ours


# --------------------------------------------------------------------------- 10. crash safety


class CrashingFolder(FolderSource):
    """A FolderSource that dies (a bug, not bad input) on its Nth load."""

    def __init__(self, root: str, crash_at: int) -> None:
        super().__init__(root)
        self.crash_at = crash_at
        self.loads = 0

    def load(self, item: Any) -> Any:
        self.loads += 1
        if self.loads == self.crash_at:
            raise RuntimeError("simulated crash")
        return super().load(item)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_crash_midway_commits_nothing_and_resume_reuses_tasks(inputs: dict[str, Any], tmp_path: Path,
                                                             backend: str, request: pytest.FixtureRequest) -> None:
    if backend == "s3":
        bucket, server = request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_server")
        url, so = f"{bucket}/crash", server.storage_options()
    else:
        url, so = str(tmp_path / "crash"), None
    src = str(inputs["folder"])
    with pytest.raises(RuntimeError, match="simulated crash"):
        shardkit.pack(CrashingFolder(src, crash_at=6), url, shard_bytes=SHARD_BYTES, storage_options=so, progress=False)
    with pytest.raises(DatasetNotFoundError):
        shardkit.open_dataset(url, storage_options=so)
    if backend == "local":  # the shard being written when it died is gone, not left as a temp file
        assert [p.name for p in Path(url).rglob("*.tmp")] == []

    info = shardkit.pack(FolderSource(src), url, shard_bytes=SHARD_BYTES, storage_options=so, progress=False)
    assert info["tasks"] >= 3
    assert 0 < info["reused_tasks"] < info["tasks"]
    clean = str(tmp_path / "clean")
    shardkit.pack(src, clean, shard_bytes=SHARD_BYTES, progress=False)
    assert shard_files(url, so) == shard_files(clean)
    ds, ref = shardkit.open_dataset(url, storage_options=so), shardkit.open_dataset(clean)
    assert ds.samples.equals(ref.samples) and ds.shards.equals(ref.shards)
    assert ds.verify(deep=True)["ok"]
    if backend == "local":
        leftovers = [p for p in Path(url).rglob("*") if p.name.endswith(".tmp") or "_pack" in p.parts]
        assert leftovers == []
