"""Real multi-process DDP (gloo) reading from SeaweedFS through node caches."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import shardkit
from cachewalk import cache_files, limited
from rank_procs import free_port
from rank_procs import run_ranks as launch

WORKER = Path(__file__).resolve().parents[1] / "ddp_worker.py"
REPO = Path(__file__).resolve().parents[2]
N = 480


@pytest.fixture
def s3_dataset(s3_env: Any, s3_bucket: str) -> tuple[str, set[str], Any]:
    rng = np.random.default_rng(1)
    data = [{"__key__": f"d{i:05d}", "bin": rng.bytes(int(rng.integers(200, 3000)))} for i in range(N)]
    url = f"{s3_bucket}/ds"
    shardkit.pack(iter(data), url, shard_bytes="50KB", progress=False)
    return url, {d["__key__"] for d in data}, shardkit.open_dataset(url)


def run_ranks(tmp: Path, world: int, caches: list[str], timeout: float = 180, **cfg: Any) -> list[dict[str, Any]]:
    tag = uuid.uuid4().hex[:8]
    confs = [{"cache_dir": caches[rank], "out": str(tmp / f"out-{world}-{rank}-{tag}.json"), "batch_size": 16,
              "num_workers": 2, "epochs": 1, **cfg} for rank in range(world)]
    return launch(WORKER, confs, [caches.count(c) for c in caches], timeout)


def test_two_ranks_one_cache_two_epochs(s3_dataset: tuple[str, set[str], Any], tmp_path: Path) -> None:
    url, keys, ds = s3_dataset
    cache = str(tmp_path / "cache")
    res = run_ranks(tmp_path, 2, [cache, cache], url=url, epochs=2)
    orders = []
    for e in range(2):
        seen = [k for r in res for k in r["epochs"][e]["keys"]]
        assert Counter(seen) == Counter(keys)  # every key exactly once across ranks (480 % 32 == 0)
        assert res[0]["epochs"][e]["steps"] == res[1]["epochs"][e]["steps"] == res[0]["len"]
        orders.append([r["epochs"][e]["keys"] for r in res])
    assert orders[0] != orders[1]
    downloads = sum(r["stats"]["misses"] + r["stats"]["prefetched"] for r in res)
    assert downloads == ds.num_shards  # one shared cache: each shard fetched once by the node
    assert sum(r["stats"]["bytes_fetched"] for r in res) == sum(ds.shards.column("bytes").to_pylist())


def test_two_ranks_reading_in_their_main_processes_share_one_cache(s3_dataset: tuple[str, set[str], Any],
                                                                   tmp_path: Path) -> None:
    # num_workers=0: each rank fills packed batches itself, downloads 4 shards at once, and lands
    # them in memory (O_DIRECT to the shared cache); a shard both ranks need is fetched by one,
    # and the other reads the file.
    url, keys, ds = s3_dataset
    cache = str(tmp_path / "cache")
    res = run_ranks(tmp_path, 2, [cache, cache], url=url, epochs=2, num_workers=0)
    orders = []
    for e in range(2):
        seen = [k for r in res for k in r["epochs"][e]["keys"]]
        assert Counter(seen) == Counter(keys)
        assert res[0]["epochs"][e]["steps"] == res[1]["epochs"][e]["steps"] == res[0]["len"]
        orders.append([r["epochs"][e]["keys"] for r in res])
    assert orders[0] != orders[1]
    downloads = sum(r["stats"]["misses"] + r["stats"]["prefetched"] for r in res)
    assert downloads == ds.num_shards == sum(r["stats"]["landed"] for r in res)


def test_two_nodes_each_cache_downloads_once(s3_dataset: tuple[str, set[str], Any], tmp_path: Path) -> None:
    url, keys, ds = s3_dataset
    a, b = str(tmp_path / "nodeA"), str(tmp_path / "nodeB")
    res = run_ranks(tmp_path, 4, [a, a, b, b], url=url, shuffle=True)
    seen = [k for r in res for k in r["epochs"][0]["keys"]]
    assert Counter(seen) == Counter(keys)
    for node, ranks in (("A", res[:2]), ("B", res[2:])):
        # shards this node's ranks needed (from their keys) vs downloads into its cache
        by_key = {}
        for shard in range(ds.num_shards):
            for k in ds.shard_samples(shard).column("key").to_pylist():
                by_key[k] = shard
        needed = {by_key[k] for r in ranks for k in r["epochs"][0]["keys"]}
        downloads = sum(r["stats"]["misses"] + r["stats"]["prefetched"] for r in ranks)
        assert downloads == len(needed), node


@pytest.mark.parametrize("new_world", [3, 1])
def test_resume_with_another_world_size(s3_dataset: tuple[str, set[str], Any], tmp_path: Path, new_world: int) -> None:
    url, keys, _ = s3_dataset
    cache = str(tmp_path / "c")
    first = run_ranks(tmp_path, 2, [cache] * 2, url=url, stop_after=5, first_epoch=2)
    state = first[0]["state"]
    assert state["consumed_per_rank"] == 5 * 16 and first[1]["state"] == state
    (tmp_path / "state.json").write_text(json.dumps(state))
    # 480 - 2*80 = 320 remain; world 3 pads by 1 (320 % 3 == 2), so count exact coverage.
    rest = run_ranks(tmp_path, new_world, [cache] * new_world, url=url, state_in=str(tmp_path / "state.json"),
                     first_epoch=2)
    consumed = [k for r in first for k in r["epochs"][0]["keys"]]
    tail = [k for r in rest for k in r["epochs"][0]["keys"]]
    per_rank = -(-(N - 160) // new_world)
    assert all(len(r["epochs"][0]["keys"]) == per_rank for r in rest)
    assert set(consumed + tail) == keys and len(consumed) == 160
    assert len(consumed + tail) - N == per_rank * new_world - (N - 160)  # only padding repeats
    assert not set(consumed) & set(tail[: N - 160]) if new_world == 1 else True


@contextlib.contextmanager
def peak_size(cache: Path) -> Iterator[list[int]]:
    """Sample the bytes under ``cache`` (all of which ``cache_limit`` bounds) every few ms while the block runs: [peak]."""
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            # By inode: one file under two names (a landing attempt and its published name) counts
            # once. Progress files of downloads in flight (.landed) count too, lock files not.
            sizes = {st.st_ino: st.st_size for _, st in limited(cache_files(cache))}
            peak[0] = max(peak[0], sum(sizes.values()))
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield peak
    finally:
        stop.set()
        t.join()


def test_cache_limit_held_under_several_processes(s3_dataset: tuple[str, set[str], Any], tmp_path: Path) -> None:
    url, keys, ds = s3_dataset
    biggest = max(ds.shards.column("bytes").to_pylist())
    limit = 2 * biggest + biggest // 2
    cache = tmp_path / "small"
    cache.mkdir()
    with peak_size(cache) as peak:
        res = run_ranks(tmp_path, 2, [str(cache)] * 2, url=url, cache_limit=limit, shuffle=False)
    seen = [k for r in res for k in r["epochs"][0]["keys"]]
    assert Counter(seen) == Counter(keys)
    assert 0 < peak[0] <= limit
    # A shard is downloaded once while it stays cached: every download beyond the first of
    # each shard follows an eviction (the limit forces them with 4 readers sharing 2.5 shards).
    downloads = sum(r["stats"]["misses"] + r["stats"]["prefetched"] for r in res)
    evictions = sum(r["stats"]["evictions"] for r in res)
    assert evictions > 0 and ds.num_shards <= downloads <= ds.num_shards + evictions


def test_spawned_ranks_with_spawned_workers_read_disjoint_shares(tmp_path: Path) -> None:
    # mp.spawn ranks with init_process_group(rank=, world_size=) and no RANK/WORLD_SIZE env:
    # their spawn/forkserver DataLoader workers have no process group, and read the whole
    # dataset each unless they learn the rank from the main process.
    rng = np.random.default_rng(2)
    data = [{"__key__": f"s{i:04d}", "bin": rng.bytes(int(rng.integers(100, 400)))} for i in range(96)]
    url = str(tmp_path / "ds")
    shardkit.pack(iter(data), url, shard_bytes="4KB", progress=False)
    out = tmp_path / "out"
    out.mkdir()
    conf = {"url": url, "cache_dir": str(tmp_path / "cache"), "out": str(out), "port": free_port()}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO)
    subprocess.run([sys.executable, str(WORKER.with_name("ddp_spawn.py")), json.dumps(conf)], env=env,
                   timeout=240, check=True)
    res = [json.loads((out / f"r{r}.json").read_text()) for r in range(2)]
    keys = {d["__key__"] for d in data}
    for reader in ("loader", "plain"):
        got = [r[reader]["keys"] for r in res]
        assert not set(got[0]) & set(got[1]), reader
        assert Counter(got[0] + got[1]) == Counter(keys), reader  # 96 = 2 x 48: no padding
        assert all(len(g) == 48 for g in got), reader
    assert [len(r["loader"]["keys"]) // 8 for r in res] == [r["loader"]["len"] for r in res]
    wds_keys = [r["wds"]["keys"] for r in res]
    assert not set(wds_keys[0]) & set(wds_keys[1])
    assert Counter(wds_keys[0] + wds_keys[1]) == Counter(keys)


@pytest.fixture
def s3_jpegs(s3_env: Any, s3_bucket: str) -> tuple[str, set[str], Any]:
    """600 small JPEGs in 10 shards: decoded batches, as in the trial that found the hang."""
    from PIL import Image

    rng = np.random.default_rng(2)
    data = []
    for i in range(600):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        data.append({"__key__": f"j{i:05d}", "jpg": buf.getvalue()})
    url = f"{s3_bucket}/jpegs"
    shardkit.pack(iter(data), url, shard_bytes=f"{sum(len(d['jpg']) + 1024 for d in data) // 10}B", progress=False)
    return url, {d["__key__"] for d in data}, shardkit.open_dataset(url)


@pytest.mark.parametrize("world,workers,shuffle,room,batch,epochs", [
    (2, 0, False, 1, 64, 1),  # in the ranks' main processes; 300 per rank: a partial last batch
    (3, 1, True, 2, 60, 2),  # one persistent worker per rank, which runs up to 2 batches ahead
])
def test_small_shared_cache_with_a_collective_per_step_reaches_the_end(
        s3_jpegs: tuple[str, set[str], Any], tmp_path: Path, world: int, workers: int, shuffle: bool, room: int,
        batch: int, epochs: int) -> None:
    # A rank whose reader kept its last shard pinned after handing out its last (partial)
    # batch sat in the all_reduce, while another rank's reader waited for that cache room
    # for good: both stopped one batch before the end.
    url, keys, ds = s3_jpegs
    assert ds.num_shards >= 2 * world
    biggest = max(ds.shards.column("bytes").to_pylist())
    limit = room * biggest + biggest // 10
    cache = tmp_path / "cache"
    with peak_size(cache) as peak:
        res = run_ranks(tmp_path, world, [str(cache)] * world, timeout=60, url=url, cache_limit=limit,
                        shuffle=shuffle, batch_size=batch, num_workers=workers, decode="crop", all_reduce=True,
                        epochs=epochs)
    for e in range(epochs):
        seen = [k for r in res for k in r["epochs"][e]["keys"]]
        assert Counter(seen) == Counter(keys)  # 600 divides by the world size: no padding
        assert all(r["epochs"][e]["steps"] == r["len"] for r in res)
    assert 0 < peak[0] <= limit
    # Shards were unpinned in time: no reader had to give up on the cache and read around it.
    assert sum(r["stats"]["uncached_reads"] for r in res) == 0


HOLDER = """
import sys, time, shardkit
from shardkit.cache.shard_cache import ShardCache
from shardkit.read.cache_refs import cache_namespace, shard_ref
from shardkit.read.shard_source import ShardSource
ds = shardkit.open_dataset(sys.argv[1])
cache = ShardCache(sys.argv[2], int(sys.argv[3]), namespace=cache_namespace(ds))
held = cache.open(shard_ref(ds.shard_list[int(sys.argv[4])]), ShardSource(ds, None).fetch)
print("pinned", flush=True)
time.sleep(600)
"""


def test_ranks_read_around_room_that_a_stopped_reader_holds(s3_jpegs: tuple[str, set[str], Any], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # A process on the node keeps the cache's only room pinned for good (stopped, or a rank of
    # another job in a collective): the ranks read the shards they cannot cache from storage
    # after SHARDKIT_ROOM_WAIT seconds each, and finish the epoch instead of waiting for room.
    url, keys, ds = s3_jpegs
    sizes = ds.shards.column("bytes").to_pylist()
    limit = max(sizes) + max(sizes) // 2
    cache = tmp_path / "cache"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, url, str(cache), str(limit), str(sizes.index(max(sizes)))],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "pinned"
        monkeypatch.setenv("SHARDKIT_ROOM_WAIT", "0.5")
        with peak_size(cache) as peak:
            res = run_ranks(tmp_path, 2, [str(cache)] * 2, timeout=60, url=url, cache_limit=limit, shuffle=False,
                            batch_size=64, num_workers=0, decode="crop", all_reduce=True)
    finally:
        holder.kill()
        holder.wait()
    seen = [k for r in res for k in r["epochs"][0]["keys"]]
    assert Counter(seen) == Counter(keys)
    assert all(r["epochs"][0]["steps"] == r["len"] for r in res)
    assert 0 < peak[0] <= limit
    assert sum(r["stats"]["uncached_reads"] for r in res) > 0
