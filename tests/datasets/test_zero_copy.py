"""StreamingDataset(zero_copy=True): raw batches of read-only views into the mapped cache files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from procmaps import mapped_file
from randomds import pack_random
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.batch.collate import unpack
from shardkit.errors import ConfigError

N = 400


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    return pack_random(tmp_path_factory.mktemp("zc"), n=N, max_body=6000, classes=5, shard_bytes="64KB",
                       seed=9, prefix="z")


@pytest.mark.parametrize("shuffle,world", [(False, 1), (True, 3)])
def test_views_equal_copied_batches_and_point_into_the_cache(ds_url: tuple[str, dict[str, bytes]], tmp_path: Path,
                                                             shuffle: bool, world: int) -> None:
    url, content = ds_url
    cache = tmp_path / "cache"
    for rank in range(world):
        def stream(zero_copy: bool) -> list[dict[str, Any]]:
            return list(StreamingDataset(url, cache_dir=cache, batch_size=24, shuffle=shuffle, seed=2, rank=rank,
                                         world_size=world, zero_copy=zero_copy))
        copied, views = stream(False), stream(True)
        assert [b["__key__"] for b in views] == [b["__key__"] for b in copied]
        for v, c in zip(views, copied):
            assert [bytes(x) for x in v["bin"]] == [bytes(x) for x in unpack(c, "bin")]
            assert [bytes(x) for x in unpack(v, "cls")] == [bytes(x) for x in unpack(c, "cls")]
            # 1-byte labels come packed (one gathered array + offsets), not as a view per sample
            assert not isinstance(v["cls"], list) and len(v["cls.offsets"]) == len(v["__key__"]) + 1
            assert np.array_equal(np.asarray(v["__index__"]), np.asarray(c["__index__"]))
            for arr in v["bin"]:
                assert isinstance(arr, np.ndarray) and arr.dtype == np.uint8 and not arr.flags.writeable
                if arr.size:  # no copy: the bytes sit in the map of the cached shard file
                    where = mapped_file(arr.ctypes.data)
                    assert where.startswith(str(cache)) and where.endswith(".tar"), where
    # every sample, once, with its own bytes
    got = {k: bytes(x) for rank in range(world)
           for b in StreamingDataset(url, cache_dir=cache, batch_size=24, shuffle=shuffle, seed=2, rank=rank,
                                     world_size=world, zero_copy=True, drop_last=False)
           for k, x in zip(b["__key__"], b["bin"])}
    assert got == content


def test_kept_views_survive_unpin_and_eviction(ds_url: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    # A cache with room for ~4 shards: by the end, the shards of the first batches are evicted
    # (their files unlinked); the views kept since must still hold the right bytes.
    url, content = ds_url
    biggest = max(shardkit.open_dataset(url).shards.column("bytes").to_pylist())
    sd = StreamingDataset(url, cache_dir=tmp_path, cache_limit=4 * biggest, batch_size=16, zero_copy=True)
    kept = list(sd)
    assert sd.stats()["evictions"] > 0
    assert {k: bytes(x) for b in kept for k, x in zip(b["__key__"], b["bin"])} == content
    assert sum(1 for p in tmp_path.rglob("*.tar")) <= 4  # the cache itself stayed within its limit


def test_zero_copy_through_the_loader_and_its_limits(ds_url: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, content = ds_url
    sd = StreamingDataset(url, cache_dir=tmp_path, batch_size=32, zero_copy=True, shuffle=True)
    loader = StreamingDataLoader(sd, num_workers=0)
    assert {k: bytes(x) for b in loader for k, x in zip(b["__key__"], b["bin"])} == content
    with pytest.raises(ConfigError, match="num_workers=0"):
        StreamingDataLoader(sd, num_workers=2)
    for kwargs in ({"batch_size": None}, {"cache_dir": None}, {"decode": "pil"}):
        args = {"cache_dir": tmp_path, "batch_size": 8, "zero_copy": True, **kwargs}
        with pytest.raises(ConfigError, match="zero_copy"):
            StreamingDataset(url, **args)


def test_ragged_fields_give_none_where_a_sample_lacks_one(tmp_path: Path) -> None:
    data = [{"__key__": f"r{i:03d}", "bin": bytes([i % 251]) * (i + 1), **({"txt": b"t%d" % i} if i % 3 == 0 else {})}
            for i in range(60)]
    url = str(tmp_path / "ragged")
    shardkit.pack(iter(data), url, shard_bytes="2KB", progress=False)
    got: dict[str, tuple[bytes, bytes | None]] = {}
    mixed = 0
    for b in StreamingDataset(url, cache_dir=tmp_path / "c", batch_size=7, zero_copy=True):
        txt = b.get("txt", [None] * len(b["__key__"]))  # a field no sample of the batch has is absent
        mixed += any(t is None for t in txt) and any(t is not None for t in txt)
        for k, x, t in zip(b["__key__"], b["bin"], txt):
            got[k] = (bytes(x), None if t is None else bytes(t))
    assert got == {d["__key__"]: (d["bin"], d.get("txt")) for d in data}
    assert mixed  # the per-sample (ragged) path ran
    # Packed batches of the same data (the copy path): a field some samples lack is a list too.
    packed: dict[str, tuple[bytes, bytes | None]] = {}
    for b in StreamingDataset(url, cache_dir=tmp_path / "c", batch_size=7, read_threads=0):
        # unpack reads both forms: packed, and a list with None where a sample lacks the field
        txt = unpack(b, "txt") if "txt" in b else [None] * len(b["__key__"])
        for k, x, t in zip(b["__key__"], unpack(b, "bin"), txt):
            assert x is not None
            packed[k] = (bytes(x), None if t is None else bytes(t))
    assert packed == got


def mapping_rss_kb(addr: int) -> int:
    """Rss of the mapping that holds ``addr`` in this process (/proc/self/smaps)."""
    with open(f"/proc/{os.getpid()}/smaps") as f:
        inside = False
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
            elif inside and head[0] == "Rss:":
                return int(head[1])
    raise AssertionError("no mapping")


def _kernel() -> tuple[int, int]:
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or _kernel() < (5, 14),
                    reason="MADV_POPULATE_READ needs Linux 5.14+")
def test_map_warmer_maps_pages_in_on_its_own_thread(tmp_path: Path) -> None:
    import mmap
    import threading

    from shardkit.batch.map_warmer import MapWarmer

    class FakeHeld:  # what the warmer uses of a read.shard_source.Held
        def __init__(self, array: np.ndarray, mapped: object) -> None:
            self.array, self.mapped = array, mapped

    path = tmp_path / "f"
    path.write_bytes(os.urandom(8 << 20))
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    arr = np.frombuffer(m, np.uint8)
    assert mapping_rss_kb(arr.ctypes.data) < 1024  # a fresh map: nothing mapped in yet
    held = FakeHeld(arr, m)
    warm = MapWarmer()
    warm(held)  # type: ignore[arg-type]
    assert any(t.name.startswith("shardkit-map") for t in threading.enumerate())
    warm(held)  # type: ignore[arg-type]  # once per shard
    warm.close()
    assert mapping_rss_kb(arr.ctypes.data) >= (8 << 10) - 64  # every page mapped, by the warmer
    assert not any(t.name.startswith("shardkit-map") for t in threading.enumerate())
