"""ShardDataset: map-style random access to single samples and to row ranges of large arrays.

``ds[i]`` reads exactly one sample's byte range: from the node cache when its shard is
already there (a zero-copy slice of the mapped file), else with one ranged GET, or parallel
ranged GETs into one preallocated buffer when the sample is larger than ``part_size``
(:mod:`shardkit.storage.ranged`). Whole shards are downloaded only with ``cache_shards=True``.

``ds.read_array(i, "npy", rows=slice(a, b))`` reads only rows ``a..b`` of a C-ordered ``.npy``
member of a big sample: the 1 MiB block holding the header (parsed once per sample and
field), then the blocks holding the rows (:mod:`shardkit.datasets.array_reads`).

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

import operator
import os
from typing import Any, Callable

import numpy as np

from shardkit.cache.shard_cache import CachedShard, LandingShard, ShardRef
from shardkit.config import checked_cache_dir, int_arg, parse_size
from shardkit.datasets.array_reads import (Fetch, NpyHeader, array_at, member_name, member_span, read_npy_header,
                                          read_rows, select_rows)
from shardkit.datasets.cached_shards import CachedShards
from shardkit.datasets.key_index import KeyIndex, build_key_index
from shardkit.errors import ConfigError, SampleNotFoundError
from shardkit.format.checksums import BLOCK_BYTES
from shardkit.read.checked import read_checked, read_sample
from shardkit.read.dataset import Dataset
from shardkit.read.decode import make_decoder, npy_view
from shardkit.read.manifest_copies import manifest_copies_dir
from shardkit.read.selection import select
from shardkit.read.rows import ShardInfo, ShardRows, block_checksums
from shardkit.read.samples import sample_dict
from shardkit.read.cache_refs import cache_namespace
from shardkit.storage.ranged import ByteCounter, RangedReader, Transport, choose_transport, prepare, read_fully
from shardkit.util.lru import LRU

try:  # torch is optional: without it ShardDataset is a plain sequence-like object
    from torch.utils.data import Dataset as _MapBase
except ImportError:  # pragma: no cover - exercised only without torch
    _MapBase = object  # type: ignore[misc,assignment]

__all__ = ["NpyHeader", "SampleNotFoundError", "ShardDataset"]


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
            repeated random access over a dataset that fits the cache), in ``part_size``
            ranged GETs, ``concurrency`` at a time, the part holding that sample first; the
            sample is served once its own bytes are in and checked, before the shard is whole.
        transport: ``"auto"`` (boto3 for S3, else fsspec), ``"boto3"`` or ``"fsspec"``.
        max_open_shards: cached shards kept mapped (and pinned against eviction) per process.
        version: the dataset version (None: the latest when it is made; see
            :mod:`shardkit.read.versions`).
        where: only the samples this SQL condition over the manifest's columns selects (as
            in :class:`~shardkit.StreamingDataset`): ``len`` is the selected count and index
            ``i`` is the selection's ``i``-th sample (in global order; ``__index__`` stays
            the global index).
        indices: only these global sample indices (sorted; each at most once); not with ``where``.

    Raises:
        ConfigError: a bad option (``concurrency`` or ``max_open_shards`` below 1,
            ``cache_shards`` without ``cache_dir``, a bad size, decoder or transport).
        DatasetNotFoundError: nothing is at ``url``.
    """

    def __init__(self, url: str, cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | str = "200GB",
                 decode: str | Callable[[dict[str, Any]], Any] | None = None,
                 storage_options: dict[str, Any] | None = None, part_size: int | str = "16MB",
                 concurrency: int = 8, *, cache_shards: bool = False, transport: Transport = "auto",
                 max_open_shards: int = 4, version: int | None = None, where: str | None = None,
                 indices: Any = None) -> None:
        # Every option checked before any I/O, each error naming it (a float, a str, nan).
        concurrency = int_arg("concurrency", concurrency, 1)
        max_open_shards = int_arg("max_open_shards", max_open_shards, 1)
        if cache_shards and cache_dir is None:
            raise ConfigError("cache_shards=True needs a cache_dir")
        self.cache_dir = checked_cache_dir(cache_dir)
        self.cache_limit = parse_size(cache_limit, "cache_limit")
        self.part_size = parse_size(part_size, "part_size")
        self.ds = Dataset(url, storage_options, version=version)
        self.url = self.ds.url
        # As StreamingDataset: manifests bounded in memory, copies local, with or without a cache.
        self.ds.manifest_cache = manifest_copies_dir(cache_namespace(self.ds))
        self.selection = select(self.ds, where=where, indices=indices)
        self.decode = decode
        self.concurrency = concurrency
        self.cache_shards = bool(cache_shards)
        self.max_open_shards = max_open_shards
        self.transport = choose_transport(self.ds.store, transport)
        prepare(self.ds.store, transport)  # here, before DataLoader workers fork: their first reads come sooner
        make_decoder(decode)  # validate in the main process
        self._first = self.ds.first_samples
        self._key_index: KeyIndex | None = None
        self._init_process()

    # ---- per-process state ----------------------------------------------------------------

    def _init_process(self) -> None:
        self._pid = os.getpid()
        self._decoder = make_decoder(self.decode)
        self._headers: LRU[tuple[int, int, str, bool], NpyHeader] = LRU(4096)
        self._cache = (None if self.cache_dir is None else
                       CachedShards(self.ds, self.cache_dir, self.cache_limit, cache_shards=self.cache_shards,
                                    max_open=self.max_open_shards))
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
        return self.ds.num_samples if self.selection is None else len(self.selection)

    def close(self) -> None:
        """Unpin the cached shards this process holds open (arrays already returned stay valid).

        A no-op in a process that did not make or unpickle this object (a forked worker
        holds the parent's pins only as copies).
        """
        if self._pid != os.getpid():
            return
        if self._cache is not None:
            self._cache.close()

    def __enter__(self) -> ShardDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Counters of this process's reads from storage (reads served by the cache count nothing).

        Returns:
            ``bytes_fetched``: bytes read from storage (the name
            :meth:`StreamingDataset.stats <shardkit.datasets.streaming.StreamingDataset.stats>`
            uses); ``requests``: GET requests made.
        """
        counted = self._counter.snapshot()
        return {"bytes_fetched": counted["bytes"], "requests": counted["requests"]}

    # ---- locating -------------------------------------------------------------------------

    def locate(self, index: int) -> tuple[int, int]:
        """Where global sample ``index`` lies.

        Args:
            index: global sample index (negative counts from the end); with ``where`` or
                ``indices``, the position in the selection.

        Returns:
            ``(shard, position in the shard)``.

        Raises:
            TypeError: ``index`` is not an integer.
            IndexError: ``index`` is out of range.
        """
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"sample index must be an integer, got {type(index).__name__}") from None
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {index} out of range for {n} samples in {self.url}")
        if self.selection is not None:
            i = self.selection.global_index(i)
        shard = int(np.searchsorted(self._first, i, side="right")) - 1
        return shard, i - int(self._first[shard])

    def _shard_rows(self, shard: int) -> ShardRows:
        self._local()
        return self.ds.cached_rows(shard)

    def index_of(self, key: str) -> int:
        """Global index of the sample with ``key``.

        The first call builds the key index from the manifest's ``key`` column only: one
        Arrow sort, and (key length + 12) bytes per sample for the process's lifetime (see
        :class:`~shardkit.datasets.key_index.KeyIndex`). Build it in the main process before
        DataLoader workers fork and they share it copy-on-write.

        Args:
            key: a sample key.

        Returns:
            The sample's global index (with ``where``/``indices``: its position in the selection).

        Raises:
            SampleNotFoundError: no sample has that key (or it is not selected).
            ManifestError: the manifest's key columns disagree with its shard table.
        """
        if self._key_index is None:
            self._key_index = build_key_index(self.ds)
        found = self._key_index.find(str(key))
        if found is None:
            raise SampleNotFoundError(f"no sample with key {key!r} in {self.url}")
        if self.selection is not None:
            at = int(np.searchsorted(self.selection.indices, found))
            if at >= len(self.selection) or int(self.selection.indices[at]) != found:
                raise SampleNotFoundError(f"sample {key!r} of {self.url} is not in {self.selection.label}")
            return at
        return found

    def by_key(self, key: str) -> Any:
        """The sample with ``key``, as ``ds[ds.index_of(key)]``.

        Args:
            key: a sample key.

        Returns:
            The decoded sample.

        Raises:
            SampleNotFoundError: no sample has that key.
        """
        return self[self.index_of(key)]

    # ---- the node cache -------------------------------------------------------------------

    def _shard_reader(self, ref: ShardRef) -> RangedReader:
        """The cache's reader of a whole shard (``cache_shards``): ranged GETs of ``part_size``,
        ``concurrency`` at a time, counted in stats; readers follow it as it lands."""
        return RangedReader(self.ds.store, ref.name, part_size=self.part_size, concurrency=self.concurrency,
                            transport=self.transport, counter=self._counter)  # type: ignore[arg-type]

    def _cached(self, info: ShardInfo, rows: ShardRows, pos: int) -> CachedShard | LandingShard | None:
        """The mapped shard if it is in the cache (or ``cache_shards`` fetches it: then maybe
        still landing, sample ``pos`` verified), else None."""
        self._local()
        return None if self._cache is None else self._cache.open(info, self._shard_reader, rows, pos)

    def _verify_cached(self, cached: CachedShard | LandingShard, info: ShardInfo, rows: ShardRows, pos: int,
                       index: int) -> None:
        if self._cache is not None:
            self._cache.check(cached, info, rows, pos, index)

    # ---- whole samples --------------------------------------------------------------------

    def __getitem__(self, index: int) -> Any:
        """Sample ``index``, its checksum checked.

        Args:
            index: global sample index (negative counts from the end).

        Returns:
            The sample dict (``__key__``, ``__index__``, ``__shard__`` and its fields) through
            ``decode``: from the cache, fields are zero-copy views of the mapped shard.

        Raises:
            IndexError: ``index`` is out of range.
            IntegrityError: the sample fails its checksum (twice, from storage).
            DecodeError: ``decode`` failed on the sample.
            StorageError: reading from storage failed.
        """
        shard, pos = self.locate(index)
        i = int(self._first[shard]) + pos
        info = self.ds.shard_list[shard]
        rows = self._shard_rows(shard)
        cached = self._cached(info, rows, pos)
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

    def _fetcher(self, info: ShardInfo, rows: ShardRows, pos: int, index: int, checked: bool) -> Fetch:
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

    def npy_header(self, index: int, field: str = "npy") -> NpyHeader:
        """The header of a ``.npy`` member (cached per process).

        Read and checked as :meth:`read_array` reads a few rows: the block holding the header,
        or the whole of a sample of 1 MiB or less (4 KB, unchecked, for a big sample of a
        dataset packed before block checksums).

        Args:
            index: global sample index (negative counts from the end).
            field: the member (``"npy"``, ``"depth.npy"``, ...).

        Returns:
            Its dtype, shape, order and the shard offset of its first array byte.

        Raises:
            IndexError: ``index`` is out of range.
            ConfigError: the sample has no such field.
            IntegrityError: the member is not a valid ``.npy`` array, or its bytes fail their checksum.
            StorageError: reading from storage failed.
        """
        shard, pos = self.locate(index)
        i = int(self._first[shard]) + pos
        info, rows = self.ds.shard_list[shard], self._shard_rows(shard)
        offset, size = member_span(rows, pos, field, i)
        checked = self._checked(info, rows, pos, whole=False)
        return self._header(info, rows, pos, i, field, offset, size, self._fetcher(info, rows, pos, i, checked),
                            checked)

    def _header(self, info: ShardInfo, rows: ShardRows, pos: int, index: int, field: str, offset: int, size: int,
                fetch: Fetch, checked: bool) -> NpyHeader:
        key = (info.shard, pos, field, checked)  # a checked read never uses a header parsed from unchecked bytes
        hit = self._headers.get(key)
        if hit is not None:
            return hit
        header = read_npy_header(fetch, offset, size, member_name(rows, pos, index, field))
        self._headers.put(key, header)
        return header

    def read_array(self, index: int, field: str = "npy", rows: int | slice | None = None) -> np.ndarray:
        """Rows of a ``.npy`` member of sample ``index``, reading only their bytes.

        A C-ordered member moves the rows covering the slice rounded out to whole 1 MiB
        blocks (at most 2 MiB more than the rows, plus the header's block on the first read of
        a sample); rows of a stepped slice 1 MiB or more apart are read one by one instead. A
        sample of 1 MiB or less, and a Fortran-ordered member (its rows are not contiguous),
        move whole, then are sliced.

        Args:
            index: global sample index (negative counts from the end).
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

        Raises:
            IndexError: ``index``, a row or a slice bound is out of range, or the array is 0-d.
            ConfigError: the sample has no such field, a zero slice step, or ``rows`` of
                another type.
            IntegrityError: the member is not a valid ``.npy`` array, or its bytes fail their
                checksum.
            StorageError: reading from storage failed.
        """
        shard, pos = self.locate(index)
        i = int(self._first[shard]) + pos
        info, srows = self.ds.shard_list[shard], self._shard_rows(shard)
        offset, size = member_span(srows, pos, field, i)
        cached = self._cached(info, srows, pos)
        if cached is not None:
            self._verify_cached(cached, info, srows, pos, i)
            arr = npy_view(cached.buffer()[offset:offset + size], native=False)  # the stored dtype, as from storage
            return arr if rows is None else arr[select_rows(arr.shape, rows, member_name(srows, pos, i, field))]
        checked = self._checked(info, srows, pos, whole=rows is None)
        fetch = self._fetcher(info, srows, pos, i, checked)
        hdr = self._header(info, srows, pos, i, field, offset, size, fetch, checked)
        if rows is None:
            return array_at(fetch(hdr.data_offset, offset + size), hdr.data_offset, hdr, hdr.shape)
        return read_rows(fetch, hdr, offset + size, select_rows(hdr.shape, rows, member_name(srows, pos, i, field)))

