"""File sources (keyed folder, ImageFolder, CSV/Parquet file list): what they carry into the manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardkit
from shardkit.errors import SourceError


def _files(root: Path, n: int) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"f{i}.bin").write_bytes(b"x%d" % i)
    return [f"files/f{i}.bin" for i in range(n)]


def _rows(url: str) -> list[dict]:
    ds = shardkit.open_dataset(url)
    return sorted(ds.samples.drop(["shard", "offset", "size", "fields", "checksum"]).to_pylist(), key=lambda r: r["source"])


def test_csv_metadata_is_carried_as_given(tmp_path: Path) -> None:
    paths = _files(tmp_path / "files", 3)
    lst = tmp_path / "list.csv"
    lst.write_text("path,zip,sample_id,label,score,flag,version,note\n"
                   f"{paths[0]},00123,0001,3,0.5,true,1.10,NA\n"
                   f"{paths[1]},007,0002,4,2,false,1.2,\n"
                   f"{paths[2]},10,0003,5,NA,,2.0,x\n")
    shardkit.pack(str(lst), str(tmp_path / "ds"), progress=False)
    ds = shardkit.open_dataset(str(tmp_path / "ds"))
    schema = ds.samples.schema
    assert schema.field("zip").type == pa.string() and schema.field("sample_id").type == pa.string()
    assert schema.field("label").type == pa.int64() and schema.field("score").type == pa.float64()
    assert schema.field("flag").type == pa.bool_()
    assert schema.field("version").type == pa.string()  # "1.10" is not the float 1.1
    rows = _rows(str(tmp_path / "ds"))
    assert [r["zip"] for r in rows] == ["00123", "007", "10"]
    assert [r["sample_id"] for r in rows] == ["0001", "0002", "0003"]
    assert [r["label"] for r in rows] == [3, 4, 5]
    assert [r["score"] for r in rows] == [0.5, 2.0, None]
    assert [r["flag"] for r in rows] == [True, False, None]
    assert [r["version"] for r in rows] == ["1.10", "1.2", "2.0"]
    assert [r["note"] for r in rows] == ["NA", "", "x"]  # a text column keeps its text
    assert ds.fields == ["bin", "cls"]  # numeric labels still give the cls field


def test_file_list_key_zero_is_a_key(tmp_path: Path) -> None:
    paths = _files(tmp_path / "files", 3)
    lst = tmp_path / "list.csv"
    lst.write_text(f"path,key\n{paths[0]},0\n{paths[1]},00\n{paths[2]},\n")
    shardkit.pack(str(lst), str(tmp_path / "ds"), progress=False)
    keys = sorted(shardkit.open_dataset(str(tmp_path / "ds")).samples.column("key").to_pylist())
    assert keys == ["0", "00", "files_f2-" + keys[2].rpartition("-")[2]]  # only the empty key falls back to the path
    pq.write_table(pa.table({"path": [str(tmp_path / p) for p in paths[:2]], "key": [0, 1]}), tmp_path / "list.parquet")
    shardkit.pack(str(tmp_path / "list.parquet"), str(tmp_path / "ds2"), progress=False)
    assert sorted(shardkit.open_dataset(str(tmp_path / "ds2")).samples.column("key").to_pylist()) == ["0", "1"]


# --------------------------------------------------------------------------- images that are no images


def _jpeg(seed: int = 0) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (12, 8), (seed % 256, 40, 90)).save(buf, "JPEG")
    return buf.getvalue()


BAD_IMAGES = {"broken.jpg": b"\xff\xd8\xff garbage", "empty.jpg": b"", "text.png": b"not a png at all"}


@pytest.mark.parametrize("kind", ["imagefolder", "folder", "filelist"])
def test_images_that_are_no_images_are_bad_input(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    for i in range(3):
        (src / "b" / f"ok{i}.jpg").write_bytes(_jpeg(i))
    for name, data in BAD_IMAGES.items():
        (src / "b" / name).write_bytes(data)
    kw: dict[str, Any] = {}
    source = src
    if kind == "imagefolder":
        kw = {"labels_from_dirs": True}
    elif kind == "filelist":
        source = tmp_path / "list.csv"
        source.write_text("path\n" + "".join(f"src/b/{p.name}\n" for p in sorted((src / "b").iterdir())))
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(source), str(tmp_path / "raise"), progress=False, **kw)
    msg = str(err.value)
    assert "\n" not in msg and "not a readable image" in msg and str(src / "b" / "broken.jpg") in msg, msg
    assert not (tmp_path / "raise" / "dataset.json").exists()
    info = shardkit.pack(str(source), str(tmp_path / "skip"), on_error="skip", progress=False, **kw)
    assert info["num_samples"] == 3
    reasons = {Path(s["reason"].split(" is not")[0].split(": ")[-1]).name: s["reason"] for s in info["skipped"]}
    assert set(reasons) == set(BAD_IMAGES), info["skipped"]
    assert "empty (0 bytes)" in reasons["empty.jpg"] and "no image format" in reasons["text.png"]
    # What was packed decodes: the first epoch no longer dies on a bad file.
    got = list(shardkit.StreamingDataset(str(tmp_path / "skip"), decode="pil"))
    assert len(got) == 3 and all(s["jpg"].size == (12, 8) for s in got)


def test_large_streamed_image_is_checked_from_its_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.packing.sources import files

    monkeypatch.setattr(files, "STREAM_THRESHOLD", 100)  # every file streams
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "ok.jpg").write_bytes(_jpeg())
    (src / "a" / "bad.jpg").write_bytes(b"\x00" * 500)
    with pytest.raises(SourceError, match="bad.jpg is not a readable image"):
        shardkit.pack(str(src), str(tmp_path / "ds"), labels_from_dirs=True, progress=False)
    info = shardkit.pack(str(src), str(tmp_path / "ds2"), labels_from_dirs=True, on_error="skip", progress=False)
    assert info["num_samples"] == 1 and info["skipped"][0]["ref"] == "a/bad.jpg"


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_text_labels_become_classes(tmp_path: Path, fmt: str) -> None:
    paths = _files(tmp_path / "files", 4)
    labels = ["dog", "cat", "NA", "dog"]  # "NA" in a text column is a class name, as written
    if fmt == "csv":
        lst = tmp_path / "list.csv"
        lst.write_text("path,label\n" + "".join(f"{p},{lab}\n" for p, lab in zip(paths, labels)))
    else:
        lst = tmp_path / "list.parquet"
        pq.write_table(pa.table({"path": [str(tmp_path / p) for p in paths], "label": labels}), lst)
    info = shardkit.pack(str(lst), str(tmp_path / "ds"), progress=False)
    assert info["labels"] == {"NA": 0, "cat": 1, "dog": 2}  # sorted names, as --labels-from-dirs numbers folders
    ds = shardkit.open_dataset(str(tmp_path / "ds"))
    assert ds.labels == info["labels"] and "cls" in ds.fields
    got = {s["__key__"]: s.get("cls") for s in shardkit.StreamingDataset(str(tmp_path / "ds"), decode="pil")}
    rows = {r["key"]: r for r in ds.samples.to_pylist()}
    assert sorted((rows[k]["label"], c) for k, c in got.items()) == [("NA", 0), ("cat", 1), ("dog", 2), ("dog", 2)]
    # Numeric labels: the cls field as before, and no labels map.
    num = tmp_path / "num.csv"
    num.write_text("path,label\n" + "".join(f"{p},{i % 2}\n" for i, p in enumerate(paths)))
    info = shardkit.pack(str(num), str(tmp_path / "ds2"), progress=False)
    assert not info["labels"] and "cls" in info["fields"]


def test_float_labels_give_integer_classes(tmp_path: Path) -> None:
    # pandas writes integer labels as float64 once one is missing; they are class indices all the same.
    paths = _files(tmp_path / "files", 3)
    lst = tmp_path / "list.parquet"
    pq.write_table(pa.table({"path": paths, "label": pa.array([0.0, 2.0, 1.0])}), lst)
    info = shardkit.pack(str(lst), str(tmp_path / "ds"), progress=False)
    assert info["fields"] == ["bin", "cls"] and not info["labels"]
    got = {s["__key__"]: s["cls"] for s in shardkit.StreamingDataset(str(tmp_path / "ds"), decode="pil")}
    assert sorted(got.values()) == [0, 1, 2]


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_missing_or_fractional_labels_are_bad_input(tmp_path: Path, fmt: str) -> None:
    paths = _files(tmp_path / "files", 4)
    if fmt == "csv":
        lst = tmp_path / "list.csv"
        lst.write_text("path,label\n" + "".join(f"{p},{lab}\n" for p, lab in zip(paths, ["0", "", "2.5", "1"])))
    else:
        lst = tmp_path / "list.parquet"
        pq.write_table(pa.table({"path": paths, "label": pa.array([0.0, None, 2.5, 1.0])}), lst)
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(lst), str(tmp_path / "raise"), progress=False)
    assert str(err.value) == f"file list {lst}: row 1: the label is missing (every row of a list with a 'label' column needs one)"
    info = shardkit.pack(str(lst), str(tmp_path / "skip"), on_error="skip", progress=False)
    assert info["num_samples"] == 2 and info["fields"] == ["bin", "cls"]
    assert [s["ref"] for s in info["skipped"]] == [f"{lst}: row 1", f"{lst}: row 2"]
    assert info["skipped"][1]["reason"] == (f"file list {lst}: row 2: label 2.5 is neither a class index (a whole "
                                            "number) nor a class name")
    # Every packed sample has its cls: batches hold one type, never a mix with None.
    batches = list(shardkit.StreamingDataset(str(tmp_path / "skip"), batch_size=2, decode="numpy"))
    assert len(batches) == 1 and sorted(batches[0]["cls"].tolist()) == [0, 1]


@pytest.mark.parametrize("column", ["source", "size", "checksum", "shard", "offset", "fields"])
def test_file_list_columns_with_reserved_names_are_refused(tmp_path: Path, column: str) -> None:
    # `source` holds each sample's path and the rest are the manifest's own columns: a user
    # column of that name was overwritten (source) or refused only after every shard was written.
    paths = _files(tmp_path / "files", 2)
    lst = tmp_path / "list.csv"
    lst.write_text(f"path,{column},label\n{paths[0]},camera-A,0\n{paths[1]},camera-B,1\n")
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(lst), str(tmp_path / "ds"), progress=False)
    assert str(err.value).startswith(f"file list {lst}: column {column!r} is reserved (")
    assert str(err.value).endswith("); rename the column")
    assert not (tmp_path / "ds" / "shards").exists()


def test_reserved_names_are_the_manifest_columns() -> None:
    from shardkit.format.manifest import SAMPLE_COLUMNS
    from shardkit.packing.sample import MANIFEST_COLUMNS

    assert MANIFEST_COLUMNS == set(SAMPLE_COLUMNS.names)


def test_iterable_meta_with_a_manifest_column_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"sample '0001' \(item 0\): __meta__ name 'size' is reserved"):
        shardkit.pack([{"__key__": "0001", "txt": "a", "__meta__": {"size": 3}}], str(tmp_path / "ds"), progress=False)
    assert not (tmp_path / "ds" / "shards").exists() or not any((tmp_path / "ds" / "shards").iterdir())


def test_listing_a_big_folder_keeps_memory_per_file_small(tmp_path: Path) -> None:
    # 20 M files must list on a driver with a few GB: measured ~700 B a file at the peak when
    # the listing kept per-file group objects, ~400 B since.
    import tracemalloc

    from shardkit.packing.sources.files import FolderSource

    for c in range(20):
        (tmp_path / f"c{c:02d}").mkdir()
    for i in range(20_000):
        (tmp_path / f"c{i % 20:02d}" / f"s{i:06d}.bin").write_bytes(b"x")
    tracemalloc.start()
    try:
        items = FolderSource(tmp_path).list_items()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(items) == 20_000 and items[0].key.startswith("c00_s000000")
    assert peak / len(items) < 500


def test_item_sizes_are_what_the_writer_writes(tmp_path: Path) -> None:
    # The planner closes shards on these sizes: they must count tar headers and padding.
    from shardkit.packing.sources.filelist import FileListSource
    from shardkit.packing.sources.files import FolderSource
    from shardkit.packing.sources.imagefolder import ImageFolderSource
    from shardkit.packing.writer import tar_size

    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    for i in range(3):
        (src / "b" / f"ok{i}.JPEG").write_bytes(_jpeg(i))
        (src / "b" / f"ok{i}.json").write_text("{}" * i * 300)
    lst = tmp_path / "list.csv"
    lst.write_text("path,label\n" + "".join(f"src/b/ok{i}.JPEG,{i}\n" for i in range(3)))
    for source in (FolderSource(src), ImageFolderSource(src), FileListSource(lst)):
        items = source.list_items()
        assert [it.nbytes for it in items] == [tar_size(source.load(it)) for it in items], source


# --------------------------------------------------------------------------- listing folders


def _tree(root: Path, files: dict[str, int]) -> None:
    for rel, size in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * size)


def test_folder_listing_items_order_and_skips(tmp_path: Path) -> None:
    """The items a keyed folder and an ImageFolder list: refs, sizes, keys and their order
    (by key, so that "a-b" follows "a" though "a-b.jpg" sorts before "a.jpg"; an ImageFolder
    by path), fixed here as the listing gave them before it streamed the walk."""
    from shardkit.packing.sources.files import FolderSource
    from shardkit.packing.sources.imagefolder import ImageFolderSource

    _tree(tmp_path / "keyed", {"a.jpg": 10, "a.json": 3, "a.Seg.PNG": 600, "a-b.jpg": 5, "a/x.jpg": 1, "a/x.cls": 1,
                               "b.txt": 0, "README": 4, "sub/c.d.e": 513, "sub/c.jpg": 2, "sub/deeper/c.jpg": 7,
                               ".hidden.jpg": 1, "Z.jpg": 1})
    src = FolderSource(tmp_path / "keyed")
    with pytest.raises(SourceError, match="cannot group .*/keyed/README into a sample"):
        src.list_items()
    src.listing.skip = True
    assert [(i.ref, i.nbytes, i.key) for i in src.list_items()] == [
        ('["Z.jpg"]', 1024, "Z"), ('["a.Seg.PNG", "a.jpg", "a.json"]', 3584, "a"), ('["a-b.jpg"]', 1024, "a-b"),
        ('["a/x.cls", "a/x.jpg"]', 2048, "a_x-8c075506"), ('["b.txt"]', 512, "b"),
        ('["sub/c.d.e", "sub/c.jpg"]', 2560, "sub_c-7866795e"), ('["sub/deeper/c.jpg"]', 1024, "sub_deeper_c-0f4a312e")]
    reason = (f"cannot group {tmp_path}/keyed/README into a sample: name it <key>.<field> (e.g. 0001.jpg), "
              "or pack with --on-error skip to leave it out")
    assert src.listing.skipped == [{"ref": f"{tmp_path}/keyed/README", "key": "", "reason": reason}]

    _tree(tmp_path / "img", {"cat/1.jpg": 1, "cat/a-b.png": 2, "cat/a/b.jpg": 3, "cat/a.JPEG": 700, "cat/notes.txt": 4,
                             "dog/x.webp": 5, "dog/sub-1.jpg": 6, "dog/sub/y.bmp": 7, "dog/sub.jpg": 8, "loose.jpg": 9})
    img = ImageFolderSource(tmp_path / "img")
    assert [(i.ref, i.nbytes, i.key) for i in img.list_items()] == [
        ("cat/1.jpg", 2048, "cat_1_jpg-bc754269"), ("cat/a-b.png", 2048, "cat_a-b_png-741e383f"),
        ("cat/a.JPEG", 2560, "cat_a_JPEG-fa4fb377"), ("cat/a/b.jpg", 2048, "cat_a_b_jpg-6018f4af"),
        ("dog/sub-1.jpg", 2048, "dog_sub-1_jpg-e36b34c0"), ("dog/sub.jpg", 2048, "dog_sub_jpg-94e08912"),
        ("dog/sub/y.bmp", 2048, "dog_sub_y_bmp-fae59053"), ("dog/x.webp", 2048, "dog_x_webp-af8bc637")]
    assert img.labels() == {"cat": 0, "dog": 1}


def test_folder_listing_peak_memory_per_file(tmp_path: Path) -> None:
    """Listing a folder holds little more than its items at any time: collecting and sorting
    (path, size) tuples first peaked at ~1 KB a file (~20 GB for the 20 M images of trial D
    F2b), where the items take ~220 B."""
    import os
    import tracemalloc

    from shardkit.packing.sources.files import FolderSource

    n = 30_000
    root = tmp_path / "flat"
    root.mkdir()
    for i in range(n):
        fd = os.open(root / f"{i:08d}.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"x" * 100)
        os.close(fd)
    src = FolderSource(root)
    tracemalloc.start()
    try:
        items = src.list_items()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(items) == n and items[0].key == "00000000" and items[-1].key == f"{n - 1:08d}"
    assert held / n < 300, f"{held / n:.0f} B/file held"
    assert peak / n < 450, f"{peak / n:.0f} B/file at the peak"
