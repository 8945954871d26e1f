"""Selections (``where=``, ``indices=``) of a dataset's samples: the DuckDB query agrees with
pyarrow's filter of the same manifest, bad input is refused in one line, the partition over a
selection is exact, a node evaluates a query once, and side columns (annotate) join back."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import shardkit
from shardkit.errors import ConfigError, ManifestError
from shardkit.read.cache_refs import cache_namespace
from shardkit.read.dataset import Dataset
from shardkit.read.manifest_copies import manifest_copies_dir
from shardkit.read.partition import (consumed_remaining, rank_ranges, schedule_shards, worker_ranges,
                                     worker_schedule)
from shardkit.read.selection import check_indices, select
from shardkit.read.where import where_count, where_indices

N = 800
REPO = Path(__file__).resolve().parents[2]


def items(n: int = N) -> list[dict[str, Any]]:
    rng = np.random.default_rng(5)
    return [{"__key__": f"k{i:05d}", "bin": rng.bytes(int(rng.integers(10, 300))),
             "__meta__": {"label": i % 13, "width": (i * 37) % 400, "score": float((i * 7919) % 1000) / 100,
                          "source": ["web", "curated", "books"][i % 3]}} for i in range(n)]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    dest = str(tmp_path_factory.mktemp("where") / "ds")
    shardkit.pack(iter(items()), dest, shard_samples=50, progress=False)
    return dest


def opened(url: str) -> Dataset:
    ds = Dataset(url)
    ds.manifest_cache = manifest_copies_dir(cache_namespace(ds))
    return ds


QUERIES = [
    ("label < 5 AND width >= 224", lambda t: pc.and_(pc.less(t["label"], 5), pc.greater_equal(t["width"], 224))),
    ("source = 'curated' OR score > 9.5", lambda t: pc.or_(pc.equal(t["source"], "curated"),
                                                           pc.greater(t["score"], 9.5))),
    ("key LIKE 'k001%'", lambda t: pc.starts_with(t["key"], "k001")),
    ("shard IN (2, 3) AND size > 200", lambda t: pc.and_(pc.is_in(t["shard"], pa.array([2, 3], pa.int32())),
                                                         pc.greater(t["size"], 200))),
]


@pytest.mark.parametrize(("where", "expr"), QUERIES, ids=[q for q, _ in QUERIES])
def test_selection_equals_pyarrows_filter_of_the_manifest(url: str, where: str, expr: Any) -> None:
    ds = opened(url)
    table = ds.samples  # global order
    expected = np.flatnonzero(expr(table).to_numpy(zero_copy_only=False))
    got = where_indices(ds, where)
    assert got.dtype == np.int64 and got.tolist() == expected.tolist() and len(got) > 0
    count, size = where_count(ds, where)
    assert count == len(expected) and size == int(pc.sum(table["size"].take(pa.array(expected))).as_py())


@pytest.mark.parametrize(("where", "says"), [
    ("lable < 5", '"lable" not found'),
    ("label <<< 5", "<<<"),
    ("label < 'x' +", "syntax error"),
])
def test_a_bad_query_gets_one_line_naming_the_error_and_the_columns(url: str, where: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        select(opened(url), where=where)
    msg = str(info.value)
    assert "\n" not in msg and says in msg and "columns: key, shard, offset, size" in msg and "label" in msg, msg


def test_indices_are_checked_naming_the_first_bad_one(url: str) -> None:
    assert check_indices([5, 1, 3], N).tolist() == [1, 3, 5]
    with pytest.raises(ConfigError, match=r"^indices\[2\]=800 is out of range \[0, 800\)"):
        check_indices([1, 2, 800, -1], N)
    with pytest.raises(ConfigError, match=r"lists sample 7 twice \(at positions 1 and 3\)"):
        check_indices([3, 7, 9, 7, 9], N)
    with pytest.raises(ConfigError, match="1-D sequence of integers"):
        check_indices([1.5, 2.0], N)
    with pytest.raises(ConfigError, match="not both"):
        select(opened(url), where="label < 1", indices=[1])
    with pytest.raises(ConfigError, match="selects no sample"):
        select(opened(url), where="label > 100")


@pytest.mark.parametrize(("world", "workers", "shuffle"), [(2, 2, True), (3, 1, True), (4, 3, False)])
def test_ranks_and_workers_split_the_selection_exactly(url: str, world: int, workers: int, shuffle: bool) -> None:
    ds = opened(url)
    sel = select(ds, where="label < 4 AND shard % 3 != 1")
    assert sel is not None
    order = sel.order(epoch=3, seed=7, shuffle=shuffle, block_shards=2)
    first = ds.first_samples
    selected = set(sel.indices.tolist())
    n = len(sel)
    per_rank = -(-n // world)
    got: list[int] = []
    for rank in range(world):
        mine = rank_ranges([(0, n)], rank, world)
        rank_got = []
        for w in range(workers):
            ranges = worker_ranges(mine, w, workers, chunk=4)
            runs = list(worker_schedule(order, ranges))
            rank_got += [int(first[s]) + int(p) for s, ps in runs for p in ps]
            # Shards with no selected sample are never scheduled (so never fetched).
            assert all(sel.counts[s] > 0 for s in schedule_shards(order, ranges))
        assert len(rank_got) == per_rank  # equal counts per rank
        got += rank_got
    counts = Counter(got)
    assert set(counts) == selected  # the union is the selection
    assert sum(c - 1 for c in counts.values()) == world * per_rank - n  # only the padding repeats


def test_resume_with_another_world_size_covers_the_selection_once(url: str) -> None:
    ds = opened(url)
    sel = select(ds, where="score < 5")
    assert sel is not None
    order = sel.order(epoch=1, seed=3, shuffle=True)
    first = ds.first_samples
    n, k = len(sel), 17

    def keys(ranges: list[tuple[int, int]]) -> list[int]:
        return [int(first[s]) + int(p) for s, ps in worker_schedule(order, ranges) for p in ps]

    seen = [g for r in range(2) for g in keys(rank_ranges([(0, n)], r, 2))[:k]]
    left = consumed_remaining([(0, n)], 2, False, k)
    rest = [g for r in range(3) for g in keys(rank_ranges(left, r, 3))]
    padding = 3 * -(-(n - 2 * k) // 3) - (n - 2 * k)
    assert len(set(seen)) == len(seen) == 2 * k and not set(seen) & set(rest)
    assert set(seen) | set(rest) == set(sel.indices.tolist())
    assert len(rest) - len(set(rest)) == padding  # nothing seen before comes again; only padding repeats


_ONCE = """
import sys
from shardkit.read.dataset import Dataset
from shardkit.read.manifest_copies import manifest_copies_dir
from shardkit.read.cache_refs import cache_namespace
from shardkit.read.selection import select
ds = Dataset(sys.argv[1])
ds.manifest_cache = manifest_copies_dir(cache_namespace(ds))
sel = select(ds, where=sys.argv[2])
print(int(sel.computed), len(sel), int(sel.indices.sum()))
"""


@pytest.mark.slow  # three interpreters importing pyarrow and duckdb at once
def test_processes_of_a_node_evaluate_a_query_once(url: str) -> None:
    where = "label = 3 AND width > 50"  # no other test runs this query: nothing stored yet
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _ONCE, url, where], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(int(o[0]) for o in outs) == 1, outs  # one evaluation; the others loaded its stored result
    expected = where_indices(opened(url), where)
    assert {(int(o[1]), int(o[2])) for o in outs} == {(len(expected), int(expected.sum()))}


def test_annotate_round_trip_usable_in_where(url: str, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from shardkit.read.annotations import Annotations

    keys = [f"k{i:05d}" for i in range(0, N, 4)]
    table = pa.table({"key": keys, "aesthetic": [float(i % 10) for i in range(0, N, 4)],
                      "caption": [f"c{i}" for i in range(0, N, 4)]})
    path = tmp_path / "aesthetic.parquet"
    pq.write_table(table, path)
    out = shardkit.annotate(url, path)
    assert out["rows"] == len(keys) and out["columns"] == ["aesthetic", "caption"]
    ds = opened(url)
    got = where_indices(ds, "aesthetic > 5 AND label < 7")
    assert got.tolist() == [i for i in range(0, N, 4) if i % 10 > 5 and i % 13 < 7]
    side = Annotations(ds)
    assert side.row(8) == {"aesthetic": 8.0, "caption": "c8"} and side.row(9) == {"aesthetic": None, "caption": None}
    with pytest.raises(ConfigError, match="exist in an annotation"):
        shardkit.annotate(url, path)  # the same columns again, without overwrite


@pytest.mark.parametrize(("table", "says"), [
    ({"key": ["k00001", "nope", "gone"], "x": [1, 2, 3]}, r"2 key value\(s\) are not in .*: 'gone', 'nope'"),
    ({"key": ["k00001", "k00002", "k00001"], "x": [1, 2, 3]}, r"lists key 'k00001' more than once"),
    ({"key": ["k00001"], "label": [1]}, r"column\(s\) 'label' are manifest columns"),
    ({"id": ["k00001"], "x": [1]}, r"has no column 'key' to join on \(columns: id, x\)"),
    ({"key": ["k00001", None], "x": [1, 2]}, r"1 row\(s\) have no 'key'"),
])
def test_a_bad_annotation_table_is_refused_in_one_line(url: str, table: dict[str, list[Any]], says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        shardkit.annotate(url, pa.table(table), name="bad")
    assert "\n" not in str(info.value)
    assert not Dataset(url).store.exists("manifest/annotations/bad.parquet")


def test_an_annotation_holds_for_its_shards_and_more_appended_not_another_pack(tmp_path: Path) -> None:
    a, grown, other = str(tmp_path / "a"), str(tmp_path / "grown"), str(tmp_path / "other")
    shardkit.pack(iter(items(100)), a, shard_samples=50, progress=False)
    # The same first two shards (packing is deterministic) and one more: as an append makes it.
    shardkit.pack(iter(items(120)), grown, shard_samples=50, progress=False)
    shardkit.pack(iter(dict(it, bin=b"x" + it["bin"]) for it in items(120)), other, shard_samples=50, progress=False)
    shardkit.annotate(a, pa.table({"key": ["k00001"], "x": [1]}), name="side")
    for dest in (grown, other):
        os.makedirs(f"{dest}/manifest/annotations")
        os.link(f"{a}/manifest/annotations/side.parquet", f"{dest}/manifest/annotations/side.parquet")
    assert where_indices(opened(grown), "x = 1").tolist() == [1]
    with pytest.raises(ManifestError, match="was written for another pack"):
        where_indices(opened(other), "x = 1")


def test_without_node_copies_a_query_leaves_no_files_behind(url: str) -> None:
    import tempfile

    def scratch() -> set[str]:
        return {p.name for p in Path(tempfile.gettempdir()).glob("shardkit-where-*")}

    before = scratch()
    ds = Dataset(url)  # manifest_cache None: fragments copied to a scratch directory, then removed
    assert where_indices(ds, "label = 2").tolist() == where_indices(opened(url), "label = 2").tolist()
    assert scratch() == before


def folder_of(root: Path, count: int, salt: bytes = b"") -> Path:
    """``count`` files of differing sizes (so ``size`` tells them apart), each its own bytes."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (root / f"f{i:03d}.bin").write_bytes(salt + bytes([i % 251]) * (200 + 37 * i))
    return root


