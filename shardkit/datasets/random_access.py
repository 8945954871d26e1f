"""ShardDataset: map-style random access to single samples and to row ranges of large arrays.

``ds[i]`` reads exactly one sample's byte range: from the node cache when its shard is
already there (a zero-copy slice of the mapped file), else with one ranged GET, or parallel
ranged GETs into one preallocated buffer when the sample is larger than ``part_size``
(:mod:`shardkit.storage.ranged`). Whole shards are downloaded only with ``cache_shards=True``.

``ds.read_array(i, "npy", rows=slice(a, b))`` reads only rows ``a..b`` of a C-ordered ``.npy``
member of a big sample: the 1 MiB block holding the header (parsed once per sample and
field), then the blocks holding the rows.

Verification: a sample returned by ``ds[i]`` has had its xxh3-64 checked (once per process
for a cached sample, hashed with ``pread`` so a 300 MB sample never inflates RSS). Reads by
``read_array`` and ``npy_header`` from storage are checked too (:mod:`shardkit.read.checked`):
a sample larger than one block is read in whole blocks, each checked against the sample's
``block_checksums``, and a smaller one is read whole and checked against its checksum. The
exception is a dataset packed before block checksums existed: there a partial read of a
sample larger than 1 MiB moves only the rows' bytes, unchecked (``shardkit verify --deep``
checks every byte). A read from the cache checks the sample checksum on first use, like
``ds[i]``, unless the cached shard file is still the one verified whole on download.
"""

from __future__ import annotations

import bisect
import io
import logging
import operator
import os
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from shardkit.format.checksums import BLOCK_BYTES
from shardkit.cache.shard_cache import CachedShard, ShardCache, ShardRef
from shardkit.read.checked import block_checksums, read_checked, read_sample
from shardkit.batch.codecs import make_decoder, npy_view
from shardkit.config import checked_cache_dir, parse_size
from shardkit.errors import ConfigError, IntegrityError, ManifestError, SampleNotFoundError, ShardkitError
from shardkit.format.manifest import parquet_file
from shardkit.storage.ranged import ByteCounter, RangedReader, StreamReader, Transport, choose_transport, read_fully
from shardkit.read.dataset import Dataset, ShardInfo, ShardRows, manifest_copies_dir, sample_dict
from shardkit.read.segments import GAP_BYTES
from shardkit.read.shard_source import cache_namespace, shard_ref

try:  # torch is optional: without it ShardDataset is a plain sequence-like object
    from torch.utils.data import Dataset as _MapBase
except ImportError:  # pragma: no cover - exercised only without torch
    _MapBase = object  # type: ignore[misc,assignment]

__all__ = ["ShardDataset", "SampleNotFoundError"]

log = logging.getLogger(__name__)

_HEAD_READ = 4096            # first read of a .npy member; np.save headers are 128 bytes or so
_MAX_HEADER = 65536 + 16     # the bound numpy itself applies (codecs.npy_view)
_PREAD_CHUNK = 8 * 2**20
_MMAP_HASH_MAX = 4 * 2**20   # smaller cached samples are hashed through the mapping




class NpyHeader(NamedTuple):
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran: bool
    data_offset: int  # shard byte offset of the first array byte


# Shard bytes [start, end) of one sample, fetched (checked or not, as the reader decided):
# a buffer holding them and the shard byte where that buffer begins.
_Fetch = Callable[[int, int], "tuple[np.ndarray, int]"]


class _LRU(OrderedDict):  # type: ignore[type-arg]
    def __init__(self, limit: int, on_evict: Callable[[Any], None] | None = None) -> None:
        super().__init__()
        self.limit, self.on_evict = limit, on_evict

    def get_fresh(self, key: Any) -> Any:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            _, old = self.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(old)


