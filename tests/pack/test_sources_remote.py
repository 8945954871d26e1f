"""Sources in object storage (SeaweedFS): an ImageFolder, a keyed folder, a file list of URLs,
HDF5 and .npy/.npz files, each packed byte-identical to the same input packed from local disk."""

from __future__ import annotations

import gc
import io
import threading
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import shardkit
from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.packing.sources.base import SourceItem
from shardkit.packing.sources.imagefolder import ImageFolderSource
from shardkit.packing.sources.objects import ReadAhead


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


@pytest.fixture(scope="module")
def imagefolder(s3_server, tmp_path_factory):
    """~2k small objects in 8 class folders (one nested folder each), uploaded once for the
    module, and the same folder on disk: (local path, its URL)."""
    local = tmp_path_factory.mktemp("if") / "train"
    _imagefolder(local, classes=8, per_class=250)
    bucket = f"test-if-{uuid.uuid4().hex[:12]}"
    fs = s3_server.filesystem()
    fs.mkdir(bucket)
    _upload(s3_server, local, f"s3://{bucket}/raw/train")
    try:
        yield local, f"s3://{bucket}/raw/train/"
    finally:
        try:
            fs.rm(bucket, recursive=True)
        except OSError:
            pass


@pytest.mark.slow
@pytest.mark.timeout(900)  # a loaded 2-core machine put the 2,000 objects at ~15/s
def test_imagefolder_of_objects_packs_like_the_local_folder(imagefolder, s3_server, s3_bucket, monkeypatch):
    """2,000 objects in class folders (and nested folders) pack to the same shard bytes and
    manifest rows as the same folder on disk. Tasks are sized from the first 300 items, so most
    are planned and packed while the objects are still being listed."""
    from shardkit.packing import plan

    monkeypatch.setattr(plan, "PLAN_WINDOW", 300)
    local, url = imagefolder
    so = s3_server.storage_options()
    shardkit.pack(str(local), f"{s3_bucket}/from-disk", labels_from_dirs=True, shard_bytes="200KB",
                  storage_options=so, progress=False)
    info = shardkit.pack(url, f"{s3_bucket}/from-s3", labels_from_dirs=True, shard_bytes="200KB",
                         storage_options=so, progress=False)
    assert info["num_samples"] == 2000
    _assert_same(f"{s3_bucket}/from-disk", f"{s3_bucket}/from-s3", so)


@pytest.mark.slow
@pytest.mark.timeout(900)  # a loaded 2-core machine put the 2,000 objects at ~15/s
def test_imagefolder_of_objects_on_ray_packs_like_the_local_folder(imagefolder, ray_local, s3_server, s3_bucket):
    """The Ray engine (its workers without the endpoint in their environment) packs the objects
    to the same bytes as the local engine packs the folder on disk."""
    local, url = imagefolder
    so = s3_server.storage_options()
    shardkit.pack(str(local), f"{s3_bucket}/from-disk", labels_from_dirs=True, shard_bytes="200KB",
                  storage_options=so, progress=False)
    shardkit.pack(url, f"{s3_bucket}/ray", labels_from_dirs=True, shard_bytes="200KB", engine="ray",
                  storage_options=so, progress=False)
    _assert_same(f"{s3_bucket}/from-disk", f"{s3_bucket}/ray", so)


# What the driver may hold per listed object: a slotted SourceItem (~56 B), its ref and key
# (~80 B each for these names), its size and a list slot. A listing that kept s3fs's listings
# cache (a dict per object) or the store's raw pages held ~600 B per object more.
HELD_BYTES_PER_OBJECT = 400


@pytest.mark.slow
@pytest.mark.timeout(900)  # a loaded 2-core machine put the 2,000 objects at ~15/s
def test_listing_objects_holds_bounded_bytes_per_object(imagefolder, s3_server):
    """Listing the 2,000 objects leaves the driver holding under HELD_BYTES_PER_OBJECT bytes per
    object (tracemalloc, after a warm-up listing), and the listing's peak stays within a
    bounded window over that (LIST_AHEAD listings, not the whole bucket)."""
    _, url = imagefolder
    so = s3_server.storage_options()
    src = ImageFolderSource(url, so)
    assert len(src.list_items()) == 2000  # warm: imports, clients, class names
    src = ImageFolderSource(url, so)
    src.classes()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        items = src.list_items()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(items) == 2000
    per_object = (held - base) / len(items)
    assert per_object < HELD_BYTES_PER_OBJECT, f"{per_object:.0f} bytes held per listed object"
    assert peak - held < 16 * 2**20


