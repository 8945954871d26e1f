"""Getting shard bytes to a reader: through the node cache, or straight from storage.

Either way a reader gets a memoryview over the bytes of the samples it needs plus the
shard offset that view starts at, so samples are sliced with the manifest's offsets and
never parsed from tar headers. Bytes are verified before any sample is yielded: the cache
checks the whole shard's xxh3-128; a direct ranged read checks each sample's xxh3-64.
"""

from __future__ import annotations

import xxhash
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, BinaryIO, Iterator, Sequence

import numpy as np

from .cache import ShardCache, ShardRef
from .reader import Dataset, ShardInfo, ShardRows, check_shard_bytes
from .storage import Store


def cache_namespace(ds: Dataset) -> str:
    """A stable id of one committed dataset: a re-pack at the same URL gets a new namespace."""
    ident = f"{ds.url}\0{ds.info.get('created')}\0{ds.info.get('total_bytes')}".encode()
    return xxhash.xxh3_64_hexdigest(ident)


def shard_ref(info: ShardInfo) -> ShardRef:
    return ShardRef(info.path, info.bytes, info.checksum)


class Counters:
    """Reader statistics of one process."""

    def __init__(self) -> None:
        self.bytes_fetched = 0
        self.direct_reads = 0
        self.wait_seconds = 0.0
        self.samples = 0

    def as_dict(self) -> dict[str, float]:
        return {"bytes_fetched": self.bytes_fetched, "direct_reads": self.direct_reads,
                "wait_seconds": self.wait_seconds, "samples": self.samples}


class ShardSource:
    """Opens shards (or the byte span of a run of samples) for one reader process."""

    def __init__(self, ds: Dataset, cache: ShardCache | None, prefetch: int = 2) -> None:
        self.ds = ds
        self.store: Store = ds.store
        self.cache = cache
        self.prefetch = prefetch
        self.counters = Counters()
        self._rows: dict[int, ShardRows] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[tuple[int, int, int], Future[bytes]] = {}

    def fetch(self, ref: ShardRef, out: BinaryIO, start: int) -> None:
        def count(n: int) -> None:
            self.counters.bytes_fetched += n
        self.store.fetch_into(ref.name, out, start, ref.size, progress=count)

    def rows(self, shard: int) -> ShardRows:
        rows = self._rows.get(shard)
        if rows is None:
            if len(self._rows) > 64:  # bound memory: rows of far-away shards are re-read if needed
                self._rows.pop(next(iter(self._rows)))
            rows = self.ds.shard_rows(shard)
            self._rows[shard] = rows
        return rows

    def plan(self, shards: Sequence[int]) -> None:
        """Tell the cache the future order, and start fetching the first shards."""
        if self.cache is None:
            return
        infos = self.ds.shard_list
        self.cache.set_schedule([infos[s].path for s in shards])
        if self.prefetch:
            self.cache.prefetch([shard_ref(infos[s]) for s in shards], self.fetch, max_ahead=self.prefetch)

    def advance(self, upcoming: Sequence[int]) -> None:
        """Keep prefetching the next shards as the reader moves on."""
        if self.cache is not None and self.prefetch and upcoming:
            infos = self.ds.shard_list
            self.cache.prefetch([shard_ref(infos[s]) for s in upcoming], self.fetch, max_ahead=self.prefetch)

    @contextmanager
    def open_run(self, shard: int, positions: np.ndarray, upcoming: Sequence[tuple[int, np.ndarray]] = ()
                 ) -> Iterator[tuple[memoryview, int, bool]]:
        """Bytes covering samples ``positions`` of ``shard``: (view, base offset, needs per-sample verify)."""
        info = self.ds.shard_list[shard]
        t0 = time.perf_counter()
        if self.cache is not None:
            with self.cache.open(shard_ref(info), self.fetch) as cached:
                self.counters.wait_seconds += time.perf_counter() - t0
                yield cached.buffer(), 0, False
            return
        rows = self.rows(shard)
        start, end = self._span(rows, positions)
        data = self._read_span(info, start, end)
        self._read_ahead(upcoming)
        self.counters.wait_seconds += time.perf_counter() - t0
        if start == 0 and end == info.bytes:
            check_shard_bytes(data, info)  # one hash for the whole shard instead of per sample
            yield memoryview(data), 0, False
        else:
            yield memoryview(data), start, True

    @staticmethod
    def _span(rows: ShardRows, positions: np.ndarray) -> tuple[int, int]:
        lo = int(rows.offset[positions].min())
        hi = int((rows.offset[positions] + rows.size[positions]).max())
        return lo, hi

    def _whole_or_span(self, info: ShardInfo, start: int, end: int) -> tuple[int, int]:
        # A run covering most of a shard reads the whole file: one request, one checksum.
        return (0, info.bytes) if end - start > 0.75 * info.bytes else (start, end)

    def _read_span(self, info: ShardInfo, start: int, end: int) -> bytes:
        start, end = self._whole_or_span(info, start, end)
        fut = self._ahead.pop((info.shard, start, end), None)
        data = fut.result() if fut is not None else self._get(info.path, start, end)
        return data

    def _get(self, path: str, start: int, end: int) -> bytes:
        data = self.store.read_range(path, start, end)
        self.counters.bytes_fetched += len(data)
        self.counters.direct_reads += 1
        return data

    def _read_ahead(self, upcoming: Sequence[tuple[int, np.ndarray]]) -> None:
        if not self.prefetch or not upcoming:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.prefetch, thread_name_prefix="shardkit-readahead")
        for shard, positions in list(upcoming)[: self.prefetch]:
            info = self.ds.shard_list[shard]
            start, end = self._whole_or_span(info, *self._span(self.rows(shard), positions))
            key = (shard, start, end)
            if key not in self._ahead:
                self._ahead[key] = self._pool.submit(self._get, info.path, start, end)

    def close(self) -> None:
        for fut in self._ahead.values():
            fut.cancel()
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self.cache is not None:
            self.cache.close()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.counters.as_dict()
        if self.cache is not None:
            cs = self.cache.stats()
            out.update({k: v for k, v in cs.items() if k != "bytes_fetched"})
            out["wait_seconds"] = self.counters.wait_seconds
        return out