class _KeyIndex:
    """Keys sorted once with Arrow plus their global indices; lookups binary-search the array.

    Memory is the key bytes + 4 (string offsets) + 8 (index) bytes per sample, in Arrow and
    numpy buffers (no Python object per key): measured 24 B/key for 12-character keys, so
    ~0.5 GB for 20 M samples, against ~2.5 GB for a dict of str -> int. Building reads only
    the manifest's ``key`` column and sorts it once (measured ~1.2 s per million keys on a
    loaded 2-core machine); a lookup is a binary search, ~25 Arrow scalar reads (~0.1 ms).
    """

    def __init__(self, keys: pa.Array, index: np.ndarray) -> None:
        order = pc.sort_indices(keys).to_numpy()
        self.keys = keys.take(pa.array(order))
        self.index = index[order]

    def find(self, key: str) -> int | None:
        keys = self.keys
        lo = bisect.bisect_left(range(len(keys)), key, key=lambda k: keys[k].as_py())
        if lo < len(keys) and keys[lo].as_py() == key:
            return int(self.index[lo])
        return None


def _hash_file(path: str, start: int, size: int) -> int:
    """xxh3-64 of a file range through ``pread`` (page cache only: RSS stays flat)."""
    h = xxhash.xxh3_64()
    buf = bytearray(min(_PREAD_CHUNK, max(size, 1)))
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = 0
        while done < size:
            n = os.preadv(fd, [view[:min(len(buf), size - done)]], start + done)
            if n <= 0:
                break
            h.update(view[:n])
            done += n
    finally:
        os.close(fd)
    return h.intdigest()


def _array_at(got: tuple[np.ndarray, int], start: int, hdr: NpyHeader, shape: tuple[int, ...]) -> np.ndarray:
    """The array of ``shape`` whose bytes begin at shard byte ``start``, as a view of ``got``
    (a buffer of fetched bytes and the shard byte it begins at)."""
    buf, base = got
    nbytes = int(np.prod(shape, dtype=np.int64)) * hdr.dtype.itemsize
    return buf[start - base:start - base + nbytes].view(hdr.dtype).reshape(shape, order="F" if hdr.fortran else "C")