def test_read_ahead_keeps_several_reads_in_flight_and_hands_them_out_in_order():
    """A task's reads overlap (more than one in flight, never more than the depth) and come
    back in the plan's order; an item asked for out of order restarts the window there."""
    lock = threading.Lock()
    now = peak = 0
    started: list[str] = []

    def fetch(item):
        nonlocal now, peak
        with lock:
            now += 1
            peak = max(peak, now)
            started.append(item.key)
        time.sleep(0.02)
        with lock:
            now -= 1
        if item.key == "k07":
            raise SourceNotFoundError("s3://b/k07 does not exist")
        return item.key.encode()

    items = [SourceItem(ref=f"k{i:02d}", nbytes=1000, key=f"k{i:02d}") for i in range(40)]
    ahead = ReadAhead(fetch, depth=4)
    ahead.start(items)
    got = []
    for it in items[:7]:
        got.append(ahead.get(it))
    with pytest.raises(SourceNotFoundError, match="k07"):
        ahead.get(items[7])
    got += [ahead.get(it) for it in items[8:20]]
    assert got == [it.key.encode() for it in items[:7] + items[8:20]]
    assert 2 <= peak <= 4
    assert ahead.get(items[3]) == b"k03"  # a shard rewritten: back to an earlier item
    assert ahead.get(items[4]) == b"k04"
    ahead.close()
    assert started.count("k30") <= 1 and "k39" not in started  # never more than the window ahead
    bounded = ReadAhead(fetch, depth=8, max_bytes=2500)  # by bytes: two 1000-byte items at once
    bounded.start(items)
    assert bounded.get(items[0]) == b"k00" and len(bounded._pending) <= 2
    bounded.close()


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


def _drop_source(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "source"} for r in rows]


def test_file_list_at_a_url_packs_like_the_local_list(tmp_path, s3_server, s3_bucket):
    """A CSV list in S3 naming its files relative to its own URL packs as the same list on disk;
    a Parquet list on disk of s3:// URLs packs the same bytes (its ``source`` column holds the URLs)."""
    so = s3_server.storage_options()
    local = tmp_path / "listed"
    (local / "img").mkdir(parents=True)
    lines = ["path,label,note"]
    for i in range(40):
        (local / "img" / f"a{i:03d}.jpg").write_bytes(_jpeg(i))
        lines.append(f"img/a{i:03d}.jpg,{'cat' if i % 3 else 'dog'},n{i}")
    (local / "list.csv").write_text("\n".join(lines) + "\n")
    _upload(s3_server, local, f"{s3_bucket}/raw/listed")
    shardkit.pack(str(local / "list.csv"), f"{s3_bucket}/from-disk", shard_bytes="16KB", storage_options=so,
                  progress=False)
    shardkit.pack(f"{s3_bucket}/raw/listed/list.csv", f"{s3_bucket}/from-s3", shard_bytes="16KB",
                  storage_options=so, progress=False)
    _assert_same(f"{s3_bucket}/from-disk", f"{s3_bucket}/from-s3", so)
    urls = [f"{s3_bucket}/raw/listed/img/a{i:03d}.jpg" for i in range(40)]
    pq.write_table(pa.table({"path": urls, "key": [f"img_a{i:03d}" for i in range(40)]}), tmp_path / "urls.parquet")
    pq.write_table(pa.table({"path": [f"img/a{i:03d}.jpg" for i in range(40)], "key": [f"img_a{i:03d}" for i in range(40)]}),
                   local / "keys.parquet")
    shardkit.pack(str(local / "keys.parquet"), f"{s3_bucket}/keys-disk", shard_bytes="16KB", storage_options=so,
                  progress=False)
    shardkit.pack(str(tmp_path / "urls.parquet"), f"{s3_bucket}/keys-urls", shard_bytes="16KB", storage_options=so,
                  progress=False)
    disk, remote = _dataset_files(f"{s3_bucket}/keys-disk", so), _dataset_files(f"{s3_bucket}/keys-urls", so)
    assert disk["shards"] == remote["shards"] and disk["shard_rows"] == remote["shard_rows"]
    assert _drop_source(disk["samples"]) == _drop_source(remote["samples"])
    assert [r["source"] for r in remote["samples"]] == urls


