"""Sources in object storage (SeaweedFS): an ImageFolder, a keyed folder, a file list of URLs,
HDF5 and .npy/.npz files, each packed byte-identical to the same input packed from local disk."""

from __future__ import annotations

import io
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

import shardkit
from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.packing.sources import objects as objects_mod
from shardkit.packing.sources.imagefolder import ImageFolderSource
from shardkit.packing.sources.objects import Objects, ReadAhead


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4 + i % 5, 3 + i % 3), (i % 256, (i * 7) % 256, 5)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _imagefolder(root: Path, classes: int, per_class: int) -> None:
    for c in range(classes):
        d = root / f"class{c:02d}"
        (d / "sub").mkdir(parents=True)
        for i in range(per_class):
            where = d / "sub" if i % 4 == 0 else d  # a nested folder too: the walk orders it as on disk
            (where / f"img{i:04d}.jpg").write_bytes(_jpeg(c * per_class + i))
        (d / "notes.txt").write_text("not an image")


def _upload(s3_server: Any, local: Path, url: str) -> None:
    fs = s3_server.filesystem()
    files = sorted(p for p in local.rglob("*") if p.is_file())
    fs.put([str(p) for p in files], [f"{url}/{p.relative_to(local).as_posix()}" for p in files])


def _dataset_files(url: str, so: dict[str, Any]) -> dict[str, Any]:
    """Every shard's bytes and every manifest row of a dataset (what must be identical)."""
    fs, root = shardkit.storage.filesystem.open_fs(url, so) if url.startswith("s3://") else (None, url)
    ds = shardkit.open_dataset(url, storage_options=so)
    shards = {}
    for path in sorted(ds.shards.column("path").to_pylist()):
        shards[path] = fs.cat_file(f"{root}/{path}") if fs is not None else Path(url, path).read_bytes()
    return {"shards": shards, "samples": ds.samples.to_pylist(), "shard_rows": ds.shards.to_pylist(),
            "labels": ds.info.get("labels")}


def _assert_same(a: str, b: str, so: dict[str, Any]) -> None:
    left, right = _dataset_files(a, so), _dataset_files(b, so)
    assert left["shards"].keys() == right["shards"].keys() and len(left["shards"]) > 1
    for name in left["shards"]:
        assert left["shards"][name] == right["shards"][name], name
    assert left["samples"] == right["samples"]
    assert left["shard_rows"] == right["shard_rows"]
    assert left["labels"] == right["labels"]


@pytest.mark.slow
def test_imagefolder_of_objects_packs_like_the_local_folder(tmp_path, s3_server, s3_bucket):
    """~2k small objects in class folders (and a nested folder) pack to the same shard bytes and
    manifest rows as the same folder on disk; the remote tasks read ahead (several GETs in flight)."""
    so = s3_server.storage_options()
    local = tmp_path / "train"
    _imagefolder(local, classes=8, per_class=250)
    _upload(s3_server, local, f"{s3_bucket}/raw/train")
    shardkit.pack(str(local), f"{s3_bucket}/from-disk", labels_from_dirs=True, shard_bytes="200KB",
                  storage_options=so, progress=False)
    info = shardkit.pack(f"{s3_bucket}/raw/train/", f"{s3_bucket}/from-s3", labels_from_dirs=True,
                         shard_bytes="200KB", storage_options=so, progress=False)
    assert info["num_samples"] == 2000
    _assert_same(f"{s3_bucket}/from-disk", f"{s3_bucket}/from-s3", so)


def test_keyed_folder_of_objects_packs_like_the_local_folder(tmp_path, s3_server, s3_bucket):
    so = s3_server.storage_options()
    local = tmp_path / "keyed"
    (local / "part1").mkdir(parents=True)
    for i in range(60):
        where = local / "part1" if i % 3 == 0 else local
        (where / f"s{i:03d}.jpg").write_bytes(_jpeg(i))
        (where / f"s{i:03d}.cls").write_bytes(b"%d" % (i % 7))
        if i % 5 == 0:
            (where / f"s{i:03d}.seg.bin").write_bytes(b"seg%d" % i)
        (where / f"s{i:03d}-b.json").write_bytes(b'{"i": %d}' % i)  # "s000-b" sorts after key "s000"
    _upload(s3_server, local, f"{s3_bucket}/raw/keyed")
    shardkit.pack(str(local), f"{s3_bucket}/from-disk", shard_bytes="20KB", storage_options=so, progress=False)
    shardkit.pack(f"{s3_bucket}/raw/keyed", f"{s3_bucket}/from-s3", shard_bytes="20KB", storage_options=so,
                  progress=False)
    _assert_same(f"{s3_bucket}/from-disk", f"{s3_bucket}/from-s3", so)
