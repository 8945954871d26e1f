"""LmdbSource: exact round trip, tar-safe unique keys, truncated/corrupt files, URLs, Ray, the install hint."""

from __future__ import annotations

import os
import pickle
import sys
import tracemalloc
from pathlib import Path

import pytest

lmdb = pytest.importorskip("lmdb")

import shardkit  # noqa: E402
from shardkit.cli import main as cli_main  # noqa: E402
from shardkit.errors import ConfigError, SourceError  # noqa: E402
from shardkit.packing.sample import MAX_KEY  # noqa: E402
from shardkit.packing.sources.lmdb import LmdbSource, lmdb_key  # noqa: E402
from shardkit.packing.sources.resolve import resolve_source  # noqa: E402

# Keys a user has: plain names, paths, spaces, binary, ones that look like this module's own
# encodings, and keys too long to spell out in hex.
KEYS = [b"img-0001", b"img_0002", b"a/b.jpg", b"a b.jpg", b"\x00\x00\x00\x07", b"\xff\xfe", b"_61", b"a",
        b"_", b"-", b"x" * MAX_KEY, b"x" * (MAX_KEY + 1), b"\x01" * 300, b"\x01" * 301, "caf\u00e9".encode()]


def make_env(path: Path, items: dict[bytes, bytes], subdir: bool = True) -> Path:
    env = lmdb.open(str(path), subdir=subdir, map_size=1 << 26)
    with env.begin(write=True) as txn:
        for k, v in items.items():
            txn.put(k, v)
    env.close()
    return path


def values() -> dict[bytes, bytes]:
    return {k: os.urandom(50 + 37 * i) + k for i, k in enumerate(KEYS)}


def _one_line(exc: BaseException, *parts: str) -> None:
    msg = str(exc)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


def test_keys_are_tar_safe_unique_and_deterministic():
    keys = [lmdb_key(k) for k in KEYS]
    assert len(set(keys)) == len(KEYS)
    assert keys == [lmdb_key(k) for k in KEYS]
    assert keys[:3] == ["img-0001", "img_0002", "_612f622e6a7067"]  # plain kept; others in hex
    assert lmdb_key(b"_61") == "_5f3631" and lmdb_key(b"a") == "a"    # an "encoded-looking" key cannot collide
    for key in keys:
        assert 0 < len(key) <= MAX_KEY and all(c.isascii() and (c.isalnum() or c in "_-") for c in key), key


def test_round_trips_exactly_with_the_original_key(tmp_path):
    items = values()
    env = make_env(tmp_path / "train.lmdb", items)
    url = str(tmp_path / "ds")
    info = shardkit.pack(str(env), url, lmdb_field="JPG", shard_bytes="4KB", progress=False)
    assert info["num_samples"] == len(items) and info["num_shards"] > 1 and info["fields"] == ["jpg"]
    assert info["source"] == {"type": "lmdb", "path": str(env), "field": "jpg"}
    ds = shardkit.open_dataset(url)
    rows = ds.samples.to_pylist()
    assert [r["lmdb_key"] for r in rows] == sorted(items)       # LMDB's byte order, keys exactly
    assert [r["key"] for r in rows] == [lmdb_key(k) for k in sorted(items)]
    streamed = {s["__key__"]: bytes(s["jpg"]) for s in shardkit.StreamingDataset(url, cache_dir=None)}
    assert streamed == {lmdb_key(k): v for k, v in items.items()}


def test_a_data_file_without_subdir_and_the_default_field(tmp_path):
    items = {b"k%04d" % i: bytes([i % 256]) * i for i in range(200)}
    data = make_env(tmp_path / "flat.mdb", items, subdir=False)
    (tmp_path / "flat.mdb-lock").unlink()  # the writer's
    data.chmod(0o444)
    assert data.is_file()
    info = shardkit.pack(str(data), str(tmp_path / "ds"), progress=False)
    assert info["fields"] == ["bin"] and info["num_samples"] == 200
    got = {s["__key__"]: bytes(s["bin"]) for s in shardkit.open_dataset(str(tmp_path / "ds")).iter_samples()}
    assert got == {k.decode(): v for k, v in items.items()}
    assert not (tmp_path / "flat.mdb-lock").exists()  # lock=False: nothing written beside a read-only copy


def test_listing_memory_per_key_is_bounded(tmp_path):
    n = 20_000
    env = make_env(tmp_path / "many", {b"%012d" % i: b"v" * 64 for i in range(n)})
    src = LmdbSource(env)
    tracemalloc.start()
    try:
        items = src.list_items()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(items) == n
    # A SourceItem, its key (the ref is the same string) and its list slot; values are never copied.
    assert peak / n < 250, peak / n
    assert items[5].ref is items[5].key