def test_url_list_resolves_dot_segments_as_the_local_list_does(tmp_path, s3_server, s3_bucket):
    """Paths with ``./`` and ``../`` in a list at a URL name the objects that the same paths name
    beside the list on disk (an object store takes ``lists/../img/a.jpg`` as a key, and S3
    answers 400); a ``..`` above the bucket is one line naming the row."""
    so = s3_server.storage_options()
    local = tmp_path / "root"
    (local / "img").mkdir(parents=True)
    (local / "lists").mkdir()
    lines = ["path,label"]
    for i in range(12):
        (local / "img" / f"a{i:03d}.jpg").write_bytes(_jpeg(i))
        lines.append(f"{'../img' if i % 2 else './../img'}/a{i:03d}.jpg,{i % 3}")
    (local / "lists" / "list.csv").write_text("\n".join(lines) + "\n")
    _upload(s3_server, local, f"{s3_bucket}/raw")
    shardkit.pack(str(local / "lists" / "list.csv"), f"{s3_bucket}/from-disk", shard_bytes="8KB",
                  storage_options=so, progress=False)
    shardkit.pack(f"{s3_bucket}/raw/lists/list.csv", f"{s3_bucket}/from-s3", shard_bytes="8KB",
                  storage_options=so, progress=False)
    disk, remote = _dataset_files(f"{s3_bucket}/from-disk", so), _dataset_files(f"{s3_bucket}/from-s3", so)
    assert len(disk["shards"]) > 1 and disk["shards"] == remote["shards"]
    assert disk["samples"] == remote["samples"] and disk["shard_rows"] == remote["shard_rows"]
    s3_server.filesystem().pipe(f"{s3_bucket[5:]}/raw/lists/up.csv", b"path\n../../../img/a000.jpg\n")
    with pytest.raises(SourceError) as err:
        shardkit.pack(f"{s3_bucket}/raw/lists/up.csv", f"{s3_bucket}/up", storage_options=so, progress=False)
    assert "\n" not in str(err.value) and "row 0" in str(err.value) and "above the bucket" in str(err.value)


def test_a_list_row_naming_a_folder_is_refused_at_listing_naming_the_row(tmp_path, s3_server, s3_bucket):
    """A row naming a folder (a prefix in a bucket) passed the listing: on disk the pack then failed
    with '0:/.../cat: cannot read ...: Is a directory', in a bucket with '... does not exist'
    (the prefix is there). Both now say at listing that the row names a folder, or skip it."""
    so = s3_server.storage_options()
    local = tmp_path / "root"
    (local / "img" / "cat").mkdir(parents=True)
    (local / "img" / "cat" / "a.jpg").write_bytes(_jpeg(1))
    (local / "img" / "b.jpg").write_bytes(_jpeg(2))
    (local / "list.csv").write_text("path\nimg/b.jpg\nimg/cat\n")
    _upload(s3_server, local, f"{s3_bucket}/raw")
    for where in (str(local / "list.csv"), f"{s3_bucket}/raw/list.csv"):
        with pytest.raises(SourceError) as err:
            shardkit.pack(where, f"{s3_bucket}/ds", storage_options=so, progress=False)
        message = str(err.value)
        assert message.startswith(f"file list {where}: row 1: ") and "img/cat is a folder, not a file" in message
        assert "\n" not in message and not isinstance(err.value, SourceNotFoundError)
        info = shardkit.pack(where, f"{s3_bucket}/ds-{len(where)}", storage_options=so, on_error="skip",
                             progress=False)
        assert info["num_samples"] == 1 and "is a folder" in info["skipped"][0]["reason"]


def test_missing_object_in_a_url_list_is_named_or_skipped(tmp_path, s3_server, s3_bucket):
    so = s3_server.storage_options()
    fs = s3_server.filesystem()
    fs.pipe({f"{s3_bucket[5:]}/o/{i}.bin": b"data%d" % i for i in range(3)})
    urls = [f"{s3_bucket}/o/0.bin", f"{s3_bucket}/o/gone.bin", f"{s3_bucket}/o/2.bin"]
    (tmp_path / "l.csv").write_text("path\n" + "\n".join(urls) + "\n")
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(tmp_path / "l.csv"), f"{s3_bucket}/ds", storage_options=so, progress=False)
    message = str(err.value)
    assert "\n" not in message and f"{s3_bucket}/o/gone.bin does not exist" in message and "row 1" in message
    assert so["secret"] not in message and so["key"] not in message
    info = shardkit.pack(str(tmp_path / "l.csv"), f"{s3_bucket}/ds", storage_options=so, on_error="skip",
                         progress=False)
    assert info["num_samples"] == 2 and len(info["skipped"]) == 1 and "gone.bin" in info["skipped"][0]["reason"]
    # Deleted after listing: the task's read names it, or skips it.
    (tmp_path / "l2.csv").write_text("path\n" + "\n".join([urls[0], urls[2]]) + "\n")
    from shardkit.packing.sources.filelist import FileListSource
    src = FileListSource(str(tmp_path / "l2.csv"), storage_options=so)
    items = src.list_items()
    fs.rm(f"{s3_bucket[5:]}/o/2.bin")
    src.task_items(items)
    assert src.load(items[0]).fields["bin"] == b"data0"
    with pytest.raises(SourceNotFoundError, match="o/2.bin does not exist"):
        src.load(items[1])
    src.task_done()


