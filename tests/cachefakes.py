"""A fake object store for node-cache tests (imported by test modules): a directory of random
shard files, and readers of them that the cache downloads with.

:class:`Remote` gives sequential readers (as a stream over fsspec does), :class:`PosRemote`
parallel ones that land parts out of order (as ranged GETs do). Both are picklable, so spawned
processes get the same one, and both log every download attempt (shard, start byte, pid) to a
file with O_APPEND, so attempts from several processes can be counted.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import xxhash

from shardkit.cache.shard_cache import ShardCache, ShardRef
from shardkit.storage.ranged import PartCallback

__all__ = ["NS", "MB", "Remote", "PosRemote", "FnReader", "Store", "make_store", "pos_store", "wait_for",
           "UsageSampler"]

NS = "ds0"
MB = 1 << 20


def _log(path: str, ref: ShardRef, start: int) -> None:
    with open(path, "a") as f:
        f.write(f"{ref.name} {start} {os.getpid()}\n")


def _calls(path: str) -> list[tuple[str, int, int]]:
    if not os.path.exists(path):
        return []
    rows = [line.split() for line in Path(path).read_text().splitlines()]
    return [(n, int(s), int(p)) for n, s, p in rows]


@dataclass(frozen=True)
class Remote:
    """Fake object store; ``remote(ref)`` is a sequential reader of one shard (a ReaderFor)."""

    src: str
    log: str
    delay: float = 0.0  # seconds after each chunk, to widen races
    fail_at: int | None = None  # raise ConnectionError once this byte is written
    hang_at: int | None = None  # sleep here until killed
    chunk: int = 256 << 10

    def data(self, name: str) -> bytes:
        return (Path(self.src) / name.replace("/", "_")).read_bytes()

    def __call__(self, ref: ShardRef) -> _StreamReader:
        return _StreamReader(self, ref)

    def calls(self) -> list[tuple[str, int, int]]:
        return _calls(self.log)


class _StreamReader:
    """One download attempt of a :class:`Remote`: at most ``chunk`` bytes a call, front to back."""

    parallel = False

    def __init__(self, remote: Remote, ref: ShardRef) -> None:
        self.remote, self.ref = remote, ref
        self.first: int | None = None
        self._data = b""

    def read_into(self, start: int, out: memoryview, on_part: PartCallback | None = None) -> int:
        r = self.remote
        if self.first is None:  # the attempt's first read: log it
            self.first = start
            _log(r.log, self.ref, start)
            self._data = r.data(self.ref.name)
        elif r.delay:  # after the chunk before, which the cache has written by now
            time.sleep(r.delay)
        if start > self.first and start == r.fail_at:
            raise ConnectionError(f"injected reset at byte {start}")
        if start > self.first and start == r.hang_at:
            time.sleep(600)
        stops = [x for x in (r.fail_at, r.hang_at) if x is not None and x > start]
        end = min([len(self._data), start + r.chunk, start + len(out), *stops])
        n = max(0, end - start)
        out[:n] = self._data[start:start + n]
        return n


@dataclass(frozen=True)
class PosRemote:
    """A parallel reader over the fake store: parts written by threads, last part first."""

    src: str
    log: str
    part: int = 256 << 10
    fail_after: int | None = None  # raise ConnectionError after this many parts landed
    corrupt: bool = False  # flip one byte in the middle
    reports: bool = False  # report each part to on_part (after all of them landed)

    def data(self, name: str) -> bytes:
        return (Path(self.src) / name.replace("/", "_")).read_bytes()

    def __call__(self, ref: ShardRef) -> FnReader:
        return FnReader(lambda start, out, on_part=None: self.fill(ref, start, out, on_part), parallel=True)

    def fill(self, ref: ShardRef, start: int, view: memoryview, on_part: PartCallback | None = None) -> int:
        _log(self.log, ref, start)
        assert start == 0 and len(view) == ref.size and not view.readonly  # the whole shard at once
        data = self.data(ref.name)
        bounds = list(range(start, len(data), self.part))[::-1]  # out of order on purpose
        done = [0]
        mu = threading.Lock()

        def one(lo: int) -> None:
            with mu:
                if self.fail_after is not None and done[0] >= self.fail_after:
                    raise ConnectionError(f"injected reset before byte {lo}")
                done[0] += 1
            hi = min(len(data), lo + self.part)
            view[lo:hi] = data[lo:hi]

        with ThreadPoolExecutor(4) as pool:
            for fut in [pool.submit(one, lo) for lo in bounds]:
                fut.result()
        if self.corrupt and ref.size:
            view[ref.size // 2] ^= 0xFF
        if self.reports and on_part is not None:
            for lo in range(start, ref.size, self.part):
                on_part(lo, min(ref.size, lo + self.part))
        return ref.size - start

    def calls(self) -> list[tuple[str, int]]:
        return [(n, s) for n, s, _ in _calls(self.log)]


@dataclass(frozen=True)
class FnReader:
    """A RangeReader made of a function, for tests that read in their own way."""

    fn: Callable[..., int]
    parallel: bool

    def read_into(self, start: int, out: memoryview, on_part: PartCallback | None = None) -> int:
        return self.fn(start, out, on_part)


@dataclass
class Store:
    """The fake remote, its shards and a cache directory."""

    remote: Remote
    refs: list[ShardRef]
    cache_dir: str

    def cache(self, limit: int, **kw: Any) -> ShardCache:
        kw.setdefault("namespace", NS)
        return ShardCache(self.cache_dir, limit, **kw)

    def final(self, ref: ShardRef, ns: str = NS) -> Path:
        return Path(self.cache_dir) / ns / ref.name.replace("/", "%2F")

    def temps(self, ns: str = NS) -> list[Path]:
        return sorted((Path(self.cache_dir) / ns / ".tmp").iterdir())

    def cached(self, ns: str = NS) -> set[str]:
        return {r.name for r in self.refs if self.final(r, ns).exists()}


def make_store(tmp_path: Path, sizes: list[int], seed: int = 0) -> Store:
    rng = random.Random(seed)
    src = tmp_path / "remote"
    src.mkdir()
    refs = []
    for i, size in enumerate(sizes):
        name = f"shards/shard-{i:06d}.tar"
        data = rng.randbytes(size)
        (src / name.replace("/", "_")).write_bytes(data)
        refs.append(ShardRef(name, size, xxhash.xxh3_128_hexdigest(data)))
    return Store(Remote(str(src), str(tmp_path / "calls.log")), refs, str(tmp_path / "cache"))


def pos_store(tmp_path: Path, sizes: list[int], **kw: Any) -> tuple[Store, PosRemote]:
    s = make_store(tmp_path, sizes)
    return s, PosRemote(s.remote.src, str(tmp_path / "pos-calls.log"), **kw)


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


class UsageSampler(threading.Thread):
    """Polls usage() every ~2 ms; ``peak`` is the largest value seen."""

    def __init__(self, cache: ShardCache) -> None:
        super().__init__(name="usage-sampler", daemon=True)
        self.cache, self.peak, self.samples, self.stop = cache, 0, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.cache.usage())
            self.samples += 1
            time.sleep(0.002)

    def finish(self) -> int:
        self.stop.set()
        self.join()
        return self.peak