def test_truncated_and_corrupt_files_are_one_line_naming_the_file(tmp_path):
    env = make_env(tmp_path / "ok", {b"k%05d" % i: bytes([i % 251]) * 100 for i in range(2000)})
    data = (env / "data.mdb").read_bytes()
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "data.mdb").write_bytes(data[:len(data) // 2])   # would be SIGBUS if its pages were touched
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(cut), str(tmp_path / "a"), on_error="skip", progress=False)
    _one_line(err.value, f"{cut}/data.mdb", "truncated LMDB file", "copy it again")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "data.mdb").write_bytes(os.urandom(len(data)))
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(junk), str(tmp_path / "b"), progress=False)
    _one_line(err.value, f"{junk}/data.mdb", "not a readable LMDB environment")
    # The first tree page's type zeroed: a damage LMDB detects. (LMDB keeps no page checksums:
    # other damage inside the tree can fail an assertion in LMDB and abort the process.)
    ro = lmdb.open(str(env), readonly=True, lock=False)
    psize = ro.stat()["psize"]
    ro.close()
    bad = bytearray(data)
    bad[psize * 2 + 10:psize * 2 + 12] = b"\0\0"           # mp_flags of page 2
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "data.mdb").write_bytes(bytes(bad))
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(broken), str(tmp_path / "c"), progress=False)
    _one_line(err.value, f"{broken}/data.mdb", "corrupt LMDB environment")


class _LosesAKey(LmdbSource):
    """An environment that loses a key between listing and packing (rewritten meanwhile)."""

    def list_items(self):
        items = super().list_items()
        env = lmdb.open(self.path, map_size=1 << 26)
        with env.begin(write=True) as txn:
            txn.delete(b"k00003")
        env.close()
        return items


def test_a_key_gone_since_listing_is_named_or_skipped(tmp_path):
    items = {b"k%05d" % i: b"v%d" % i for i in range(10)}
    with pytest.raises(SourceError) as err:
        shardkit.pack(_LosesAKey(make_env(tmp_path / "a", items)), str(tmp_path / "da"), progress=False)
    _one_line(err.value, f"{tmp_path / 'a'}/data.mdb", "key b'k00003' is gone")
    info = shardkit.pack(_LosesAKey(make_env(tmp_path / "b", items)), str(tmp_path / "db"), on_error="skip",
                         progress=False)
    assert info["num_samples"] == 9 and [s["key"] for s in info["skipped"]] == ["k00003"]


def test_urls_are_refused_in_one_line(tmp_path):
    with pytest.raises(SourceError) as err:
        shardkit.pack("s3://bucket/train.lmdb", str(tmp_path / "a"), progress=False)
    _one_line(err.value, "s3://bucket/train.lmdb", "local disk only", "copy it to a local path first")


def test_resolve_cli_and_options(tmp_path):
    env = make_env(tmp_path / "plain", {b"a": b"1", b"b": b"2"})
    assert isinstance(resolve_source(str(env)), LmdbSource)            # sniffed by data.mdb
    assert cli_main(["pack", str(env), str(tmp_path / "ds"), "--lmdb-field", "txt", "--quiet"]) == 0
    assert [bytes(s["txt"]) for s in shardkit.open_dataset(str(tmp_path / "ds")).iter_samples()] == [b"1", b"2"]
    with pytest.raises(ConfigError) as err:
        resolve_source(str(env), zarr_rows="x")
    _one_line(err.value, "zarr_rows", "lmdb source")
    (tmp_path / "keyed").mkdir()
    (tmp_path / "keyed" / "a.txt").write_text("a")
    with pytest.raises(ConfigError) as err:
        resolve_source(str(tmp_path / "keyed"), lmdb_field="jpg")
    _one_line(err.value, "lmdb_field (--lmdb-field jpg) applies to LMDB sources only")
    assert cli_main(["pack", str(tmp_path / "keyed"), str(tmp_path / "d2"), "--lmdb-field", "jpg", "--quiet"]) == 2
    with pytest.raises(SourceError) as err:
        LmdbSource(env, field="a/b")
    _one_line(err.value, "lmdb_field", "invalid field name")


def test_missing_lmdb_gives_the_install_hint(tmp_path, monkeypatch):
    env = make_env(tmp_path / "e", {b"a": b"1"})
    monkeypatch.setitem(sys.modules, "lmdb", None)  # import lmdb now raises ImportError
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(env), str(tmp_path / "ds"), progress=False)
    assert str(err.value) == "LmdbSource needs lmdb: pip install 'shardkit[lmdb]'"


def test_pickles_without_the_open_environment(tmp_path):
    src = LmdbSource(make_env(tmp_path / "e", {b"a": b"1", b"b": b"2"}))
    items = src.list_items()
    assert src.load(items[0]).fields == {"bin": b"1"} and src._env is not None
    copy = pickle.loads(pickle.dumps(src))
    assert copy._env is None and copy.load(items[1]).fields == {"bin": b"2"}
    src.task_done()
    assert src._env is None


@pytest.mark.s3
@pytest.mark.ray
@pytest.mark.slow
def test_ray_engine_equals_local(tmp_path, ray_local, s3_server, s3_bucket):
    from test_pack_ray import compare_datasets

    env = make_env(tmp_path / "r.lmdb", {b"k%05d" % i: os.urandom(3000) for i in range(120)})
    opts = s3_server.storage_options()
    kw = {"lmdb_field": "npy", "shard_bytes": "64KB", "task_bytes": "128KB", "storage_options": opts,
          "progress": False}
    ray_info = shardkit.pack(str(env), f"{s3_bucket}/ray", engine="ray", **kw)
    shardkit.pack(str(env), f"{s3_bucket}/local", **kw)
    assert ray_info["tasks"] >= 3
    compare_datasets(f"{s3_bucket}/ray", f"{s3_bucket}/local", opts)