def _h5(path: Path) -> None:
    import h5py

    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=rng.integers(0, 255, (30, 8, 8), dtype=np.uint8), chunks=(4, 8, 8),
                         compression="gzip")
        f.create_dataset("labels", data=np.arange(30, dtype=np.int64))
        f["images"].attrs["scale"] = 0.5
        f.create_dataset("grp/big", data=rng.standard_normal((300, 700)).astype(np.float64))  # over one slab


@pytest.mark.parametrize("rows", [None, "images,labels"])
def test_hdf5_object_packs_like_the_local_file(tmp_path, s3_server, s3_bucket, monkeypatch, rows):
    """Both modes: every dataset a sample (the big one streamed in slabs through ranged reads),
    and hdf5_rows; shard bytes and manifest rows equal the local file's but for ``source``."""
    from shardkit.packing.sources import hdf5_read, npy

    monkeypatch.setattr(npy, "CHUNK_BYTES", 256 * 1024)  # the 1.7 MB dataset streams in slabs
    monkeypatch.setattr(hdf5_read, "CHUNK_BYTES", 256 * 1024)
    so = s3_server.storage_options()
    _h5(tmp_path / "vol.h5")
    _upload(s3_server, tmp_path, f"{s3_bucket}/raw")
    kw: dict[str, Any] = {"shard_bytes": "64KB", "storage_options": so, "progress": False, "hdf5_rows": rows}
    shardkit.pack(str(tmp_path / "vol.h5"), f"{s3_bucket}/from-disk", **kw)
    shardkit.pack(f"{s3_bucket}/raw/vol.h5", f"{s3_bucket}/from-s3", **kw)
    disk, remote = _dataset_files(f"{s3_bucket}/from-disk", so), _dataset_files(f"{s3_bucket}/from-s3", so)
    assert disk["shards"] == remote["shards"] and disk["shard_rows"] == remote["shard_rows"]
    assert _drop_source(disk["samples"]) == _drop_source(remote["samples"])
    assert all(r["source"].startswith(f"{s3_bucket}/raw/vol.h5::") for r in remote["samples"])


def test_npy_and_npz_objects_pack_like_the_local_files(tmp_path, s3_server, s3_bucket, monkeypatch):
    from shardkit.packing.sources import npy

    monkeypatch.setattr(npy, "CHUNK_BYTES", 64 * 1024)  # the big array streams
    so = s3_server.storage_options()
    arrays = tmp_path / "arrays"
    arrays.mkdir()
    np.save(arrays / "a.npy", np.arange(100_000, dtype=np.int32).reshape(1000, 100))
    np.save(arrays / "f.npy", np.asfortranarray(np.ones((3, 4), dtype=">f4")))
    np.savez_compressed(arrays / "z.npz", x=np.arange(10), y=np.eye(3))
    _upload(s3_server, arrays, f"{s3_bucket}/raw")
    names = ["a.npy", "f.npy", "z.npz"]
    shardkit.pack(shardkit.packing.sources.NpySource([str(arrays / n) for n in names]), f"{s3_bucket}/from-disk",
                  shard_bytes="64KB", storage_options=so, progress=False)
    shardkit.pack(shardkit.packing.sources.NpySource([f"{s3_bucket}/raw/{n}" for n in names], storage_options=so),
                  f"{s3_bucket}/from-s3", shard_bytes="64KB", storage_options=so, progress=False)
    _assert_same(f"{s3_bucket}/from-disk", f"{s3_bucket}/from-s3", so)
    shardkit.pack(f"{s3_bucket}/raw/z.npz", f"{s3_bucket}/one", storage_options=so, progress=False)
    got = next(iter(shardkit.open_dataset(f"{s3_bucket}/one", storage_options=so).iter_samples()))
    assert np.array_equal(np.load(io.BytesIO(got["y.npy"])), np.eye(3))


