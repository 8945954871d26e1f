"""Fuzzing the manifest reader with hypothesis, for a bounded time: ``dataset.json`` as a
reader opens it (shardkit.read.manifest.read_info, shardkit.read.dataset.Dataset), and samples
parquet rows as a reader turns them into :class:`~shardkit.read.rows.ShardRows` and slices
samples with them.

Whatever the bytes, a reader either works or raises a ShardkitError (one line, naming the
file); it never crashes otherwise. A sample it hands out is the bytes its manifest names,
inside its sample, never bytes from elsewhere. The crashes the fuzzing found (dataset.json
entries of the wrong type, nesting too deep to parse, field spans outside their sample) are
kept below as reproducers of their one-line refusal.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.errors import ManifestError, ShardkitError
from shardkit.format.checksums import BLOCK_BYTES_KEY
from shardkit.format.manifest import DATASET_JSON, SAMPLE_COLUMNS, parquet_file
from shardkit.read.dataset import Dataset
from shardkit.read.manifest import manifest_faults
from shardkit.read.rows import ShardInfo, ShardRows, block_checksums, check_spans
from shardkit.read.samples import sample_dicts
from shardkit.read.verify import verify_samples

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])


# ---- dataset.json --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("fuzzds") / "ds"
    rng = np.random.default_rng(3)
    shardkit.pack(iter([{"__key__": f"k{i:03d}", "bin": rng.bytes(300)} for i in range(30)]), str(root),
                  shard_bytes="4KB", progress=False)
    return root, json.loads((root / DATASET_JSON).read_text())


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                     max_leaves=12)


@st.composite
def dataset_jsons(draw: st.DrawFn, good: dict[str, Any]) -> dict[str, Any]:
    """A dataset.json whose entries are each kept, dropped or replaced by any JSON value."""
    info: dict[str, Any] = {}
    for key, value in good.items():
        choice = draw(st.sampled_from(["keep", "keep", "keep", "drop", "replace"]))
        if choice == "keep":
            info[key] = value
        elif choice == "replace":
            info[key] = draw(_json)
    info.update(draw(st.dictionaries(st.text(max_size=6), _json, max_size=2)))
    return info


def _open(root: Path, raw: bytes, strict: bool) -> None:
    (root / DATASET_JSON).write_bytes(raw)
    try:
        ds = Dataset(str(root), strict=strict)
        repr(ds)
        (ds.num_samples, ds.num_shards, ds.fields, ds.labels, ds.identity, ds.shard_list)
        manifest_faults(ds.info, ds.shards)
    except ShardkitError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(data=st.data(), strict=st.booleans())
def test_dataset_json_fields_of_any_type(packed: tuple[Path, dict[str, Any]], data: st.DataObject,
                                         strict: bool) -> None:
    root, good = packed
    info = data.draw(dataset_jsons(good))
    _open(root, json.dumps(info).encode(), strict)


@FUZZ
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_dataset_json_any_bytes(packed: tuple[Path, dict[str, Any]], raw: bytes) -> None:
    root, _ = packed
    _open(root, raw, strict=True)


def _refused(root: Path, raw: bytes, strict: bool) -> str:
    (root / DATASET_JSON).write_bytes(raw)
    with pytest.raises(ManifestError) as err:
        Dataset(str(root), strict=strict)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_deeply_nested_dataset_json(packed: tuple[Path, dict[str, Any]]) -> None:
    """json.loads raises RecursionError, not ValueError, on nesting deeper than it parses."""
    root, _ = packed
    assert "not valid JSON" in _refused(root, b"[" * 100_000, strict=True)


def test_dataset_json_fields_a_number(packed: tuple[Path, dict[str, Any]]) -> None:
    root, good = packed
    assert "fields must be a list" in _refused(root, json.dumps({**good, "fields": 5}).encode(), strict=True)


def test_dataset_json_labels_a_list(packed: tuple[Path, dict[str, Any]]) -> None:
    root, good = packed
    assert "labels must map" in _refused(root, json.dumps({**good, "labels": [1, 2]}).encode(), strict=True)


@pytest.mark.parametrize("value", [None, [1], "many", -3, True])
def test_dataset_json_num_samples_not_a_number(packed: tuple[Path, dict[str, Any]], value: Any) -> None:
    root, good = packed
    info = {k: v for k, v in good.items() if k != "num_samples"}
    if value is not None:
        info["num_samples"] = value
    assert "num_samples must be" in _refused(root, json.dumps(info).encode(), strict=False)


# ---- samples rows ---------------------------------------------------------------------------

NAMES = ["jpg", "cls", "txt"]


@st.composite
def shard_and_rows(draw: st.DrawFn) -> tuple[bytes, pa.Table]:
    """A shard's bytes and sample rows for it: spans mostly inside the shard and the sample,
    sometimes anywhere (negative, past the end, overlapping), checksums mostly right."""
    shard = draw(st.binary(min_size=0, max_size=1500))
    n = len(shard)
    anywhere = st.integers(-2**40, 2**40)
    inside = st.integers(0, max(n, 0))
    rows: dict[str, list[Any]] = {c: [] for c in SAMPLE_COLUMNS.names}
    for i in range(draw(st.integers(1, 5))):
        off = draw(inside | anywhere) if draw(st.integers(0, 9)) == 0 else draw(inside)
        size = draw(anywhere) if draw(st.integers(0, 9)) == 0 else draw(st.integers(0, max(n - max(off, 0), 0)))
        fields = []
        for name in draw(st.lists(st.sampled_from(NAMES), max_size=3)):
            if draw(st.integers(0, 6)) == 0:
                f_off, f_size = draw(anywhere | inside), draw(anywhere | inside)
            else:
                f_off = draw(st.integers(off, off + max(size, 0)))
                f_size = draw(st.integers(0, max(off + max(size, 0) - f_off, 0)))
            fields.append({"name": name, "offset": f_off, "size": f_size})
        ok = 0 <= off and 0 <= size and off + size <= n
        checksum = (xxhash.xxh3_64_intdigest(shard[off:off + size]) if ok and draw(st.integers(0, 9))
                    else draw(st.integers(0, 2**64 - 1)))
        blocks = draw(st.none() | st.lists(st.integers(0, 2**64 - 1), max_size=3))
        for col, value in zip(SAMPLE_COLUMNS.names, [f"s{i}", 0, off, size, fields, checksum, blocks]):
            rows[col].append(value)
    table = pa.table(rows, schema=SAMPLE_COLUMNS)
    if draw(st.booleans()):
        table = table.replace_schema_metadata({BLOCK_BYTES_KEY: draw(st.sampled_from([b"4", b"0", b"-1", b"x", b"1024"]))})
    return shard, table


def _read(shard: bytes, table: pa.Table) -> list[tuple[int, dict[str, Any]]]:
    """What a reader makes of the rows: the fragment's row group read as Dataset.shard_rows
    does, the samples verified as a direct read does, then sliced. Returns (position, sample)."""
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=1 << 20)
    fragment = parquet_file(buf.getvalue(), "fuzz-samples.parquet")
    rows = ShardRows(fragment.read_row_group(0, columns=list(ShardRows.COLUMNS), use_threads=False))
    info = ShardInfo(0, "shards/fuzz.tar", len(rows), len(shard), 0, "", "", 0)
    check_spans(info, rows)  # as Dataset.shard_rows does for every reader
    positions = np.arange(len(rows))
    rows.layout, rows.field_names, rows.nbytes  # noqa: B018 - built as readers build them
    for i in range(len(rows)):
        rows.fields(i)
        try:
            block_checksums(info, rows, i)
        except ShardkitError:
            pass
    view = memoryview(shard)
    verify_samples(view, 0, rows, positions, info.path)
    return list(zip(positions.tolist(), sample_dicts(view, 0, rows, positions, 0, info.path)))


def _spans_inside(table: pa.Table, n: int) -> bool:
    return all(0 <= f["offset"] and 0 <= f["size"] and f["offset"] + f["size"] <= n
               for fields in table.column("fields").to_pylist() for f in fields)


@FUZZ
@given(shard_and_rows())
def test_sample_rows_read_or_refuse(case: tuple[bytes, pa.Table]) -> None:
    shard, table = case
    try:
        got = _read(shard, table)
    except ShardkitError as exc:
        assert "\n" not in str(exc)
        return
    assert _spans_inside(table, len(shard)), "rows with a span outside the shard were read without an error"
    fields = table.column("fields").to_pylist()
    for pos, sample in got:
        for f in fields[pos]:
            assert bytes(sample[f["name"]]) == shard[f["offset"]:f["offset"] + f["size"]] or \
                [g["name"] for g in fields[pos]].count(f["name"]) > 1


def _one(shard: bytes, off: int, size: int, fields: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    rows = {"key": ["s0"], "shard": [0], "offset": [off], "size": [size], "fields": [fields],
            "checksum": [xxhash.xxh3_64_intdigest(shard[off:off + size])], "block_checksums": [None]}
    return _read(shard, pa.table(rows, schema=SAMPLE_COLUMNS))


@pytest.mark.parametrize("f_off, f_size", [(-10, 10), (90, 30), (0, 5), (200, 10)],
                         ids=["negative", "past-the-end", "before-the-sample", "outside-the-shard"])
def test_a_field_outside_its_sample_is_refused(f_off: int, f_size: int) -> None:
    shard = bytes(range(100)) + bytes(range(100))
    try:
        got = _one(shard, 10, 80, [{"name": "bin", "offset": f_off, "size": f_size}])
    except ShardkitError:
        return
    value = bytes(got[0][1]["bin"])
    raise AssertionError(f"field span [{f_off}, {f_off + f_size}) of sample [10, 90) read as {len(value)} bytes "
                         "without an error")