def test_a_first_rank_on_s3_queries_fragments_as_they_land_and_gets_the_whole_scans_answer(
        s3_env: Any, s3_bucket: str, tmp_path: Path) -> None:
    url = f"{s3_bucket}/ds"
    shardkit.pack(str(folder_of(tmp_path / "src", 60)), url, shard_bytes="6KB", task_bytes="12KB", progress=False)
    ds = Dataset(url)
    ds.manifest_cache = str(tmp_path / "copies")  # empty: this process is the node's first rank
    names = sorted({s.samples_file for s in ds.shard_list})
    assert len(names) > 8  # more fragments than are fetched at once
    where = "size % 3 = 0 AND shard > 1"
    sizes, shards = ds.samples["size"].to_numpy(), ds.samples["shard"].to_numpy()
    expected = np.flatnonzero((sizes % 3 == 0) & (shards > 1))
    got = where_indices(ds, where)
    assert got.dtype == np.int64 and len(expected) > 0 and got.tolist() == expected.tolist()
    assert sorted(p.name for p in (tmp_path / "copies").iterdir()) == sorted(copy_path_names(names))
    assert where_count(ds, where) == (len(expected), int(pc.sum(ds.samples["size"].take(pa.array(expected))).as_py()))
    # The whole-manifest scan over the copies (what every query ran before) agrees.
    from shardkit.read.where import connect

    sql = connect(ds)
    try:
        rows = sql.con.sql(sql.scan).filter(where).project("file_index, file_row_number").fetchnumpy()
        whole = np.sort(sql.global_indices(rows["file_index"], np.asarray(rows["file_row_number"], np.int64)))
    finally:
        sql.close()
    assert whole.tolist() == got.tolist()


