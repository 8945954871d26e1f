"""StreamingDataset(decode_threads=N): decode runs in N threads of the reading process, with the
same samples in the same order as without, and a failing sample still named."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.errors import ConfigError, DecodeError

pytestmark = pytest.mark.timeout(120)
N = 300


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(9)
    data = [{"__key__": f"k{i:04d}", "bin": rng.bytes(int(rng.integers(10, 3000)))} for i in range(N)]
    url = str(tmp_path_factory.mktemp("dthreads") / "ds")
    shardkit.pack(iter(data), url, shard_bytes="100KB", progress=False)
    return url


class Decode:
    """Sums the bytes of a sample and records which threads decoded."""

    def __init__(self, fail: str = "") -> None:
        self.threads: set[str] = set()
        self.fail = fail

    def __call__(self, s: dict[str, Any]) -> dict[str, Any]:
        self.threads.add(threading.current_thread().name)
        if s["__key__"] == self.fail:
            raise ValueError("cannot decode this one")
        return {"__key__": s["__key__"], "__index__": s["__index__"],
                "sum": np.array([sum(s["bin"]), len(s["bin"])], np.int64)}


@pytest.mark.parametrize("batch_size", [None, 32])
def test_decode_threads_give_the_same_samples_in_order(ds_url: str, tmp_path: Path, batch_size: int | None) -> None:
    runs = {}
    for threads in (0, 3):
        decode = Decode()
        ds = StreamingDataset(ds_url, cache_dir=tmp_path, shuffle=True, seed=4, decode=decode,
                              batch_size=batch_size, decode_threads=threads)
        if batch_size is None:
            runs[threads] = [(s["__key__"], s["sum"].tolist()) for s in ds]
        else:
            runs[threads] = [(k, v.tolist()) for b in StreamingDataLoader(ds, num_workers=0)
                             for k, v in zip(b["__key__"], b["sum"])]
        named = {t for t in decode.threads if t.startswith("shardkit-decode")}
        assert (len(named) > 0) == (threads > 0), decode.threads
    assert runs[0] == runs[3] and len(runs[0]) == N


@pytest.mark.parametrize("batch_size", [None, 32])
def test_a_sample_that_fails_in_a_decode_thread_is_named(ds_url: str, tmp_path: Path, batch_size: int | None) -> None:
    ds = StreamingDataset(ds_url, cache_dir=tmp_path, decode=Decode(fail="k0123"), batch_size=batch_size,
                          decode_threads=2)
    with pytest.raises(DecodeError, match="k0123"):
        for _ in ds:
            pass


def test_a_tight_cache_with_decode_threads_and_workers(ds_url: str, tmp_path: Path) -> None:
    # A cache too small for every reader to keep a shard unpins at every batch end: the
    # threads decode bytes copies, and nothing is read past a batch before it is out.
    biggest = max(shardkit.open_dataset(ds_url).shards.column("bytes").to_pylist())
    ds = StreamingDataset(ds_url, cache_dir=tmp_path, cache_limit=3 * biggest, decode=Decode(), decode_threads=2)
    got = [k for b in StreamingDataLoader(ds, batch_size=16, num_workers=2) for k in b["__key__"]]
    assert sorted(got) == [f"k{i:04d}" for i in range(N)]


def test_decode_threads_is_checked(ds_url: str) -> None:
    with pytest.raises(ConfigError, match="decode_threads"):
        StreamingDataset(ds_url, decode_threads=-1)