class ShardDataset(_MapBase):  # type: ignore[misc,valid-type]
    """Map-style access to a shardkit dataset: ``len(ds)``, ``ds[i]``, ``ds.by_key(key)``, ``ds.read_array``.

    Works with ``torch.utils.data.DataLoader`` and ``DistributedSampler``: it pickles as its
    URL, options and the small shard table, and opens storage, the cache and clients lazily in
    each process.

    Args:
        url: dataset root (``s3://bucket/ds``, a local path, ...).
        cache_dir: node cache directory (the one :class:`~shardkit.StreamingDataset` uses).
            Samples of shards already cached there are served from it; other samples are read
            with ranged GETs. ``None``: always read from storage.
        cache_limit: the cache's bound (used when ``cache_shards`` downloads).
        decode: ``None`` (raw bytes), ``"pil"``, ``"numpy"`` (``.npy`` fields as zero-copy
            arrays: read-only memmaps from the cache, views of the fetched buffer otherwise)
            or a callable on the raw sample, as in StreamingDataset.
        storage_options: fsspec/s3fs options (explicit values beat ``AWS_*`` variables).
        part_size: ranged GET size; larger samples are fetched in parallel parts.
        concurrency: parallel GETs per large read.
        cache_shards: download a sample's whole shard into the cache on first access (for
            repeated random access over a dataset that fits the cache).
        transport: ``"auto"`` (boto3 for S3, else fsspec), ``"boto3"`` or ``"fsspec"``.
        max_open_shards: cached shards kept mapped (and pinned against eviction) per process.
    """

    def __init__(self, url: str, cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | str = "200GB",
                 decode: str | Callable[[dict[str, Any]], Any] | None = None,
                 storage_options: dict[str, Any] | None = None, part_size: int | str = "16MB",
                 concurrency: int = 8, *, cache_shards: bool = False, transport: Transport = "auto",
                 max_open_shards: int = 4) -> None:
        if concurrency < 1:
            raise ConfigError(f"concurrency: must be >= 1, got {concurrency}")
        if max_open_shards < 1:
            raise ConfigError(f"max_open_shards: must be >= 1, got {max_open_shards}")
        if cache_shards and cache_dir is None:
            raise ConfigError("cache_shards=True needs a cache_dir")
        self.ds = Dataset(url, storage_options)
        self.url = self.ds.url
        self.cache_dir = checked_cache_dir(cache_dir)
        # As StreamingDataset: manifests bounded in memory, copies local, with or without a cache.
        self.ds.manifest_cache = manifest_copies_dir(cache_namespace(self.ds))
        self.cache_limit = parse_size(cache_limit, "cache_limit")
        self.decode = decode
        self.part_size = parse_size(part_size, "part_size")
        self.concurrency = int(concurrency)
        self.cache_shards = bool(cache_shards)
        self.max_open_shards = int(max_open_shards)
        self.transport = choose_transport(self.ds.store, transport)
        make_decoder(decode)  # validate in the main process
        self._first = self.ds.first_samples
        self._key_index: _KeyIndex | None = None
        self._init_process()

    # ---- per-process state ----------------------------------------------------------------

    def _init_process(self) -> None:
        self._pid = os.getpid()
        self._decoder = make_decoder(self.decode)
        self._headers = _LRU(4096)
        self._open = _LRU(self.max_open_shards, on_evict=lambda c: c.close())
        self._verified: set[tuple[int, int]] = set()
        self._cache: ShardCache | None = None
        self._counter = ByteCounter()

    def _local(self) -> None:
        # After a fork (DataLoader workers) the parent's pins, fds and clients are not ours.
        if self._pid != os.getpid():
            self._init_process()

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_") or k in ("_first",)}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._key_index = None
        self._init_process()

    def __repr__(self) -> str:
        return f"ShardDataset({self.url!r}, samples={len(self)}, cache_dir={self.cache_dir!r})"

    def __len__(self) -> int:
        return self.ds.num_samples

    def close(self) -> None:
        """Unpin the cached shards this process holds open (arrays already returned stay valid)."""
        if self._pid != os.getpid():
            return
        while self._open:
            _, cached = self._open.popitem(last=False)
            cached.close()
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    def __enter__(self) -> ShardDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Bytes and GET requests this process's reads moved from storage (not the cache)."""
        return self._counter.snapshot()

    # ---- locating -------------------------------------------------------------------------

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, position in shard) of global sample ``index`` (negative counts from the end)."""
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"sample index must be an integer, got {type(index).__name__}") from None
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {index} out of range for {n} samples in {self.url}")
        shard = int(np.searchsorted(self._first, i, side="right")) - 1
        return shard, i - int(self._first[shard])

    def _shard_rows(self, shard: int) -> ShardRows:
        self._local()
        return self.ds.cached_rows(shard)

    def index_of(self, key: str) -> int:
        """Global index of the sample with ``key`` (SampleNotFoundError if none).

        The first call builds the key index from the manifest's ``key`` column only: one
        Arrow sort (~1 s per million keys) and ~(key length + 12) bytes per sample for the
        process's lifetime (~0.5 GB for 20 M short keys; see ``_KeyIndex``). Build it in the main process before DataLoader
        workers fork and they share it copy-on-write.
        """
        if self._key_index is None:
            self._key_index = self._build_key_index()
        found = self._key_index.find(str(key))
        if found is None:
            raise SampleNotFoundError(f"no sample with key {key!r} in {self.url}")
        return found

    def by_key(self, key: str) -> Any:
        """The sample with ``key``, as ``ds[ds.index_of(key)]``."""
        return self[self.index_of(key)]

    def _build_key_index(self) -> _KeyIndex:
        store = self.ds.store
        by_file: dict[str, list[ShardInfo]] = {}
        for info in self.ds.shard_list:
            if info.num_samples:
                if not info.samples_file or info.samples_row_group < 0:
                    return self._key_index_from_samples()
                by_file.setdefault(info.samples_file, []).append(info)
        keys: list[pa.Array] = []
        index: list[np.ndarray] = []
        for name, infos in by_file.items():
            groups = [s.samples_row_group for s in infos]
            table = parquet_file(store.read_bytes(name)).read_row_groups(groups, columns=["key"], use_threads=False)
            if table.num_rows != sum(s.num_samples for s in infos):
                raise ManifestError(f"{self.url}: {name} holds {table.num_rows} keys, shards.parquet says "
                                    f"{sum(s.num_samples for s in infos)}")
            keys.extend(table.column("key").chunks)
            index.extend(np.arange(s.first_sample, s.first_sample + s.num_samples, dtype=np.int64) for s in infos)
        if not keys:
            return _KeyIndex(pa.array([], pa.string()), np.empty(0, np.int64))
        return _KeyIndex(pa.chunked_array(keys).combine_chunks(), np.concatenate(index))

    def _key_index_from_samples(self) -> _KeyIndex:
        table = self.ds.samples.select(["key", "shard"])
        if table.num_rows and not bool(pc.all(pc.greater_equal(
                pc.pairwise_diff(table.column("shard").combine_chunks()).fill_null(0), 0)).as_py()):
            raise ManifestError(f"{self.url}: sample rows are not in shard order")
        return _KeyIndex(table.column("key").combine_chunks(), np.arange(table.num_rows, dtype=np.int64))

    # ---- the node cache -------------------------------------------------------------------

    def _cache_obj(self) -> ShardCache | None:
        self._local()
        if self.cache_dir is None:
            return None
        if self._cache is None:
            # verify=False: every download is hashed before it is published, and a file still
            # bearing the cache's "verified" stamp is trusted; an unstamped one (changed since,
            # or stamped by nobody) has its samples checked one by one below.
            self._cache = ShardCache(self.cache_dir, self.cache_limit, namespace=cache_namespace(self.ds),
                                     verify=False)
        return self._cache

    def _shard_reader(self, ref: ShardRef) -> StreamReader:
        """The cache's reader of a whole shard (``cache_shards``): one stream, counted in stats."""
        return StreamReader(self.ds.store, ref.name, ref.size, counter=self._counter)

    def _cached(self, info: ShardInfo) -> CachedShard | None:
        """The mapped shard if it is in the cache (or ``cache_shards`` fetches it), else None."""
        cache = self._cache_obj()
        if cache is None:
            return None
        cached = self._open.get_fresh(info.shard)
        if cached is not None:
            return cached
        ref = shard_ref(info)
        # ShardCache has no "open only if present": look for the published file first. If it is
        # evicted between this check and open(), open() downloads it again (rare, and correct).
        present = cache.contains(ref)
        if not present and not self.cache_shards:
            return None
        cached = cache.open(ref, self._shard_reader)
        self._open.put(info.shard, cached)
        return cached

    def _verify_cached(self, cached: CachedShard, info: ShardInfo, rows: ShardRows, pos: int, index: int) -> None:
        if cached.verified or (info.shard, pos) in self._verified:
            return  # the whole shard file is verified and unchanged (the cache's stamp)
        start, size = int(rows.offset[pos]), int(rows.size[pos])
        if size <= _MMAP_HASH_MAX:
            got = xxhash.xxh3_64_intdigest(cached.buffer()[start:start + size])
        else:  # a big sample through pread: the mapping's pages are not touched, RSS stays flat
            got = _hash_file(cached.path, start, size)
        if got != int(rows.checksum[pos]):
            raise IntegrityError(f"sample {rows.key(pos)!r} (index {index}) in cached {info.path} fails its "
                                 f"checksum (corrupt cache file {cached.path})")
        if len(self._verified) > 1_000_000:
            self._verified.clear()
        self._verified.add((info.shard, pos))

    # ---- whole samples --------------------------------------------------------------------

    def __getitem__(self, index: int) -> Any:
        shard, pos = self.locate(index)
        i = int(self._first[shard]) + pos
        info = self.ds.shard_list[shard]
        rows = self._shard_rows(shard)
        cached = self._cached(info)
        if cached is not None:
            self._verify_cached(cached, info, rows, pos, i)
            view, base = cached.buffer(), 0
        else:
            view, base = self._read_sample(info, rows, pos, i).data, int(rows.offset[pos])
        return self._decoder(sample_dict(view, base, rows, pos, i, info.path))

    def _reader(self, info: ShardInfo) -> RangedReader:
        """A reader of ``info``'s shard: ranged GETs of ``part_size``, ``concurrency`` at a time."""
        return RangedReader(self.ds.store, info.path, part_size=self.part_size, concurrency=self.concurrency,
                            transport=self.transport, counter=self._counter)  # type: ignore[arg-type]

    def _read_sample(self, info: ShardInfo, rows: ShardRows, pos: int, index: int) -> np.ndarray:
        return read_sample(self._reader(info), info, rows, pos, index)

    def _fetcher(self, info: ShardInfo, rows: ShardRows, pos: int, index: int, checked: bool) -> _Fetch:
        """Reads of sample ``pos``'s bytes for one call: checked (whole blocks, or the whole
        sample) or exactly the range asked for; a range inside a read already made is served
        from it (the header's block often holds the rows asked for too)."""
        done: list[tuple[np.ndarray, int]] = []
        read = self._reader(info)

        def fetch(start: int, end: int) -> tuple[np.ndarray, int]:
            for buf, base in done:
                if base <= start and end <= base + len(buf):
                    return buf, base
            if checked:
                got = read_checked(read, info, rows, pos, index, start, end)
            else:
                got = (np.empty(end - start, dtype=np.uint8), start)
                read_fully(read, start, got[0].data, info.path)
            done.append(got)
            return got

        return fetch

    def _checked(self, info: ShardInfo, rows: ShardRows, pos: int, whole: bool) -> bool:
        """Whether reads of sample ``pos`` are checked: always, but for part of a sample larger
        than one block in a manifest without block checksums (written before they existed),
        where checking would mean reading the whole sample."""
        return whole or int(rows.size[pos]) <= BLOCK_BYTES or block_checksums(info, rows, pos) is not None

    # ---- partial reads of .npy members ----------------------------------------------------

    def _field(self, rows: ShardRows, pos: int, field: str, index: int) -> tuple[int, int]:
        names, offs, sizes = rows.fields(pos)
        if field not in names:
            raise ConfigError(f"sample {rows.key(pos)!r} (index {index}) has no field {field!r} (fields: {names})")
        j = names.index(field)
        return int(offs[j]), int(sizes[j])

    def npy_header(self, index: int, field: str = "npy") -> NpyHeader:
        """dtype, shape, order and data offset of a ``.npy`` member (cached per process), read
        and checked as :meth:`read_array` reads a few rows: the block holding the header, or
        the whole of a sample of 1 MiB or less (4 KB, unchecked, for a big sample of a dataset
        packed before block checksums)."""
        shard, pos = self.locate(index)
        i = int(self._first[shard]) + pos
        info, rows = self.ds.shard_list[shard], self._shard_rows(shard)
        offset, size = self._field(rows, pos, field, i)
        checked = self._checked(info, rows, pos, whole=False)
        return self._header(info, rows, pos, i, field, offset, size, self._fetcher(info, rows, pos, i, checked),
                            checked)

    def _header(self, info: ShardInfo, rows: ShardRows, pos: int, index: int, field: str, offset: int, size: int,
                fetch: _Fetch, checked: bool) -> NpyHeader:
        key = (info.shard, pos, field, checked)  # a checked read never uses a header parsed from unchecked bytes
        hit = self._headers.get_fresh(key)
        if hit is not None:
            return hit  # type: ignore[no-any-return]
        name = f"sample {rows.key(pos)!r} (index {index}) field {field!r}"

        def head(n: int) -> bytes:
            n = min(n, size)
            buf, base = fetch(offset, offset + n)
            return bytes(buf[offset - base:offset - base + n])

        raw = head(_HEAD_READ)
        if len(raw) >= 12 and raw[:6] == b"\x93NUMPY":
            prefix = 10 if raw[6] == 1 else 12
            need = prefix + int.from_bytes(raw[8:prefix], "little")
            if need > _MAX_HEADER:
                raise IntegrityError(f"{name}: .npy header of {need} bytes is implausibly large")
            if need > len(raw):
                raw = head(need)
        from shardkit.packing.sources.npy import parse_npy_header

        try:
            dtype, shape, fortran, hlen = parse_npy_header(io.BytesIO(raw), name=name)
        except ShardkitError as exc:
            raise IntegrityError(str(exc)) from exc
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if hlen + nbytes != size:
            raise IntegrityError(f"{name}: .npy header says {hlen} + {nbytes} bytes, the member is {size}")
        header = NpyHeader(dtype, tuple(shape), fortran, offset + hlen)
        self._headers.put(key, header)
        return header

    def read_array(self, index: int, field: str = "npy", rows: int | slice | None = None) -> np.ndarray:
        """Rows of a ``.npy`` member of sample ``index``, reading only their bytes.

        Args:
            index: global sample index.
            field: the member (``"npy"``, ``"depth.npy"``, ...).
            rows: ``None`` (the whole array), an int (one row, first axis dropped) or a slice
                along the first axis. Out-of-range ints and slice bounds raise IndexError
                (slices are not silently clipped).

        Returns:
            The array in its stored dtype (a big-endian member stays big-endian, as with
            ``np.load``; ``decode="numpy"`` converts to native order for torch). From the
            cache: a read-only zero-copy view of the mapped shard. From storage: an array of
            its own, every byte checked against the manifest (see the module docstring for
            the one exception, partial reads in datasets packed before block checksums).
            A C-ordered member moves the rows covering the slice rounded out to whole 1 MiB
            blocks (at most 2 MiB more than the rows, plus the header's block on the first
            read of a sample); rows of a stepped slice 1 MiB or more apart are read one by
            one instead. A sample of 1 MiB or less, and a Fortran-ordered member (its rows
            are not contiguous), move whole, then are sliced.
        """
        shard, pos = self.locate(index)
        i = int(self._first[shard]) + pos
        info, srows = self.ds.shard_list[shard], self._shard_rows(shard)
        offset, size = self._field(srows, pos, field, i)
        cached = self._cached(info)
        if cached is not None:
            self._verify_cached(cached, info, srows, pos, i)
            arr = npy_view(cached.buffer()[offset:offset + size], native=False)  # the stored dtype, as from storage
            return arr if rows is None else arr[self._rows_sel(arr.shape, rows, srows.key(pos), i, field)]
        checked = self._checked(info, srows, pos, whole=rows is None)
        fetch = self._fetcher(info, srows, pos, i, checked)
        hdr = self._header(info, srows, pos, i, field, offset, size, fetch, checked)
        if rows is None:
            return _array_at(fetch(hdr.data_offset, offset + size), hdr.data_offset, hdr, hdr.shape)
        sel = self._rows_sel(hdr.shape, rows, srows.key(pos), i, field)
        if hdr.fortran:
            # Fortran order: a row is strided through the whole array, so the whole array is read.
            whole = _array_at(fetch(hdr.data_offset, offset + size), hdr.data_offset, hdr, hdr.shape)
            return np.ascontiguousarray(whole[sel])
        picked = range(sel, sel + 1) if isinstance(sel, int) else range(*sel.indices(hdr.shape[0]))
        if not picked:
            return np.empty((0,) + hdr.shape[1:], dtype=hdr.dtype)
        row_bytes = int(np.prod(hdr.shape[1:], dtype=np.int64)) * hdr.dtype.itemsize
        if (abs(picked.step) - 1) * row_bytes >= GAP_BYTES:
            # Rows far apart (rows=slice(0, 2400, 800)): one read each, not the span between.
            out = np.empty((len(picked),) + hdr.shape[1:], dtype=hdr.dtype)
            for k, r in enumerate(picked):
                start = hdr.data_offset + r * row_bytes
                out[k] = _array_at(fetch(start, start + row_bytes), start, hdr, (1,) + hdr.shape[1:])[0]
            return out
        lo, hi = min(picked), max(picked) + 1  # the covering rows; exactly the rows when step is 1
        start = hdr.data_offset + lo * row_bytes
        got = fetch(start, start + (hi - lo) * row_bytes)
        block = _array_at(got, start, hdr, (hi - lo,) + hdr.shape[1:])
        if 2 * block.nbytes < len(got[0]):
            block = block.copy()  # a few rows must not keep the blocks read around them alive
        if isinstance(sel, int):
            return block[0]
        if picked.step == 1:
            return block
        return np.ascontiguousarray(block[np.asarray(picked) - lo])

    @staticmethod
    def _rows_sel(shape: tuple[int, ...], rows: int | slice, key: str, index: int, field: str) -> int | slice:
        what = f"sample {key!r} (index {index}) field {field!r}"
        if not shape:
            raise IndexError(f"{what}: a 0-d array has no rows to select")
        n0 = shape[0]
        if isinstance(rows, slice):
            if rows.step == 0:
                raise ConfigError(f"{what}: slice step cannot be zero")
            for bound in (rows.start, rows.stop):
                if bound is not None and not -n0 <= operator.index(bound) <= n0:
                    raise IndexError(f"{what}: slice bound {bound} out of range for {n0} rows")
            return rows
        try:
            r = operator.index(rows)
        except TypeError:
            raise ConfigError(f"{what}: rows must be None, an int or a slice, got {type(rows).__name__}") from None
        if not -n0 <= r < n0:
            raise IndexError(f"{what}: row {r} out of range for {n0} rows")
        return r + n0 if r < 0 else r