def copy_path_names(names: list[str]) -> list[str]:
    from shardkit.cache.files import file_name

    return [file_name(n) for n in names]


def test_fragments_of_differing_columns_are_queried_as_one_scan_unified_by_name(tmp_path: Path) -> None:
    # Version 1 from plain files has no label; the appended image folder's fragments do.
    from PIL import Image

    url = str(tmp_path / "ds")
    shardkit.pack(str(folder_of(tmp_path / "a", 30)), url, shard_samples=5, shard_bytes="4KB", task_bytes="8KB",
                  progress=False)
    for c in ("cat", "dog"):
        (tmp_path / "b" / c).mkdir(parents=True)
        for i in range(10):
            Image.new("L", (2, 2), i).save(tmp_path / "b" / c / f"{c}{i:02d}.png")
    shardkit.pack(str(tmp_path / "b"), url, shard_samples=5, shard_bytes="4KB", task_bytes="8KB",
                  labels_from_dirs=True, progress=False, append=True)
    ds = opened(url)
    assert where_indices(ds, "label = 1").tolist() == list(range(40, 50))  # the dogs, after 30 files and 10 cats
    assert where_indices(ds, "label IS NULL").tolist() == list(range(30))
    assert where_count(ds, "label IS NOT NULL")[0] == 20
    with pytest.raises(ConfigError, match='"lable" not found'):
        where_indices(ds, "lable = 1")


