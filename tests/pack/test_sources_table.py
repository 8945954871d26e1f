"""TableSource: Parquet and Arrow tables whose rows hold the payload, and how resolve_source
tells them from file lists."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

import shardkit
from shardkit.errors import ConfigError, SourceError
from shardkit.packing.sources import table as tablemod
from shardkit.packing.sources.filelist import FileListSource
from shardkit.packing.sources.resolve import resolve_source
from shardkit.packing.sources.table import TableSource

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(200))


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def make_table(n: int = 10) -> pa.Table:
    rng = np.random.default_rng(0)
    return pa.table({
        "key": [f"s{i:03d}" for i in range(n)],
        "jpg": [bytes([i]) * (50 + i) for i in range(n)],
        "depth": pa.array([rng.standard_normal(4).astype(np.float32).tolist() for _ in range(n)],
                          pa.list_(pa.float32())),
        "label": pa.array([i % 3 for i in range(n)], pa.int64()),
        "caption": [f"caption {i}" for i in range(n)],
        "score": [i / 4 for i in range(n)],
    })


def read_back(url: str) -> tuple[dict[str, dict[str, bytes]], shardkit.Dataset]:
    ds = shardkit.open_dataset(url)
    return {s["__key__"]: {k: bytes(v) for k, v in s.items() if not k.startswith("__")} for s in ds.iter_samples()}, ds


def expected_of(table: pa.Table) -> dict[str, dict[str, bytes]]:
    rows = table.to_pylist()
    return {r["key"]: {"jpg": r["jpg"], "depth.npy": npy(np.array(r["depth"], np.float32)),
                       "cls": str(r["label"]).encode()} for r in rows}


def test_parquet_round_trip_by_row_groups(tmp_path):
    table = make_table()
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=3)  # 4 row groups
    src = resolve_source(tmp_path / "t.parquet")
    assert isinstance(src, TableSource)
    info = shardkit.pack(str(tmp_path / "t.parquet"), str(tmp_path / "ds"), progress=False, shard_samples=4)
    assert info["num_samples"] == 10 and info["source"]["type"] == "table"
    got, ds = read_back(str(tmp_path / "ds"))
    assert got == expected_of(table)
    rows = {r["key"]: r for r in ds.samples.to_pylist()}
    assert rows["s004"]["caption"] == "caption 4" and rows["s004"]["score"] == 1.0 and rows["s004"]["label"] == 1
    assert rows["s004"]["source"] == "t.parquet:4"
    depth = np.load(io.BytesIO(got["s007"]["depth.npy"]))
    assert depth.dtype == np.float32 and depth.shape == (4,)


def test_listing_reads_no_row_group_and_a_task_holds_one(tmp_path, monkeypatch):
    pq.write_table(make_table(), tmp_path / "t.parquet", row_group_size=3)
    src = TableSource(tmp_path / "t.parquet")
    calls = []
    real = tablemod._Reader.group
    monkeypatch.setattr(tablemod._Reader, "group", lambda self, g, path: calls.append(g) or real(self, g, path))
    items = src.list_items()
    assert calls == []  # metadata and the key column only
    assert [i.key for i in items] == [f"s{i:03d}" for i in range(10)]
    for item in items:
        src.load(item)
    assert calls == [0, 1, 2, 3]  # each row group read once, in order
    assert src._cache["group"][0][1] == 3  # and only the last one is held
    src.task_done()
    assert "group" not in src._cache


def test_feather_with_payload_columns_and_row_keys(tmp_path):
    table = pa.table({"img": [PNG, PNG + b"x"], "n": [1, 2]})
    feather.write_feather(table, tmp_path / "t.feather")  # Arrow IPC file format
    info = shardkit.pack(str(tmp_path / "t.feather"), str(tmp_path / "ds"), progress=False,
                         payload_columns="img:png")
    assert info["source"]["payload_columns"] == {"img": "png"}
    got, ds = read_back(str(tmp_path / "ds"))
    assert got == {"000000000": {"png": PNG}, "000000001": {"png": PNG + b"x"}}
    assert ds.samples.column("n").to_pylist() == [1, 2]


def test_hf_exports_parquet_and_arrow_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"]),
                                  "text": datasets.Value("string")})
    hf = datasets.Dataset.from_dict({"image": [{"bytes": PNG, "path": None}, {"bytes": b"\xff\xd8\xff\xe0jpeg", "path": None}],
                                     "label": [1, 0], "text": ["a", "b"]}, features=features)
    hf.to_parquet(str(tmp_path / "hf.parquet"))
    hf.save_to_disk(str(tmp_path / "saved"))  # .arrow files in the IPC *stream* format + json sidecars
    want = {"000000000": {"image.png": PNG, "cls": b"1"}, "000000001": {"image.jpg": b"\xff\xd8\xff\xe0jpeg", "cls": b"0"}}
    for name, src in (("pq", tmp_path / "hf.parquet"), ("arrow", tmp_path / "saved")):
        assert isinstance(resolve_source(src), TableSource), name
        info = shardkit.pack(str(src), str(tmp_path / name), progress=False)
        got, ds = read_back(str(tmp_path / name))
        assert got == want, name
        assert info["labels"] == {"cat": 0, "dog": 1}
        assert ds.samples.column("text").to_pylist() == ["a", "b"]


def test_resolve_tells_tables_from_file_lists(tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"x")
    pq.write_table(pa.table({"path": ["a.jpg"]}), tmp_path / "list.parquet")
    assert isinstance(resolve_source(tmp_path / "list.parquet"), FileListSource)
    pq.write_table(pa.table({"path": ["a.jpg"], "jpg": [b"y"]}), tmp_path / "both.parquet")
    with pytest.raises(SourceError) as err:
        resolve_source(tmp_path / "both.parquet")
    assert "\n" not in str(err.value) and "'path' column" in str(err.value) and "--payload-columns" in str(err.value)
    assert isinstance(resolve_source(tmp_path / "both.parquet", payload_columns="jpg:jpg"), TableSource)
    (tmp_path / "list.csv").write_text("path\na.jpg\n")
    with pytest.raises(ConfigError, match="payload_columns"):
        resolve_source(tmp_path / "list.csv", payload_columns="x:y")
    with pytest.raises(ConfigError, match="payload_columns"):  # not silently ignored for an iterable either
        shardkit.pack(iter([{"a": b"1"}]), str(tmp_path / "ds"), payload_columns="a:b", progress=False)


def test_dictionary_column_is_metadata(tmp_path):
    table = pa.table({"jpg": [b"1", b"2"], "kind": pa.array(["a", "b"]).dictionary_encode()})  # a pandas categorical
    pq.write_table(table, tmp_path / "t.parquet")
    shardkit.pack(str(tmp_path / "t.parquet"), str(tmp_path / "ds"), progress=False)
    assert shardkit.open_dataset(str(tmp_path / "ds")).samples.column("kind").to_pylist() == ["a", "b"]


def test_bad_rows_and_columns(tmp_path):
    pq.write_table(pa.table({"jpg": [b"1", None, b"3"]}), tmp_path / "t.parquet")
    with pytest.raises(SourceError, match="row 1") as err:
        shardkit.pack(str(tmp_path / "t.parquet"), str(tmp_path / "ds"), progress=False)
    assert "\n" not in str(err.value) and "no payload" in str(err.value)
    info = shardkit.pack(str(tmp_path / "t.parquet"), str(tmp_path / "ds2"), progress=False, on_error="skip")
    assert info["num_samples"] == 2 and info["skipped"][0]["key"] == "000000001"
    pq.write_table(pa.table({"jpg": [b"1"], "m": pa.array([{"a": 1}], pa.map_(pa.string(), pa.int64()))}),
                   tmp_path / "m.parquet")
    with pytest.raises(SourceError, match="column 'm'"):
        shardkit.pack(str(tmp_path / "m.parquet"), str(tmp_path / "ds3"), progress=False)
    pq.write_table(pa.table({"jpg": [b"1"], "shard": [3]}), tmp_path / "r.parquet")
    with pytest.raises(SourceError, match="reserved"):
        shardkit.pack(str(tmp_path / "r.parquet"), str(tmp_path / "ds4"), progress=False)


def test_cli_payload_columns(tmp_path, capsys):
    from shardkit.cli import main

    pq.write_table(pa.table({"img": [PNG], "key": ["a"]}), tmp_path / "t.parquet")
    assert main(["pack", str(tmp_path / "t.parquet"), str(tmp_path / "ds"), "--payload-columns", "img:png",
                 "--quiet"]) == 0
    got, _ = read_back(str(tmp_path / "ds"))
    assert got == {"a": {"png": PNG}}



@pytest.mark.s3
@pytest.mark.slow  # four packs
def test_tables_on_s3_equal_local(tmp_path, s3_server, s3_bucket):
    table = make_table()
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=3)
    feather.write_feather(table, tmp_path / "t.feather", chunksize=4)
    fs = s3_server.filesystem()
    opts = s3_server.storage_options()
    for name in ("t.parquet", "t.feather"):
        fs.put(str(tmp_path / name), f"{s3_bucket[5:]}/raw/{name}")
        url = f"{s3_bucket}/raw/{name}"
        assert isinstance(resolve_source(url, storage_options=opts), TableSource)
        shardkit.pack(url, f"{s3_bucket}/{name}", storage_options=opts, progress=False, shard_samples=4)
        shardkit.pack(str(tmp_path / name), str(tmp_path / f"ds-{name}"), progress=False, shard_samples=4)
        remote = shardkit.open_dataset(f"{s3_bucket}/{name}", storage_options=opts)
        local = shardkit.open_dataset(str(tmp_path / f"ds-{name}"))
        assert remote.samples.equals(local.samples), name
        assert {s["__key__"]: s["jpg"] for s in remote.iter_samples()} == {r["key"]: r["jpg"] for r in table.to_pylist()}