@pytest.mark.slow
def test_killed_pack_of_objects_resumes_byte_identical(tmp_path, s3_server, s3_bucket):
    """SIGKILL the CLI packing a keyed folder of objects once some shards are stored; the rerun
    lists the objects to the same plan, reuses the finished tasks and ends byte-identical to an
    uninterrupted pack."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from test_pack_resume import REPO, _wait_for_shards

    local = tmp_path / "keyed"
    local.mkdir()
    for i in range(150):
        (local / f"s{i:03d}.bin").write_bytes(bytes([i]) * 3000)
    _upload(s3_server, local, f"{s3_bucket}/raw/keyed")
    so = s3_server.storage_options()
    fs = s3_server.filesystem()
    env = {**os.environ, **s3_server.env(), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "shardkit.cli", "pack", f"{s3_bucket}/raw/keyed/", f"{s3_bucket}/ds",
           "--shard-size", "8KB", "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = _wait_for_shards(fs, f"{s3_bucket[5:]}/ds", 6, proc, timeout=120)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert seen > 0, "the pack ended before it could be killed"
    assert not fs.exists(f"{s3_bucket[5:]}/ds/dataset.json")
    rerun = subprocess.run(cmd + ["--json"], env=env, capture_output=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr.decode()
    info = json.loads(rerun.stdout)
    assert 0 < info["reused_tasks"] < info["tasks"]
    shardkit.pack(str(local), f"{s3_bucket}/clean", shard_bytes="8KB", storage_options=so, progress=False)
    _assert_same(f"{s3_bucket}/ds", f"{s3_bucket}/clean", so)


def test_a_prefix_is_sniffed_by_its_objects(s3_server, s3_bucket):
    """A prefix of only .tar objects (beside an index's own dataset.json and manifest/) is read
    as WebDataset tars; any other prefix as a keyed folder of objects; a file URL by its extension."""
    from shardkit.packing.sources import FileListSource, FolderSource, Hdf5Source, NpySource, WdsTarSource
    from shardkit.packing.sources.resolve import resolve_source

    so = s3_server.storage_options()
    fs = s3_server.filesystem()
    b = s3_bucket[5:]
    fs.pipe({f"{b}/tars/a.tar": b"", f"{b}/tars/sub/b.tar": b"", f"{b}/tars/dataset.json": b"{}",
             f"{b}/tars/manifest/shards.parquet": b"", f"{b}/keyed/a.jpg": b"", f"{b}/keyed/a.cls": b"1"})
    assert isinstance(resolve_source(f"{s3_bucket}/tars/", storage_options=so), WdsTarSource)
    assert isinstance(resolve_source(f"{s3_bucket}/keyed", storage_options=so), FolderSource)
    assert isinstance(resolve_source(f"{s3_bucket}/keyed", labels_from_dirs=True, storage_options=so),
                      ImageFolderSource)
    # A Parquet URL is a file list or a table by its schema (read from the footer).
    listing = io.BytesIO()
    pq.write_table(pa.table({"path": ["keyed/a.jpg"]}), listing)
    fs.pipe({f"{b}/l.parquet": listing.getvalue()})
    assert isinstance(resolve_source(f"{s3_bucket}/l.parquet", storage_options=so), FileListSource)
    assert isinstance(resolve_source(f"{s3_bucket}/v.h5", storage_options=so, hdf5_rows="x"), Hdf5Source)
    assert isinstance(resolve_source(f"{s3_bucket}/a.npz", storage_options=so), NpySource)
    with pytest.raises(SourceNotFoundError, match="nothing (does not exist|: no objects under this prefix)"):
        resolve_source(f"{s3_bucket}/nothing/", storage_options=so)


def test_an_object_of_an_unsupported_type_is_refused_as_on_disk(tmp_path, s3_server, s3_bucket):
    """A URL naming one object that no source reads is refused by its type, as the same file on
    disk is, not listed as an empty prefix ("no objects under this prefix": it is there)."""
    from shardkit.packing.sources.resolve import resolve_source

    so = s3_server.storage_options()
    s3_server.filesystem().pipe({f"{s3_bucket[5:]}/misc/notes.txt": b"hello"})
    (tmp_path / "notes.txt").write_bytes(b"hello")
    with pytest.raises(SourceError, match="unsupported file type .txt") as on_disk:
        resolve_source(str(tmp_path / "notes.txt"))
    for labels_from_dirs in (False, True):
        with pytest.raises(SourceError) as err:
            shardkit.pack(f"{s3_bucket}/misc/notes.txt", f"{s3_bucket}/ds", labels_from_dirs=labels_from_dirs,
                          storage_options=so, progress=False)
        assert not isinstance(err.value, SourceNotFoundError)
        assert str(err.value) == str(on_disk.value).replace(str(tmp_path), f"{s3_bucket}/misc")
