"""TokenSource: .npy/.bin token arrays (with and without .docs.npy boundaries) and Parquet token
lists packed as tokens.npy samples with a num_tokens column; deterministic keys; bad input in one
line naming the file (and row)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardkit
from shardkit.cli import main as cli_main
from shardkit.errors import ConfigError, SourceError
from shardkit.packing.sample import StreamedField, safe_key
from shardkit.packing.sources.resolve import resolve_source
from shardkit.packing.sources.tokens import TokenSource


def _one_line(exc: BaseException, *parts: str) -> None:
    msg = str(exc)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


def make_source(root: Path) -> dict[str, np.ndarray]:
    """Every input kind; returns key -> the document's tokens."""
    rng = np.random.default_rng(7)
    root.mkdir(parents=True, exist_ok=True)
    want: dict[str, np.ndarray] = {}
    one = rng.integers(0, 60000, 777).astype(np.uint16)
    np.save(root / "one.npy", one)
    want["one"] = one
    many = rng.integers(0, 60000, 500).astype(">i4")  # big-endian int32: stored little-endian
    bounds = np.array([0, 100, 100, 350, 500])
    np.save(root / "many.npy", many)
    np.save(root / "many.docs.npy", bounds)
    for i in range(4):
        want[f"many-{i:09d}"] = many[bounds[i]:bounds[i + 1]].astype(np.int64)
    raw = rng.integers(0, 65535, 1200).astype("<u2")
    (root / "sub").mkdir()
    raw.tofile(root / "sub" / "train.bin")
    np.save(root / "sub" / "train.docs.npy", np.array([0, 1000, 1200]))
    want[safe_key("sub/train-000000000")] = raw[:1000]  # a path: "/" made safe, with a hash
    want[safe_key("sub/train-000000001")] = raw[1000:]
    rows = [rng.integers(0, 60000, n).tolist() for n in (5, 0, 40, 3)]
    pq.write_table(pa.table({"id": [1, 2, 3, 4], "tokens": rows}), root / "rows.parquet", row_group_size=2)
    for i, r in enumerate(rows):
        want[f"rows-{i:09d}"] = np.array(r, dtype=np.int64)
    return want


def packed_docs(url: str) -> dict[str, tuple[np.ndarray, int, str]]:
    ds = shardkit.open_dataset(url)
    meta = {r["key"]: r for r in ds.samples.select(["key", "num_tokens", "source"]).to_pylist()}
    out = {}
    for s in ds.iter_samples():
        arr = np.load(io.BytesIO(s["tokens.npy"]))
        out[s["__key__"]] = (arr, meta[s["__key__"]]["num_tokens"], meta[s["__key__"]]["source"])
    return out


def test_every_input_kind_round_trips_exactly(tmp_path):
    want = make_source(tmp_path / "src")
    info = shardkit.pack(str(tmp_path / "src"), str(tmp_path / "ds"), shard_bytes="3KB", token_dtype="uint16",
                         token_column="tokens", progress=False)
    assert info["source"]["type"] == "tokens" and info["source"]["field"] == "tokens.npy"
    assert info["num_shards"] > 1
    got = packed_docs(str(tmp_path / "ds"))
    assert sorted(got) == sorted(want)
    for key, (arr, n, source) in got.items():
        expect = want[key]
        assert arr.dtype == np.dtype("<u2") and arr.ndim == 1  # the token_dtype asked for
        assert np.array_equal(arr.astype(np.int64), np.asarray(expect, dtype=np.int64)), key
        assert n == len(expect)
        assert source in ("one.npy", "many.npy", "sub/train.bin", "rows.parquet")


