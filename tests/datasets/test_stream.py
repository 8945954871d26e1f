"""StreamingDataset / StreamingDataLoader semantics in one process (plus DataLoader workers),
on local and SeaweedFS S3 datasets packed with shardkit.pack."""

from __future__ import annotations

import shutil


import fcntl
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shardkit
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.read import shard_source as shardio
from shardkit.batch.collate import unpack
from shardkit.config import human_bytes
from shardkit.cache.shard_cache import ShardCache
from shardkit.errors import ConfigError, IntegrityError
from shardkit.read.cache_refs import cache_namespace, shard_ref
from shardkit.read.shard_source import ShardSource

N = 600  # divisible by 1, 2, 3, 4


def samples(n: int = N, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        size = int(rng.integers(50, 4000)) if i % 97 else 40_000  # a few big ones: uneven shards
        out.append({"__key__": f"s{i:05d}", "bin": rng.bytes(size), "cls": str(i % 10).encode()})
    return out


def make(dest: str, storage_options: dict[str, Any] | None = None, n: int = N) -> dict[str, bytes]:
    data = samples(n)
    shardkit.pack(iter(data), dest, shard_bytes="60KB", storage_options=storage_options, progress=False)
    return {s["__key__"]: s["bin"] for s in data}


@pytest.fixture(scope="module")
def local_ds(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("stream")
    content = make(str(root / "ds"))
    return str(root / "ds"), content


def keys_of(it: Any) -> list[str]:
    out: list[str] = []
    for x in it:
        out.extend(x["__key__"] if isinstance(x["__key__"], list) else [x["__key__"]])
    return out


def test_dataset_has_many_uneven_shards(local_ds: tuple[str, dict[str, bytes]]) -> None:
    ds = shardkit.open_dataset(local_ds[0])
    sizes = ds.shards.column("num_samples").to_pylist()
    assert ds.num_shards >= 20 and len(set(sizes)) > 3


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_key_once_per_epoch_local(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path, world: int) -> None:
    url, content = local_ds
    seen: list[str] = []
    for rank in range(world):
        s = StreamingDataset(url, cache_dir=tmp_path / "c", shuffle=True, seed=1, rank=rank, world_size=world)
        got = list(s)
        assert len(got) == len(s) == N // world
        for x in got:
            assert bytes(x["bin"]) == content[x["__key__"]]
        seen += [x["__key__"] for x in got]
    assert Counter(seen) == Counter(content.keys())  # no padding: N % world == 0


def test_every_key_once_s3_env_and_no_cache_equal(s3_env: Any, s3_bucket: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    content = make(f"{s3_bucket}/ds")
    url = f"{s3_bucket}/ds"
    seen = []
    for rank in range(2):  # RANK/WORLD_SIZE from the environment
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        cached = StreamingDataset(url, cache_dir=tmp_path / "c", shuffle=True, seed=3)
        direct = StreamingDataset(url, cache_dir=None, shuffle=True, seed=3)
        a, b = list(cached), list(direct)
        assert [x["__key__"] for x in a] == [x["__key__"] for x in b]
        assert all(bytes(x["bin"]) == bytes(y["bin"]) == content[x["__key__"]] for x, y in zip(a, b))
        assert len(a) == len(cached) == N // 2
        seen += [x["__key__"] for x in a]
        st = direct.stats()
        assert st["direct_reads"] > 0 and st["hits"] == st["misses"] == 0
    assert Counter(seen) == Counter(content.keys())


def test_shuffle_epochs_differ_and_reproduce(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, _ = local_ds
    a = StreamingDataset(url, cache_dir=tmp_path, shuffle=True, seed=7)
    e0 = keys_of(a)
    a.set_epoch(1)
    e1 = keys_of(a)
    b = StreamingDataset(url, cache_dir=tmp_path, shuffle=True, seed=7)
    b.set_epoch(1)
    assert e0 != e1 and sorted(e0) == sorted(e1)
    assert keys_of(b) == e1
    c = StreamingDataset(url, cache_dir=tmp_path, shuffle=True, seed=8)
    assert keys_of(c) != e0


@pytest.mark.parametrize("drop_last", [False, True])
def test_len_padding_drop_last(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path, drop_last: bool) -> None:
    url, content = local_ds
    world = 7  # 600 % 7 == 5
    seen: list[str] = []
    for rank in range(world):
        s = StreamingDataset(url, cache_dir=tmp_path, drop_last=drop_last, rank=rank, world_size=world)
        got = keys_of(s)
        assert len(got) == len(s) == (N // world if drop_last else -(-N // world))
        sb = StreamingDataset(url, cache_dir=tmp_path, drop_last=drop_last, rank=rank, world_size=world, batch_size=16)
        batches = list(sb)
        assert len(batches) == len(sb)
        assert keys_of(batches) == (got[:len(sb) * 16] if drop_last else got)  # drop_last: whole batches only
        seen += got
    counts = Counter(seen)
    if drop_last:
        assert len(seen) == N - N % world and max(counts.values()) == 1
    else:
        assert set(counts) == set(content) and sum(counts.values()) - N == world - N % world


@pytest.mark.parametrize("new_world,cached", [(1, True), (3, True), (3, False)])
def test_resume_elastic_in_process(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path, new_world: int,
                                   cached: bool) -> None:
    url, content = local_ds
    cache = tmp_path if cached else None  # without a cache: segments planned from the remaining ranges
    k = 36  # 600 - 2*36 = 528: divisible by 1 and 3, so no padding repeats
    consumed: list[str] = []
    state = None
    for rank in range(2):
        s = StreamingDataset(url, cache_dir=cache, shuffle=True, seed=2, rank=rank, world_size=2)
        s.set_epoch(4)
        it = iter(s)
        consumed += [next(it)["__key__"] for _ in range(k)]
        it.close()
        state = s.state_dict()  # in-process count: k
        assert state["consumed_per_rank"] == k
    rest: list[str] = []
    for rank in range(new_world):
        s = StreamingDataset(url, cache_dir=cache, shuffle=True, seed=2, rank=rank, world_size=new_world)
        s.load_state_dict(state)
        s.set_epoch(4)  # same epoch: the resumed position is kept
        got = keys_of(s)
        assert len(got) == len(s)
        rest += got
    assert Counter(consumed + rest) == Counter(content.keys())


@pytest.mark.parametrize("cached", [True, False])
def test_dataloader_workers_exact_order_and_resume(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path,
                                                    cached: bool) -> None:
    url, content = local_ds
    cache = tmp_path if cached else None
    ref = keys_of(StreamingDataLoader(StreamingDataset(url, cache_dir=cache, shuffle=True), batch_size=16))
    loader = StreamingDataLoader(StreamingDataset(url, cache_dir=cache, shuffle=True), batch_size=16,
                                 num_workers=2, pin_memory=True)
    assert keys_of(loader) == ref  # workers take turns in whole batches: the same order
    it = iter(loader)
    first = keys_of(next(it) for _ in range(5))
    state = loader.state_dict()
    del it
    assert state["consumed_per_rank"] == 80
    resumed = StreamingDataLoader(StreamingDataset(url, cache_dir=cache, shuffle=True), batch_size=16, num_workers=1)
    resumed.load_state_dict(state)
    rest = keys_of(resumed)
    assert first + rest == ref
    assert Counter(first + rest) == Counter(content.keys())


@pytest.mark.parametrize("workers", [0, 2])
def test_unbatched_loader_counts_samples_and_resumes(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path,
                                                      workers: int) -> None:
    # No batch_size anywhere: the loader yields single samples, each one consumed sample
    # (not len() of its key string, which skipped samples on resume).
    url, content = local_ds
    loader = StreamingDataLoader(StreamingDataset(url, cache_dir=tmp_path, shuffle=True), num_workers=workers)
    it = iter(loader)
    first = [next(it)["__key__"] for _ in range(100)]
    state = loader.state_dict()
    del it
    assert state["consumed_per_rank"] == 100
    resumed = StreamingDataLoader(StreamingDataset(url, cache_dir=tmp_path, shuffle=True), num_workers=1)
    resumed.load_state_dict(state)
    rest = keys_of(resumed)
    assert Counter(first + rest) == Counter(content.keys())


def test_batches_of_decoded_tuples_count_the_short_last_batch(local_ds: tuple[str, dict[str, bytes]],
                                                              tmp_path: Path) -> None:
    # A decoder's tuples carry no keys the loader can count: every batch counts as full but
    # the rank's last, so a state saved at the end of the epoch is exact (600 = 37 x 16 + 8).
    url, content = local_ds
    def make() -> StreamingDataLoader:
        ds = StreamingDataset(url, cache_dir=tmp_path, shuffle=True, decode=lambda s: (s["__key__"], len(s["bin"])))
        return StreamingDataLoader(ds, batch_size=16, num_workers=2)
    loader = make()
    it = iter(loader)
    first = [k for _ in range(5) for k in next(it)[0]]
    assert loader.state_dict()["consumed_per_rank"] == 80
    del it
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    rest = [k for keys, _ in resumed for k in keys]
    assert Counter(first + rest) == Counter(content.keys())
    assert resumed.state_dict()["consumed_per_rank"] == N - 80
    whole = make()
    assert sum(len(keys) for keys, _ in whole) == N and whole.state_dict()["consumed_per_rank"] == N


def test_batched_dataset_in_workers_resume_world_change(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, content = local_ds
    consumed, state = [], None
    for rank in range(2):
        ds = StreamingDataset(url, cache_dir=tmp_path, shuffle=True, batch_size=20, rank=rank, world_size=2)
        loader = StreamingDataLoader(ds, num_workers=2, pin_memory=True)
        assert len(loader) == len(ds) == 15
        it = iter(loader)
        for _ in range(3):  # 600 - 2*60 = 480 remain: divisible by 3, no padding
            b = next(it)
            assert isinstance(b["bin"], torch.Tensor)  # pin_memory=True: a no-op without an accelerator
            for key, body in zip(b["__key__"], unpack(b, "bin")):
                assert bytes(body) == content[key]
            consumed += b["__key__"]
        state = loader.state_dict()
        del it
    rest = []
    for rank in range(3):
        ds = StreamingDataset(url, cache_dir=tmp_path, shuffle=True, batch_size=20, rank=rank, world_size=3)
        loader = StreamingDataLoader(ds, num_workers=2)
        loader.load_state_dict(state)
        rest += keys_of(loader)
    assert Counter(consumed + rest) == Counter(content.keys())


def test_persistent_workers_see_set_epoch(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, _ = local_ds
    ds = StreamingDataset(url, cache_dir=tmp_path, shuffle=True, seed=5, batch_size=32)
    loader = StreamingDataLoader(ds, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        epochs.append(keys_of(loader))
    expect = []
    for epoch in range(2):
        solo = StreamingDataset(url, cache_dir=tmp_path, shuffle=True, seed=5, batch_size=32)
        solo.set_epoch(epoch)
        expect.append(keys_of(solo))
    assert epochs == expect and epochs[0] != epochs[1]
    st = ds.stats()  # both epochs of both persistent workers, accumulated
    assert st["samples"] == 2 * N and len(st["wait_seconds_per_worker"]) == 2


def test_stats_cold_then_warm_with_workers(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, _ = local_ds
    info = shardkit.open_dataset(url)
    total = int(sum(info.shards.column("bytes").to_pylist()))
    ds = StreamingDataset(url, cache_dir=tmp_path, batch_size=25)
    loader = StreamingDataLoader(ds, num_workers=2)
    keys_of(loader)
    cold = ds.stats()
    assert cold["bytes_fetched"] == total  # every shard downloaded once into the shared cache
    assert cold["misses"] + cold["prefetched"] == info.num_shards
    assert cold["samples"] == N and cold["evictions"] == 0
    keys_of(loader)
    warm = ds.stats()
    assert warm["bytes_fetched"] == total and warm["misses"] == cold["misses"]
    assert warm["hits"] - cold["hits"] >= info.num_shards  # each worker opens its shards from the cache
    assert warm["samples"] == 2 * N


def test_unfinished_iterator_at_exit_prints_nothing(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    # Peeking at one sample and ending the script: the iterator is closed at interpreter exit,
    # after builtins are gone; its final stats write must not print "Exception ignored".
    url, _ = local_ds
    # Whether the iterator outlives builtins depends on the order the script's globals are
    # cleared in at exit: this order (a function defined first) showed it every time.
    # faulthandler turns a hang at exit (prefetch threads frozen holding their lock, 1 run in
    # ~36 with 6 at once before the fix) into a failure that shows every thread's stack.
    code = ("import faulthandler; faulthandler.dump_traceback_later(90, exit=True)\n"
            "import sys, time, os\n"
            "def rss():\n    return 1\n"
            "import shardkit\n"
            "s = shardkit.StreamingDataset(sys.argv[1], cache_dir=sys.argv[2], shuffle=True)\n"
            "it = iter(s); x = next(it)\n"
            "print(x['__key__'])\n")
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code, url, str(tmp_path)], capture_output=True, text=True,
                              timeout=150)
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
        assert done.stderr == "", done.stderr


def test_corrupt_cached_shard_is_refetched(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, content = local_ds
    ds = StreamingDataset(url, cache_dir=tmp_path)
    list(ds)
    cached = sorted(p for p in tmp_path.rglob("*.tar") if ".tmp" not in p.parts)
    victim = cached[3]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    ds2 = StreamingDataset(url, cache_dir=tmp_path)
    got = list(ds2)
    assert all(bytes(x["bin"]) == content[x["__key__"]] for x in got) and len(got) == N
    assert ds2.stats()["corrupt_refetches"] == 1


@pytest.mark.parametrize("world", [1, 8])  # a reader of every sample, and of a share of them
def test_corrupt_remote_object_no_cache_names_shard_and_sample(s3_env: Any, s3_bucket: str, world: int) -> None:
    url = f"{s3_bucket}/ds"
    make(url, n=200)
    ds = shardkit.open_dataset(url)
    info = ds.shard_list[0]
    rows = ds.shard_samples(0).to_pydict()
    fs = s3_env.filesystem()
    path = f"{url[5:]}/{info.path}"
    data = bytearray(fs.cat_file(path))
    victim = 1
    data[rows["fields"][victim][0]["offset"] + 5] ^= 0x01  # inside the body of sample 1
    fs.pipe_file(path, bytes(data))
    with pytest.raises(IntegrityError) as err:
        for x in StreamingDataset(url, cache_dir=None, rank=0, world_size=world):
            assert x["__key__"] != rows["key"][victim], "a corrupt sample was yielded"
    assert info.path in str(err.value) and rows["key"][victim] in str(err.value)
    with pytest.raises(IntegrityError):
        list(StreamingDataset(url, cache_dir=None, rank=0, world_size=world, batch_size=8))


def test_plain_dataloader_batching_and_decode(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, content = local_ds
    ds = StreamingDataset(url, cache_dir=tmp_path, decode=lambda s: (s["__key__"], len(s["bin"])))
    got = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert sorted(k for k, _ in got) == sorted(content)
    assert all(n == len(content[k]) for k, n in got)


def test_warm_epoch_reads_sample_manifests_from_the_node_cache(local_ds: tuple[str, dict[str, bytes]],
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from shardkit.datasets.streaming import cache_namespace
    from shardkit.read.manifest_copies import manifest_copies_dir
    from shardkit.storage.store import Store

    url, content = local_ds
    where = manifest_copies_dir(cache_namespace(shardkit.open_dataset(url)))
    assert where is not None and not where.startswith(str(tmp_path))  # outside the bounded cache
    shutil.rmtree(where, ignore_errors=True)  # other tests of this module made copies already
    read: list[str] = []
    real = Store.read_bytes
    monkeypatch.setattr(Store, "read_bytes", lambda self, rel: read.append(rel) or real(self, rel))
    shardkit.read.dataset._MEMOS.clear()  # rows parsed by the other tests of this module
    assert len(keys_of(StreamingDataset(url, cache_dir=tmp_path))) == N  # cold: manifests from storage
    fragments = {r for r in read if r.endswith(".parquet") and "shards" not in r}
    assert fragments
    copies = sorted(Path(where).glob("*.parquet"))
    assert len(copies) == len(fragments)
    read.clear()
    shardkit.read.dataset._MEMOS.clear()  # as in a fresh process: no parsed rows kept in memory
    got = list(StreamingDataset(url, cache_dir=tmp_path))
    assert not {r for r in read if r in fragments}, "a warm epoch fetched sample manifests again"
    assert {x["__key__"]: bytes(x["bin"]) for x in got} == content
    copies[0].write_bytes(b"not parquet")  # a damaged copy is replaced, never trusted
    shardkit.read.dataset._MEMOS.clear()
    got = list(StreamingDataset(url, cache_dir=tmp_path))
    assert {x["__key__"]: bytes(x["bin"]) for x in got} == content and copies[0].read_bytes()[:4] == b"PAR1"


def test_tight_cache_with_a_callable_decoder_and_workers(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    # A cache too small for every worker to keep a shard unpins at every batch end; samples
    # handed out there must stay valid whatever the decoder returns.
    url, content = local_ds
    biggest = max(shardkit.open_dataset(url).shards.column("bytes").to_pylist())
    ds = StreamingDataset(url, cache_dir=tmp_path, cache_limit=3 * biggest,
                          decode=lambda s: (s["__key__"], bytes(s["bin"])))
    loader = StreamingDataLoader(ds, batch_size=16, num_workers=2, collate_fn=list)
    got = dict(pair for batch in loader for pair in batch)
    assert got == content



def test_a_cache_of_one_shard_fetches_each_shard_once(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    # Read ahead into room the next shard needed: each shard was fetched ~twice (1.3-1.8x).
    url, content = local_ds
    sizes = shardkit.open_dataset(url).shards.column("bytes").to_pylist()
    ds = StreamingDataset(url, cache_dir=tmp_path, cache_limit=int(1.5 * max(sizes)))
    assert {x["__key__"]: bytes(x["bin"]) for x in ds} == content
    assert ds.stats()["bytes_fetched"] == sum(sizes)

def test_manifest_copies_only_in_a_private_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A copy decides where every sample starts: a directory others can write is never used.
    import os
    import tempfile

    from shardkit.read.manifest_copies import manifest_copies_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = tmp_path / f"shardkit-manifests-{os.getuid()}"
    assert manifest_copies_dir("ns1") == str(root / "ns1")
    assert root.stat().st_mode & 0o777 == 0o700
    root.chmod(0o777)
    assert manifest_copies_dir("ns1") is None
    root.rmdir()
    root.symlink_to(tmp_path)  # a planted symlink is not a private directory either
    assert manifest_copies_dir("ns1") is None


def test_manifest_copies_no_reader_opened_for_days_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every re-pack gets a new namespace: without a sweep, copies of old packs stayed forever.
    import tempfile

    from shardkit.read import manifest_copies as reader
    from shardkit.read.dataset import Dataset

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = tmp_path / f"shardkit-manifests-{os.getuid()}"
    for ns in ("old", "recent", "opened"):
        (root / ns).mkdir(parents=True)
        (root / ns / "manifest%2Fsamples-00000.parquet").write_bytes(b"x" * 100)
    long_ago = time.time() - reader.COPIES_KEPT_SECONDS - 60
    os.utime(root / "old", (long_ago, long_ago))
    os.utime(root / "opened", (long_ago, long_ago))
    assert reader.manifest_copies_dir("opened") == str(root / "opened")  # opening one keeps it
    assert sorted(p.name for p in root.iterdir()) == ["opened", "recent"]
    # A reader that made its dataset days ago and still reads copies keeps them too.
    url = str(tmp_path / "ds")
    shardkit.pack(({"__key__": f"k{i}", "bin": b"x"} for i in range(10)), url, progress=False)
    first = Dataset(url)
    first.manifest_cache = reader.manifest_copies_dir("long-run")
    first.shard_samples(0)  # keeps a copy
    os.utime(root / "long-run", (long_ago, long_ago))
    again = Dataset(url)
    again.manifest_cache = str(root / "long-run")
    assert again.shard_samples(0).num_rows == 10  # from the copy
    assert (root / "long-run").stat().st_mtime > time.time() - 60


def test_a_repack_at_the_same_url_and_size_gets_its_own_cache_namespace(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    # Same URL, same second, same byte count, other bytes: another dataset. Sharing a cache
    # namespace made every cached shard look "corrupt on disk" to the new one.
    import json

    from shardkit.datasets.streaming import cache_namespace

    url = str(tmp_path / "ds")
    first = shardkit.pack([{"__key__": f"k{i}", "bin": bytes([i]) * 500} for i in range(20)], url,
                          shard_bytes="4KB", progress=False)
    old = shardkit.open_dataset(url)
    assert len(keys_of(StreamingDataset(url, cache_dir=tmp_path / "cache"))) == 20
    shardkit.pack([{"__key__": f"k{i}", "bin": bytes([i + 1]) * 500} for i in range(20)], url,
                  shard_bytes="4KB", overwrite=True, progress=False)
    info_path = Path(url) / "dataset.json"
    info = json.loads(info_path.read_text())
    info["created"] = first["created"]  # as if packed within the same second
    info_path.write_text(json.dumps(info))
    new = shardkit.open_dataset(url)
    assert new.info["total_bytes"] == old.info["total_bytes"]
    assert cache_namespace(new) != cache_namespace(old)
    with caplog.at_level("WARNING", logger="shardkit"):
        got = {x["__key__"]: bytes(x["bin"]) for x in StreamingDataset(url, cache_dir=tmp_path / "cache")}
    assert got == {f"k{i}": bytes([i + 1]) * 500 for i in range(20)}
    assert "corrupt" not in caplog.text


def test_a_cache_too_small_for_what_a_reader_reads_at_once_is_warned_about_once(
        local_ds: tuple[str, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from shardkit.datasets import source_setup as dataset

    url, content = local_ds
    monkeypatch.setattr(dataset, "_warned_small_cache", False)
    biggest = max(shardkit.open_dataset(url).shards.column("bytes").to_pylist())
    with caplog.at_level("WARNING", logger="shardkit"):
        ok = StreamingDataset(url, cache_dir=tmp_path / "big", shuffle=True)
        assert len(keys_of(ok)) == N
        assert "cache_limit" not in caplog.text  # the default limit: room for everything
        small = StreamingDataset(url, cache_dir=tmp_path / "small", cache_limit=3 * biggest, shuffle=True)
        assert sorted(keys_of(small)) == sorted(content)  # still works, within the limit
        assert sorted(keys_of(small)) == sorted(content)
    assert caplog.text.count("fetched several times per epoch") == 1
    # Its figures say what it needs: a shuffle block of shards and a download.
    need = human_bytes((small.shuffle_block + 1) * biggest)
    assert f"cache_limit {human_bytes(3 * biggest)} is less than the {need} that 1 reading process(es)" in caplog.text
    assert f"raise cache_limit to {need} or more (or lower shuffle_block)" in caplog.text
    # In order, a lone reader needs room for its shard (and fetches each shard once); 2
    # workers taking turns in each shard about one each and one for the download.
    total = sum(shardkit.open_dataset(url).shards.column("bytes").to_pylist())
    # (Two readers on the node as two local ranks: a DataLoader worker's log is not caught here.)
    for readers, room, warned in ((1, 1, False), (2, 3, False), (2, 2, True)):
        monkeypatch.setattr(dataset, "_warned_small_cache", False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(readers))
        caplog.clear()
        with caplog.at_level("WARNING", logger="shardkit"):
            tight = StreamingDataset(url, cache_dir=tmp_path / f"tight{readers}{room}", cache_limit=room * biggest,
                                     batch_size=2)
            assert sorted(keys_of(StreamingDataLoader(tight, num_workers=0))) == sorted(content)
        assert ("cache_limit" in caplog.text) == warned
        if warned:
            assert f"less than the {human_bytes(3 * biggest)} that 2 reading process(es)" in caplog.text
        if readers == 1:
            assert tight.stats()["bytes_fetched"] == total
    # A dataset that fits the limit whole is fetched once, however little room each reader has.
    monkeypatch.setattr(dataset, "_warned_small_cache", False)
    caplog.clear()
    few = str(tmp_path / "few")
    shardkit.pack([{"__key__": f"k{i}", "bin": bytes(3000)} for i in range(9)], few, shard_bytes="10KB", progress=False)
    total = sum(shardkit.open_dataset(few).shards.column("bytes").to_pylist())
    with caplog.at_level("WARNING", logger="shardkit"):
        assert len(keys_of(StreamingDataset(few, cache_dir=tmp_path / "few-cache", cache_limit=total, shuffle=True))) == 9
    assert "cache_limit" not in caplog.text


def test_decoded_arrays_are_safe_to_write_and_in_native_byte_order(tmp_path: Path) -> None:
    # Single samples from the main process were tensors over the read-only map of the cached
    # file: an in-place op (x.mul_(2)) killed the process with SIGSEGV. Big-endian .npy arrays
    # (HDF5, FITS) failed in torch's conversion. Run in a child: a crash must fail the test,
    # not the suite.
    import subprocess
    import sys

    script = tmp_path / "inplace.py"
    script.write_text(f"""
import io, numpy as np, shardkit
arrs = [np.arange(1000, dtype=">f8") * i for i in range(3)] + [np.arange(1000, dtype="<f4") * i for i in range(3)]
def npy(a):
    b = io.BytesIO(); np.save(b, a); return b.getvalue()
url, cache = {str(tmp_path / "ds")!r}, {str(tmp_path / "cache")!r}
shardkit.pack([{{"__key__": f"k{{i}}", "npy": npy(a)}} for i, a in enumerate(arrs)], url, progress=False)
for workers in (0, 2):
    got = {{}}
    for s in shardkit.StreamingDataLoader(shardkit.StreamingDataset(url, cache_dir=cache, decode="numpy"),
                                          num_workers=workers):
        s["npy"].mul_(2)
        got[s["__key__"]] = s["npy"].numpy().copy()
    assert all(np.array_equal(got[f"k{{i}}"], 2 * a) for i, a in enumerate(arrs)), workers
    again = {{s["__key__"]: s["npy"] for s in shardkit.StreamingDataset(url, cache_dir=cache, decode="numpy")}}
    assert all(np.array_equal(again[f"k{{i}}"], a) for i, a in enumerate(arrs))  # the cache file is untouched
print("ok")
""")
    r = subprocess.run([sys.executable, "-W", "error::UserWarning", str(script)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_decoded_16_bit_images_keep_their_values(tmp_path: Path) -> None:
    """decode="numpy"/"pil" converted every mode but RGB and L to RGB: a 16-bit PNG (depth maps,
    scans) came back as uint8 with every value over 255 clipped to 255. Deep single-channel
    images keep their values now; RGBA and palette images are still RGB."""
    import io

    from PIL import Image

    rng = np.random.default_rng(0)
    depth = rng.integers(0, 65535, (5, 7), dtype=np.uint16)
    rgba = rng.integers(0, 255, (5, 7, 4), dtype=np.uint8)

    def png(img: Image.Image) -> bytes:
        buf = io.BytesIO()
        img.save(buf, "PNG")
        return buf.getvalue()

    url = str(tmp_path / "ds")
    shardkit.pack([{"__key__": "depth", "png": png(Image.fromarray(depth))},
                   {"__key__": "rgba", "png": png(Image.fromarray(rgba, "RGBA"))}], url, progress=False)
    got = {s["__key__"]: np.asarray(s["png"]) for s in StreamingDataset(url, decode="numpy")}
    assert got["depth"].dtype == np.uint16 and np.array_equal(got["depth"], depth)
    assert got["rgba"].dtype == np.uint8 and np.array_equal(got["rgba"], rgba[..., :3])
    loaded = {s["__key__"]: s["png"] for s in StreamingDataLoader(StreamingDataset(url, decode="numpy"))}
    assert loaded["depth"].dtype == torch.uint16 and np.array_equal(loaded["depth"].numpy(), depth)
    pil = {s["__key__"]: s["png"] for s in StreamingDataset(url, decode="pil")}
    assert np.array_equal(np.asarray(pil["depth"]), depth) and pil["rgba"].mode == "RGB"


def test_no_stale_length_warnings_after_a_resumed_epoch(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    # len(loader) after a resumed (shorter) epoch made torch warn on every batch of the next
    # epoch that "more samples have been fetched" than the stale length (examples/ddp_train.py
    # prints len(loader) after each epoch).
    import warnings

    url, _ = local_ds
    first = StreamingDataLoader(StreamingDataset(url, cache_dir=tmp_path, shuffle=True, batch_size=32), num_workers=2)
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    del it
    ds = StreamingDataset(url, cache_dir=tmp_path, shuffle=True, batch_size=32)
    loader = StreamingDataLoader(ds, num_workers=2)
    loader.load_state_dict(state)
    assert sum(1 for _ in loader) == len(loader) == -(-(N - 160) // 32)
    ds.set_epoch(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sum(1 for _ in loader) == len(loader) == -(-N // 32)
    assert not [w for w in caught if "Length of IterableDataset" in str(w.message)]


def sample_bytes(url: str, storage_options: dict[str, Any] | None = None) -> int:
    """Bytes of every sample's tar members (headers included): what a reader needs to fetch."""
    ds = shardkit.open_dataset(url, storage_options)
    return sum(int(np.sum(ds.shard_rows(i).size)) for i in range(ds.num_shards))


def fixed_samples(n: int, size: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    return [{"__key__": f"k{i:05d}", "bin": rng.bytes(size)} for i in range(n)]


def test_no_cache_workers_fetch_only_their_own_samples(s3_env: Any, s3_bucket: str) -> None:
    # DataLoader workers take turns in whole batches: each read every shard whole, so 2
    # workers fetched the dataset twice. Each now reads the segments of its own batches
    # (batches of 400 x 4 KB: the other worker's batch between two is a gap not worth reading).
    url = f"{s3_bucket}/nocache"
    shardkit.pack(iter(fixed_samples(1600, 4000)), url, shard_bytes="2MB", progress=False)
    ds = StreamingDataset(url, cache_dir=None, batch_size=400)
    keys = keys_of(StreamingDataLoader(ds, num_workers=2))
    assert sorted(keys) == [f"k{i:05d}" for i in range(1600)]
    fetched, needed = ds.stats()["bytes_fetched"], sample_bytes(url)
    assert 0 < fetched <= 1.01 * needed, (fetched, needed)
    # Shuffled, each worker needs a random half of every shard: the gaps between its 4 KB
    # samples are cheaper to read than a request per sample, so each fetches most of it, and
    # the user is told what a cache would save (tests/test_segments.py).
    shuffled = StreamingDataset(url, cache_dir=None, batch_size=400, shuffle=True, shuffle_block=1)
    assert sorted(keys_of(StreamingDataLoader(shuffled, num_workers=2))) == sorted(keys)
    assert shuffled.stats()["bytes_fetched"] <= 2.01 * needed


_WASTE_SCRIPT = """
import sys, shardkit
url = sys.argv[1]
ds = shardkit.StreamingDataset(url, cache_dir=None, shuffle=True, batch_size=64)
for epoch in range(2):  # workers are made again each epoch (not persistent)
    ds.set_epoch(epoch)
    assert sum(len(b["__key__"]) for b in shardkit.StreamingDataLoader(ds, num_workers=3)) == 6000
"""


def test_no_cache_waste_is_warned_once_per_rank_not_per_worker(tmp_path: Path) -> None:
    # Every worker of a shuffled rank without a cache fetches most of each shard of small
    # samples, and each printed the same warning with its own figure (4 workers: 4 lines per
    # rank, every epoch). The rank now says it once.
    import subprocess
    import sys

    url = str(tmp_path / "ds")
    shardkit.pack(iter(fixed_samples(6000, 300)), url, shard_bytes="400KB", progress=False)
    r = subprocess.run([sys.executable, "-c", _WASTE_SCRIPT, url], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "reading without a cache" in line]
    assert len(lines) == 1, r.stderr
    assert "x the bytes of its samples" in lines[0]


@pytest.mark.parametrize("shuffle", [False, True])
def test_no_cache_holds_segments_not_whole_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  shuffle: bool) -> None:
    # Without a cache a reader held (prefetch + 1) whole shards: ~1.5 GB per process with the
    # default 512 MB shards. It now reads and holds segments of about SEGMENT_BYTES.
    from shardkit.storage import ranged
    from shardkit.read import segments
    from shardkit.read.shard_source import ShardSource

    url = str(tmp_path / "ds")
    data = fixed_samples(1200, 3000)
    shardkit.pack(iter(data), url, shard_bytes="1MB", progress=False)
    seg = 64 << 10
    monkeypatch.setattr(segments, "SEGMENT_BYTES", seg)
    reads: list[int] = []
    peak = [0]
    real_read, real_get = ranged.read_range, ShardSource.get

    def read_range(store: Any, path: str, start: int, end: int, *args: Any) -> Any:
        reads.append(end - start)
        return real_read(store, path, start, end, *args)

    def get(self: ShardSource, *args: Any) -> Any:
        held = real_get(self, *args)
        ahead = sum(hi - lo for lo, hi in map(self._bounds, self._ahead))
        peak[0] = max(peak[0], ahead + sum(h.end - h.base for h in self._held.values()))
        return held

    monkeypatch.setattr(ranged, "read_range", read_range)
    monkeypatch.setattr(ShardSource, "get", get)
    ds = StreamingDataset(url, cache_dir=None, shuffle=shuffle, shuffle_block=1, prefetch=2)
    got = {x["__key__"]: bytes(x["bin"]) for x in ds}
    assert got == {d["__key__"]: d["bin"] for d in data}
    one = 3000 + 512
    assert max(reads) <= seg + one and len(reads) >= 1200 * one // (seg + one)
    assert sum(reads) == ds.stats()["bytes_fetched"] == sample_bytes(url)  # nothing read twice
    if not shuffle:  # the one in use, two ahead, and one more
        assert peak[0] <= 4 * (seg + one) < 1_000_000, peak[0]
    else:  # a shuffle block's shards (the shuffle buffer, here one shard), and segments ahead
        # for the block and the prefetch (shuffle_block + prefetch = 3)
        biggest = max(shardkit.open_dataset(url).shards.column("bytes").to_pylist())
        assert peak[0] <= biggest + 3 * (seg + one), peak[0]


def test_no_cache_truncated_shard_is_named_at_once(s3_env: Any, s3_bucket: str) -> None:
    # A segment read of a shard cut short in storage is an integrity fault naming the object,
    # not a dropped connection retried for seconds and reported as unreachable storage.
    url = f"{s3_bucket}/cut"
    shardkit.pack(iter(fixed_samples(300, 4000)), url, shard_bytes="400KB", progress=False)
    info = shardkit.open_dataset(url).shard_list[1]
    fs = s3_env.filesystem()
    path = f"{url[5:]}/{info.path}"
    fs.pipe_file(path, fs.cat_file(path)[: info.bytes // 2])
    for kw in ({}, {"batch_size": 16}):
        with pytest.raises(IntegrityError, match=f"{info.path}.*fewer than the manifest says"):
            keys_of(StreamingDataset(url, cache_dir=None, **kw))


@pytest.mark.parametrize("workers,shuffle", [(0, False), (0, True), (2, True)])
def test_no_cache_batches_spanning_segments_hold_the_right_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   workers: int, shuffle: bool) -> None:
    # A batch takes one shard's samples from several segments (small segments, or a shuffled
    # order): each group is copied from its own segment. Copied from one, the offsets of the
    # others fell outside it (a crash) or, worse, inside it (wrong bytes).
    from shardkit.read import segments

    url = str(tmp_path / "ds")
    data = fixed_samples(1000, 3000)
    shardkit.pack(iter(data), url, shard_bytes="1MB", progress=False)
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 40_000)  # ~11 samples per segment
    monkeypatch.setattr(segments, "GAP_BYTES", 0)
    want = {d["__key__"]: d["bin"] for d in data}
    ds = StreamingDataset(url, cache_dir=None, batch_size=64, shuffle=shuffle)
    got = {}
    for batch in StreamingDataLoader(ds, num_workers=workers):
        for key, body in zip(batch["__key__"], unpack(batch, "bin")):
            got[key] = bytes(body)
    assert got == want


@pytest.mark.parametrize("cached", [True, False])
def test_a_frozen_store_is_reported_and_fails_instead_of_hanging(s3_server: Any, s3_bucket: str, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture,
                                                                 cached: bool) -> None:
    # A SIGSTOPped server accepts requests and never answers: each read timed out after 60 s,
    # retried by botocore and then six times by shardkit, ~12 minutes without a word. Now each
    # retry of a stall says so, and three stalls in a row end in one error naming the object.
    # (A 1 s read timeout here stands for the default 20 s.)
    import time

    from stallproxy import StallProxy

    from shardkit.errors import StorageError

    url = f"{s3_bucket}/frozen"
    shardkit.pack(iter(fixed_samples(200, 4000)), url, shard_bytes="200KB", progress=False,
                  storage_options=s3_server.storage_options())
    proxy = StallProxy(s3_server.endpoint)
    try:
        ds = StreamingDataset(url, cache_dir=tmp_path if cached else None, batch_size=16,
                              storage_options=proxy.storage_options(s3_server, read_timeout=1))
        proxy.frozen.set()
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="shardkit"), pytest.raises(StorageError) as err:
            keys_of(ds)
        took = time.monotonic() - t0
    finally:
        proxy.close()
    assert "did not answer" in str(err.value) and url.removeprefix("s3://") in str(err.value), str(err.value)
    assert took < 30, took
    assert caplog.text.count("storage: no answer for") >= 2, caplog.text
    assert s3_server.secret not in caplog.text + str(err.value)


def test_a_cache_limit_below_one_shard_is_refused_when_the_dataset_is_made(
        local_ds: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, _ = local_ds
    biggest = max(shardkit.open_dataset(url).shards.column("bytes").to_pylist())
    with pytest.raises(ConfigError, match=r"cache_limit .* is smaller than shard shards/.*raise cache_limit"):
        StreamingDataset(url, cache_dir=tmp_path, cache_limit=biggest - 1)
    assert len(list(StreamingDataset(url, cache_dir=None, cache_limit=biggest - 1))) > 0  # no cache: no limit to meet


def test_resume_refuses_a_state_from_another_pack_and_accepts_a_copy(tmp_path: Path) -> None:
    # Same samples, another shard size, same URL: the sample counts agree, the layout does
    # not, and resuming would repeat some samples and skip others.
    url = str(tmp_path / "ds")
    data = samples(120)
    shardkit.pack(iter(data), url, shard_bytes="60KB", progress=False)
    loader = StreamingDataLoader(StreamingDataset(url, shuffle=True, batch_size=10))
    for _, _ in zip(range(3), loader):
        pass
    state = loader.state_dict()
    shutil.copytree(url, tmp_path / "copy")  # the same data elsewhere: resumes
    StreamingDataset(str(tmp_path / "copy"), shuffle=True, batch_size=10).load_state_dict(state)
    shardkit.pack(iter(data), url, shard_bytes="30KB", overwrite=True, progress=False)
    with pytest.raises(ConfigError, match=r"another pack of .*ds: its shards differ"):
        StreamingDataset(url, shuffle=True, batch_size=10).load_state_dict(state)
    other = str(tmp_path / "other")
    shardkit.pack(iter(samples(120, seed=1)), other, shard_bytes="60KB", progress=False)
    with pytest.raises(ConfigError, match=r"saved on .*ds, another dataset than .*other"):
        StreamingDataset(other, shuffle=True, batch_size=10).load_state_dict(state)
    # A state saved before states carried a fingerprint: its dataset's 'created' decides
    # (to the second: both packs here may share one).
    old = {k: v for k, v in state.items() if k != "fingerprint"}
    StreamingDataset(str(tmp_path / "copy"), shuffle=True, batch_size=10).load_state_dict(old)
    old["created"] = "2001-01-01T00:00:00Z"
    with pytest.raises(ConfigError, match="another pack"):
        StreamingDataset(url, shuffle=True, batch_size=10).load_state_dict(old)


@pytest.mark.parametrize("option, value, said", [
    ("batch_size", "32", "batch_size must be an integer, got '32'"),
    ("batch_size", 2.5, "batch_size must be an integer, got 2.5"),
    ("batch_size", True, "batch_size must be an integer, got True"),
    ("batch_size", 0, "batch_size must be >= 1, got 0"),
    ("loader_batch_size", "8", "loader_batch_size must be an integer, got '8'"),
    ("prefetch", -1, "prefetch must be >= 0, got -1"),
    ("prefetch", 1.5, "prefetch must be an integer, got 1.5"),
    ("read_threads", "2", "read_threads must be an integer, got '2'"),
    ("seed", "0", "seed must be an integer, got '0'"),
    ("seed", -1, "seed must be >= 0, got -1"),
    ("shuffle_block", 0, "shuffle_block must be >= 1, got 0"),
    ("world_size", "2", "world_size must be an integer, got '2'"),
    ("rank", -1, "rank must be >= 0, got -1"),
])
def test_numeric_options_are_checked_up_front(local_ds: tuple[str, dict[str, bytes]], option: str, value: Any,
                                              said: str) -> None:
    with pytest.raises(ConfigError) as err:
        StreamingDataset(local_ds[0], **{option: value})
    assert str(err.value) == said


def test_a_rank_outside_the_given_world_size_is_refused_up_front(local_ds: tuple[str, dict[str, bytes]]) -> None:
    with pytest.raises(ConfigError) as err:
        StreamingDataset(local_ds[0], rank=3, world_size=2)
    assert str(err.value) == "rank 3 is outside world_size 2: ranks are 0 to 1"
    assert StreamingDataset(local_ds[0], rank=1, world_size=2).rank == 1


def test_option_checks_take_numpy_integers(local_ds: tuple[str, dict[str, bytes]]) -> None:
    ds = StreamingDataset(local_ds[0], batch_size=np.int64(8), prefetch=np.int32(0), seed=np.uint64(3))
    assert (ds.batch_size, ds.prefetch, ds.seed) == (8, 0, 3) and type(ds.batch_size) is int
    with pytest.raises(ConfigError, match="batch_size must be an integer, got 2.5"):
        StreamingDataLoader(StreamingDataset(local_ds[0]), batch_size=2.5)  # type: ignore[arg-type]


def test_truncated_state_names_what_is_missing(local_ds: tuple[str, dict[str, bytes]]) -> None:
    ds = StreamingDataset(local_ds[0])
    with pytest.raises(ConfigError, match=r"^state_dict: missing 'num_samples', 'epoch', .*'consumed_per_rank' "
                                          r"\(a truncated checkpoint"):
        ds.load_state_dict({"version": 1})
    state = ds.state_dict()
    del state["remaining"]
    with pytest.raises(ConfigError, match=r"^state_dict: missing 'remaining' \("):
        ds.load_state_dict(state)
    with pytest.raises(ConfigError, match="state_dict: expected a dict, got list"):
        ds.load_state_dict([])  # type: ignore[arg-type]


def test_no_cache_waste_without_workers_names_its_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    # One reader (num_workers=0) whose share of a shuffled epoch starts inside a shuffle block
    # (rank 1 of 2, here, or a resumed epoch) needs a scattered part of its shards: the warning
    # blamed DataLoader workers, which there are none of.
    from shardkit.read import segments

    url = str(tmp_path / "ds")
    shardkit.pack(iter(fixed_samples(1200, 300)), url, shard_bytes="100KB", progress=False)
    monkeypatch.setattr(segments, "_warned", False)
    ds = StreamingDataset(url, cache_dir=None, shuffle=True, batch_size=50, rank=1, world_size=2, shuffle_block=8)
    with caplog.at_level("WARNING", logger="shardkit"):
        assert len(keys_of(StreamingDataLoader(ds))) == 600
    assert caplog.text.count("reading without a cache") == 1
    assert "DataLoader workers" not in caplog.text and "starts or ends inside a shuffle block" in caplog.text


def pinned(cache: Path) -> list[str]:
    """Shards some reader holds pinned in ``cache`` now (a flock SH on their .pin files)."""
    out = []
    for lock in cache.glob("*/.locks/*.pin"):
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            out.append(lock.name)
        finally:
            os.close(fd)
    return out


def _cls_as_int(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "cls": int(sample["cls"])}


@pytest.mark.parametrize("kw", [
    {}, {"batch_size": 64}, {"batch_size": 64, "read_threads": 0}, {"batch_size": 64, "zero_copy": True},
    {"batch_size": 64, "decode": _cls_as_int}, {"batch_size": 64, "drop_last": True},
], ids=["samples", "threaded", "raw", "views", "decoded", "drop_last"])
def test_the_last_item_leaves_no_shard_pinned(local_ds: tuple[str, dict[str, bytes]], tmp_path: Path,
                                              kw: dict[str, Any]) -> None:
    # The training loop may hold the last batch as long as it likes (DDP: in a collective,
    # waiting for a rank whose reader needs that cache room), and asks for no more before it
    # is done with it: nothing may stay pinned meanwhile. 300 samples: a partial last batch.
    s = StreamingDataset(local_ds[0], cache_dir=tmp_path / "c", rank=0, world_size=2, **kw)
    it = iter(s)
    items = [next(it) for _ in range(len(s))]
    deadline = time.monotonic() + 5  # a prefetch thread pins a shard only while it checks or fetches it
    while pinned(tmp_path / "c") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pinned(tmp_path / "c") == []
    assert len(keys_of(items)) == (256 if kw.get("drop_last") else 300)
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("kw", [{}, {"batch_size": 64}, {"batch_size": 64, "zero_copy": True}],
                         ids=["samples", "raw", "views"])
def test_a_reader_reads_around_a_cache_whose_room_other_readers_hold(
        local_ds: tuple[str, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, kw: dict[str, Any]) -> None:
    # Another reader on the node sits on the only room (a stopped process, or a DDP rank in a
    # collective waiting for this one): after SHARDKIT_ROOM_WAIT seconds the reader reads each
    # shard it cannot cache from storage, checked as a download is, instead of waiting for good.
    url, content = local_ds
    ds = shardkit.open_dataset(url)
    biggest = max(ds.shards.column("bytes").to_pylist())
    limit = biggest + biggest // 2
    other = ShardCache(tmp_path / "c", limit, namespace=cache_namespace(ds))
    big = max(ds.shard_list, key=lambda i: i.bytes)
    held = other.open(shard_ref(big), ShardSource(ds, None).fetch)
    monkeypatch.setenv("SHARDKIT_ROOM_WAIT", "0.05")
    monkeypatch.setattr(shardio, "_warned_no_room", False)
    try:
        s = StreamingDataset(url, cache_dir=tmp_path / "c", cache_limit=limit, **kw)
        with caplog.at_level("WARNING", logger="shardkit"):
            items = list(s)
        assert other.usage() <= limit
    finally:
        held.close()
        other.close()
    got = {}
    for item in items:
        if "bin.offsets" in item:
            item = {"__key__": item["__key__"], "bin": unpack(item, "bin")}
        for key, body in zip(*((item["__key__"], item["bin"]) if kw else ([item["__key__"]], [item["bin"]]))):
            got[key] = bytes(body)
    assert got == content and len(keys_of(items)) == N
    assert s.stats()["uncached_reads"] > 0
    assert caplog.text.count("too small for the readers on this node") == 1


def test_a_cache_dir_removed_mid_epoch_stops_with_one_clear_error(local_ds: tuple[str, dict[str, bytes]],
                                                                  tmp_path: Path) -> None:
    from shardkit.errors import CacheGoneError

    url, content = local_ds
    cache = tmp_path / "cache"
    biggest = max(shardkit.open_dataset(url).shards.column("bytes").to_pylist())
    ds = StreamingDataset(url, cache_dir=cache, cache_limit=3 * biggest, prefetch=0)
    n = 0
    with pytest.raises(CacheGoneError) as err:
        for s in ds:
            assert bytes(s["bin"]) == content[s["__key__"]]  # nothing wrong before it stops
            n += 1
            if n == 5:
                shutil.rmtree(cache)
    msg = str(err.value)
    assert msg.startswith(f"cache_dir {cache} was removed while readers used it") and "\n" not in msg
    assert isinstance(err.value, shardkit.errors.ShardkitError) and n < N


@pytest.mark.parametrize("cache", [False, True])
def test_a_reader_opened_before_a_repack_refuses_the_new_pack(tmp_path: Path, cache: bool) -> None:
    # Same URL, same layout, other bytes: the new rows would verify the new shards sample by
    # sample, so without the fragment's shard checksums a reader streamed the new pack while
    # it (and its saved state) stood for the old one.
    url = str(tmp_path / "ds")

    def pack(tag: bytes) -> None:
        shardkit.pack(({"__key__": f"k{i:04d}", "bin": tag * 250} for i in range(400)), url, shard_bytes="64KB",
                      progress=False, overwrite=True)

    pack(b"v1")
    ds = StreamingDataset(url, cache_dir=tmp_path / "cache" if cache else None)
    pack(b"v2")
    got: list[bytes] = []
    with pytest.raises(shardkit.errors.ShardkitError) as err:
        got.extend(bytes(s["bin"]) for s in ds)
    assert not any(b.startswith(b"v2") for b in got)  # never a sample of the new pack
    if not cache:  # (with a cache the shard's own xxh3-128 refuses the new bytes first)
        assert "re-packed since" in str(err.value) and "\n" not in str(err.value)
    fresh = StreamingDataset(url, cache_dir=tmp_path / "cache2")  # opened again: the new pack, whole
    assert sorted(bytes(s["bin"])[:2] for s in fresh) == [b"v2"] * 400
