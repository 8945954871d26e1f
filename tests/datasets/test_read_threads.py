"""Raw batches filled by read threads in the main process (StreamingDataset(read_threads=...)),
and the preadv member copy they use."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from randomds import pack_random
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.batch.collate import unpack
from shardkit.errors import ConfigError, IntegrityError
from shardkit.batch.copying import read_members

N = 500


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    return pack_random(tmp_path_factory.mktemp("threads"), n=N, max_body=9000, classes=7, shard_bytes="80KB",
                       seed=5, prefix="k")


def fill_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("shardkit-fill")}


def batches_as_pairs(batches: list[dict[str, Any]]) -> list[tuple[str, bytes, bytes]]:
    out = []
    for b in batches:
        out += list(zip(b["__key__"], (bytes(x) for x in unpack(b, "bin")), (bytes(x) for x in unpack(b, "cls"))))
    return out


@pytest.mark.parametrize("shuffle,drop_last,world", [(False, False, 1), (True, False, 3), (True, True, 2)])
def test_threaded_batches_equal_serial_ones(ds_url: tuple[str, dict[str, bytes]], tmp_path: Path,
                                            shuffle: bool, drop_last: bool, world: int) -> None:
    url, content = ds_url
    got: dict[int, list[list[tuple[str, bytes, bytes]]]] = {}
    for threads in (0, 2):
        got[threads] = []
        for rank in range(world):
            sd = StreamingDataset(url, cache_dir=tmp_path / "c", batch_size=32, shuffle=shuffle, seed=3,
                                  drop_last=drop_last, rank=rank, world_size=world, read_threads=threads)
            seen_threads: set[str] = set()
            batches = []
            for b in sd:
                seen_threads |= fill_threads()
                batches.append(b)
            assert len(batches) == len(sd)
            assert bool(seen_threads) == (threads > 0)  # the threaded path really ran (or not)
            got[threads].append(batches_as_pairs(batches))
    assert got[2] == got[0]  # same samples, same order, same bytes, rank by rank
    for rank_pairs in got[2]:
        for key, data, cls in rank_pairs:
            assert data == content[key] and cls == str(int(key[1:]) % 7).encode()
    if not drop_last:
        assert {k for pairs in got[2] for k, _, _ in pairs} == set(content)


def test_threaded_loader_resumes_exactly(ds_url: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, content = ds_url
    sd = StreamingDataset(url, cache_dir=tmp_path, batch_size=16, shuffle=True, seed=1)
    loader = StreamingDataLoader(sd, num_workers=0)
    first: list[str] = []
    for i, b in enumerate(loader):
        first += b["__key__"]
        if i == 6:
            state = loader.state_dict()
            break
    assert not fill_threads()  # an early break stops the copy threads
    sd2 = StreamingDataset(url, cache_dir=tmp_path, batch_size=16, shuffle=True, seed=1)
    loader2 = StreamingDataLoader(sd2, num_workers=0)
    loader2.load_state_dict(state)
    rest = [k for b in loader2 for k in b["__key__"]]
    assert sorted(first + rest) == sorted(content)


def test_early_break_unpins_every_shard(ds_url: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, _ = ds_url
    sd = StreamingDataset(url, cache_dir=tmp_path, batch_size=8)
    it = iter(sd)
    next(it)
    assert fill_threads()
    it.close()  # GeneratorExit inside: copies in flight finish, then every shard closes
    assert not fill_threads()
    assert not [p for p in Path(f"/proc/{os.getpid()}/fd").iterdir()
                if str(tmp_path) in os.path.realpath(p) and os.path.realpath(p).endswith(".tar")]


def test_tight_cache_fills_without_threads(ds_url: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    # Batches in flight pin their shards: a cache with room for a few shards only must not use
    # threads (a fill could wait for space that only the waiting loop would free).
    url, content = ds_url
    biggest = max(shardkit.open_dataset(url).shards.column("bytes").to_pylist())
    sd = StreamingDataset(url, cache_dir=tmp_path, cache_limit=4 * biggest, batch_size=32)
    seen: set[str] = set()
    keys = []
    for b in sd:
        seen |= fill_threads()
        keys += b["__key__"]
    assert not seen and sorted(keys) == sorted(content)


def test_read_threads_is_validated(ds_url: tuple[str, dict[str, bytes]]) -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="read_threads"):
            StreamingDataset(ds_url[0], read_threads=bad)  # type: ignore[arg-type]


def test_second_stream_reuses_parsed_manifest_rows(ds_url: tuple[str, dict[str, bytes]], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = ds_url
    shardkit.read.dataset._MEMOS.clear()
    calls: list[int] = []
    real = shardkit.read.dataset.Dataset.shard_rows
    monkeypatch.setattr(shardkit.read.dataset.Dataset, "shard_rows", lambda self, s: calls.append(s) or real(self, s))
    n = sum(len(b["__key__"]) for b in StreamingDataset(url, cache_dir=tmp_path, batch_size=64))
    first = len(calls)
    assert n == N and first >= shardkit.open_dataset(url).num_shards
    assert sum(len(b["__key__"]) for b in StreamingDataset(url, cache_dir=tmp_path, batch_size=64)) == N
    assert len(calls) == first  # a new stream on the same committed dataset parsed nothing again


# ---- read_members ------------------------------------------------------------------------


def test_read_members_matches_slicing(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    blob = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(blob.tobytes())
    # 1,500 samples x 2 fields: members with small and huge gaps, zero sizes, a sample twice
    # (padding repeats one), out of file order (shuffled): more than one preadv's IOV_MAX.
    n = 1500
    starts = np.sort(rng.choice(np.arange(0, (3 << 20) - 5000, 16), size=n, replace=False))
    sizes = np.stack([rng.integers(0, 1500, n), rng.integers(0, 3, n)], axis=1)
    starts2 = np.stack([starts, starts + sizes[:, 0] + rng.integers(0, 600, n)], axis=1)
    order = rng.permutation(n)
    order[7] = order[3]
    starts2, sizes = starts2[order], sizes[order]
    offsets = np.zeros((2, n + 1), np.int64)
    np.cumsum(sizes.T, axis=1, out=offsets[:, 1:])
    outs = [np.full(int(offsets[j, -1]), 7, np.uint8) for j in range(2)]
    fd = os.open(path, os.O_RDONLY)
    try:
        read_members(fd, outs, offsets[:, :-1].T.copy(), starts2, sizes, "shard 0 (blob)")
    finally:
        os.close(fd)
    for j in range(2):
        want = [blob[a:a + s] for a, s in zip(starts2[:, j], sizes[:, j])]
        assert np.array_equal(outs[j], np.concatenate(want))


def test_read_members_names_a_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 1000)
    out = [np.zeros(600, np.uint8)]
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(IntegrityError, match=r"shard 4 \(shards/shard-000004.tar\).*ends early"):
            read_members(fd, out, np.array([[0]]), np.array([[700]]), np.array([[600]]),
                         "shard 4 (shards/shard-000004.tar)")
    finally:
        os.close(fd)