def test_npy_dtype_kept_without_token_dtype_and_keys_deterministic(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    np.save(src / "a.npy", np.arange(300, dtype=np.uint16))
    np.save(src / "b.npy", np.arange(10, dtype=">i4"))
    keys = []
    for name in ("d1", "d2"):
        shardkit.pack(TokenSource(src), str(tmp_path / name), shard_bytes="1KB", progress=False)
        got = packed_docs(str(tmp_path / name))
        keys.append(sorted(got))
        assert got["a"][0].dtype == np.dtype("<u2") and np.array_equal(got["a"][0], np.arange(300))
        assert got["b"][0].dtype == np.dtype("<i4") and np.array_equal(got["b"][0], np.arange(10))
    assert keys[0] == keys[1] == ["a", "b"]
    fps = {shardkit.open_dataset(str(tmp_path / n)).fingerprint for n in ("d1", "d2")}
    assert len(fps) == 1  # same bytes: packing is deterministic


def test_big_document_streams_in_pieces(tmp_path, monkeypatch):
    import shardkit.packing.sources.tokens as tokens_mod

    monkeypatch.setattr(tokens_mod, "CHUNK_BYTES", 4096)  # an 80 KB document becomes a StreamedField
    src = tmp_path / "src"
    src.mkdir()
    arr = np.arange(20_000, dtype=np.uint32) % 65000
    arr.tofile(src / "big.bin")
    source = TokenSource(src, token_dtype="uint16")
    (item,) = source.list_items()
    sample = source.load(item)
    field = sample.fields["tokens.npy"]
    assert isinstance(field, StreamedField)
    pieces = list(field.chunks())
    assert max(len(p) for p in pieces) <= 4096 and sum(map(len, pieces)) == field.size
    shardkit.pack(source, str(tmp_path / "ds"), progress=False)
    (got,) = packed_docs(str(tmp_path / "ds")).values()
    assert got[0].dtype == np.dtype("<u2") and got[1] == 40_000  # 80,000 bytes of uint32 read as uint16 tokens
    assert np.array_equal(got[0], np.frombuffer(arr.tobytes(), dtype="<u2"))


def test_cli_packs_tokens(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    np.arange(1000, dtype="<u2").tofile(src / "train.bin")
    assert cli_main(["pack", str(src / "train.bin"), str(tmp_path / "ds"), "--token-dtype", "uint16", "--quiet"]) == 0
    (got,) = packed_docs(str(tmp_path / "ds")).values()
    assert np.array_equal(got[0], np.arange(1000)) and got[1] == 1000


@pytest.mark.parametrize("case", ["odd_bytes", "bin_no_dtype", "string_list", "no_column", "null_row", "null_token",
                                  "two_d",
                                  "floats", "bad_bounds", "too_wide", "parquet_no_column_option"])
def test_bad_input_is_one_line_naming_the_file(tmp_path, case):
    src = tmp_path / "src"
    src.mkdir()
    opts: dict = {"token_dtype": "uint16"}
    expect = []
    if case == "odd_bytes":
        (src / "train.bin").write_bytes(b"\x01" * 1001)
        expect = ["train.bin", "1001 bytes", "uint16"]
    elif case == "bin_no_dtype":
        (src / "train.bin").write_bytes(b"\x01" * 1000)
        opts = {"token_column": "tokens"}
        expect = ["train.bin", "--token-dtype"]
    elif case == "string_list":
        pq.write_table(pa.table({"tokens": [["a", "b"]]}), src / "t.parquet")
        opts["token_column"] = "tokens"
        expect = ["t.parquet", "'tokens'", "list<", "string", "integers"]
    elif case == "no_column":
        pq.write_table(pa.table({"ids": [[1, 2]]}), src / "t.parquet")
        opts["token_column"] = "tokens"
        expect = ["t.parquet", "no column 'tokens'", "ids"]
    elif case == "null_row":
        pq.write_table(pa.table({"tokens": [[1, 2], [3], None]}), src / "t.parquet", row_group_size=2)
        opts["token_column"] = "tokens"
        expect = ["t.parquet row 2", "null"]
    elif case == "null_token":
        pq.write_table(pa.table({"tokens": [[1, 2], [3], [4, None, 5]]}), src / "t.parquet", row_group_size=2)
        opts["token_column"] = "tokens"
        expect = ["t.parquet row 2", "null token id"]
    elif case == "two_d":
        np.save(src / "a.npy", np.zeros((3, 4), dtype=np.uint16))
        expect = ["a.npy", "1-D integers", "(3, 4)"]
    elif case == "floats":
        np.save(src / "a.npy", np.zeros(5, dtype=np.float32))
        expect = ["a.npy", "1-D integers", "float32"]
    elif case == "bad_bounds":
        np.save(src / "a.npy", np.zeros(10, dtype=np.uint16))
        np.save(src / "a.docs.npy", np.array([0, 5, 9]))
        expect = ["a.docs.npy", "ascend from 0 to 10"]
    elif case == "too_wide":
        np.save(src / "a.npy", np.array([1, 70000], dtype=np.uint32))
        expect = ["a.npy", "70000", "uint16"]
    elif case == "parquet_no_column_option":
        pq.write_table(pa.table({"tokens": [[1, 2]]}), src / "t.parquet")
        opts = {"token_dtype": "uint16"}
        expect = ["t.parquet", "--token-column"]
    with pytest.raises(SourceError) as info:
        shardkit.pack(str(src), str(tmp_path / "ds"), progress=False, **opts)
    _one_line(info.value, *expect)


def test_parquet_listing_reads_one_row_group_at_a_time(tmp_path, monkeypatch):
    rows = [list(range(i % 50)) for i in range(300)]
    pq.write_table(pa.table({"tokens": rows}), tmp_path / "t.parquet", row_group_size=40)
    read = []
    real = pq.ParquetFile.read_row_group

    def spy(self, i, *args, **kwargs):
        read.append((i, kwargs.get("columns")))
        return real(self, i, *args, **kwargs)

    def whole(self, *args, **kwargs):
        raise AssertionError("listing read the whole file")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    source = TokenSource(tmp_path / "t.parquet", token_column="tokens")
    items = source.list_items()
    assert len(items) == 300 and [i for i, _ in read] == list(range(8)) and {tuple(c) for _, c in read} == {("tokens",)}
    assert pickle.loads(pickle.dumps(source)).load(items[7]).meta["num_tokens"] == 7  # sources go to Ray tasks


def test_resolution(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    np.arange(10, dtype="<u2").tofile(src / "x.bin")
    with pytest.raises(SourceError) as info:
        resolve_source(str(src / "x.bin"))
    _one_line(info.value, "x.bin", "--token-dtype")
    assert isinstance(resolve_source(str(src / "x.bin"), token_dtype="uint16"), TokenSource)
    with pytest.raises(ConfigError) as info2:
        resolve_source(_Other(), token_dtype="uint16")
    _one_line(info2.value, "token_dtype", "applies to token sources only")
    with pytest.raises(SourceError) as info3:
        resolve_source("s3://bucket/tokens/", token_column="tokens")
    _one_line(info3.value, "local disk")
    with pytest.raises(SourceError):
        TokenSource(src, token_dtype="int8")


class _Other:
    """A Source of another kind (only what resolve_source looks at)."""

    def list_items(self):  # pragma: no cover - never listed
        return []

    def load(self, item):  # pragma: no cover
        raise AssertionError

    def describe(self):
        return {"type": "other"}

    def labels(self):
        return None