def test_a_node_copy_of_another_packs_fragment_is_fetched_again_not_used(tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    shardkit.pack(str(folder_of(tmp_path / "old", 20)), url, shard_bytes="6KB", task_bytes="12KB", progress=False)
    old = Dataset(url)
    copies = str(tmp_path / "copies")
    old.manifest_cache = copies
    assert len(where_indices(old, "size > 0")) == 20  # copies of the old pack's fragments kept
    shardkit.pack(str(folder_of(tmp_path / "new", 20, salt=b"x")), url, shard_bytes="6KB", task_bytes="12KB",
                  overwrite=True, progress=False)
    sums = Dataset(url).samples["checksum"].to_pylist()  # from storage: each sample's bytes differ from the old's
    reader = Dataset(url)
    reader.manifest_cache = copies  # as if both packs had one copies directory
    assert reader.shard_samples(0)["checksum"].to_pylist() == sums[:reader.shard_list[0].num_samples]
    query = Dataset(url)
    query.manifest_cache = copies
    assert where_indices(query, f"checksum = {sums[7]}").tolist() == [7]
    again = Dataset(url)
    again.manifest_cache = copies  # every copy is the new pack's now
    assert where_indices(again, f"checksum IN ({sums[3]}, {sums[19]})").tolist() == [3, 19]
