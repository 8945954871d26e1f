"""A committed dataset opened for manifest access and sequential reading: :class:`Dataset` and
:func:`open_dataset`.

:func:`open_dataset` reads ``dataset.json`` and the small ``shards.parquet`` only; per-sample
rows are fetched one shard's row group at a time when that shard is opened, so a 20 M-sample
dataset opens in about the time of two small GETs on every rank.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from shardkit.errors import IntegrityError, ManifestError, ShardkitError, first_line
from shardkit.format.manifest import SAMPLE_COLUMNS, parquet_file
from shardkit.read.decode import Decoder, make_decoder
from shardkit.read.manifest import check_same_pack, count_faults, manifest_faults, read_info, shard_infos
from shardkit.read.manifest_copies import copy_path, keep_copy, open_copy
from shardkit.read.rows import ShardInfo, ShardRows, check_spans
from shardkit.read.samples import sample_dicts
from shardkit.read.versions import marker_name, open_version
from shardkit.read.verify import (
    check_shard_bytes,
    missing_samples_files,
    raise_failures,
    verify_samples,
    verify_shards,
)
from shardkit.storage.store import Store
from shardkit.util.lru import LRU

__all__ = ["FRAGMENT_BYTES", "ROWS_BYTES", "Dataset", "open_dataset"]

log = logging.getLogger(__name__)

_MEMOS: dict[str, dict[str, dict[Any, Any]]] = {}  # Dataset.identity -> name -> memo
_MEMO_DATASETS = 8
# Sample-manifest fragments one Dataset with local copies keeps open, by their bytes (least
# recently used go first). A 20M-sample manifest is ~1 GB of fragments, and a reader whose
# shards are spread over all of them would otherwise end up holding all of them, in every
# DataLoader worker.
FRAGMENT_BYTES = 64 * 2**20
# Parsed manifest rows a process keeps per dataset (least recently parsed go first): by bytes,
# not shards, as a shard of small samples has hundreds of thousands of rows.
ROWS_BYTES = 256 * 2**20

_Fragment = tuple[pq.ParquetFile, int]  # an open samples fragment and its size in bytes


def _fragments_lru() -> LRU[str, _Fragment]:
    # The limit is set before each put (FRAGMENT_BYTES, with copies); the fragment in use stays.
    return LRU(sys.maxsize, cost=lambda held: held[1], keep_newest=True)


class Dataset:
    """A committed dataset: its ``dataset.json``, shard table, and per-shard sample rows.

    Args:
        url: the dataset root (a local path or an fsspec URL such as ``s3://bucket/ds``).
        storage_options: fsspec options for the store (ignored when ``store`` is given).
        store: an open store on the dataset root, instead of ``url`` and its options.
        strict: refuse a dataset whose dataset.json disagrees with shards.parquet; ``False``
            opens one anyway, for :meth:`verify`, which reports it (readers refuse one).
        version: the version to open (:mod:`shardkit.read.versions`); None opens the latest
            committed now. The version is fixed from then on: a later append is not seen.

    Raises:
        ConfigError: a bad ``version``.
        DatasetNotFoundError: there is no committed dataset at ``url``, or no such version.
        ManifestError: the manifest is unreadable, or (``strict``) its parts disagree.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, store: Store | None = None,
                 strict: bool = True, version: int | None = None) -> None:
        self.store = store or Store(url, storage_options)
        self.url = self.store.url
        self.info, self.shards = open_version(self.store, version)
        faults = count_faults(self.info, self.shards)
        if strict and faults:
            raise ManifestError(f"{self.url}: {faults[0]} (shardkit verify lists every fault)")
        self._shard_list: list[ShardInfo] | None = None
        self._first_samples: np.ndarray | None = None
        self._fragments = _fragments_lru()
        self._samples: pa.Table | None = None
        self._identity: str | None = None
        self._pack_identity: str | None = None
        # A local directory keeping copies of the sample-manifest fragments (set by readers
        # with a node cache): a warm epoch's fresh workers then read no manifest from storage.
        self.manifest_cache: str | None = None

    def __repr__(self) -> str:
        return f"Dataset({self.url!r}, samples={self.num_samples}, shards={self.num_shards})"

    def __getstate__(self) -> dict[str, Any]:
        # The pack identity goes along once known: a version's costs a GET to learn.
        return {"store": self.store, "info": self.info, "shards": self.shards, "manifest_cache": self.manifest_cache,
                "pack_identity": self._pack_identity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.store = state["store"]
        self.url = self.store.url
        self.info = state["info"]
        self.shards = state["shards"]
        self._shard_list = None
        self._first_samples = None
        self._fragments = _fragments_lru()
        self._samples = None
        self._identity = None
        self._pack_identity = state.get("pack_identity")
        self.manifest_cache = state.get("manifest_cache")

    @property
    def version(self) -> int:
        """The version opened (1 for a dataset never appended to)."""
        return int(self.info.get("dataset_version") or 1)

    @property
    def num_samples(self) -> int:
        """Samples in the dataset (dataset.json's count)."""
        return int(self.info["num_samples"])  # equal to the shards' sum in a dataset opened strictly

    @property
    def num_shards(self) -> int:
        """Shards in the dataset (dataset.json's count)."""
        return int(self.info["num_shards"])

    @property
    def fields(self) -> list[str]:
        """The field names samples have (dataset.json's list)."""
        return list(self.info.get("fields", []))

    @property
    def labels(self) -> dict[str, int]:
        """Class name -> label, as the pack recorded them (empty when it recorded none)."""
        return dict(self.info.get("labels") or {})

    @property
    def shard_list(self) -> list[ShardInfo]:
        """The rows of shards.parquet, in shard order (made on first use)."""
        if self._shard_list is None:
            self._shard_list = shard_infos(self.shards)
        return self._shard_list

    @property
    def fingerprint(self) -> str:
        """What the data is, wherever it lives: a hash of the shards' checksums, in order. A
        copy in another bucket has the same; a re-pack has another, unless it wrote the same
        bytes (packing is deterministic) and so the same samples in the same shards."""
        return xxhash.xxh3_64_hexdigest("\0".join(self.shards.column("checksum").to_pylist()).encode())

    @property
    def identity(self) -> str:
        """What names this committed dataset: a re-pack at the same URL is another dataset,
        also within the same second and at the same size (its shards' checksums differ)."""
        if self._identity is None:
            info = self.info
            self._identity = _identity_of(self.url, info, self.fingerprint)
        return self._identity

    @property
    def pack_identity(self) -> str:
        """What names the pack this version belongs to: version 1's :attr:`identity`, the same
        for every version appended to it (an append keeps every shard and fragment of the
        versions before, under the same names, and never writes those names again), and
        another for a re-pack at the URL (which removes the versions and writes a new
        version 1). Node-local files of the pack's shards and fragments are kept under it.

        A dataset appended to reads version 1's marker once (one small GET); if that fails,
        or the marker's shards are not this version's first, it is :attr:`identity` (files
        are then kept for this version alone, never shared with another pack).
        """
        if self._pack_identity is None:
            self._pack_identity = self._first_version_identity()
        return self._pack_identity

    def _first_version_identity(self) -> str:
        if self.version == 1:
            return self.identity
        rel = marker_name(1)
        try:
            first = read_info(self.store, rel)
            count = int(first["num_shards"])
        except (ShardkitError, KeyError, TypeError, ValueError) as exc:
            log.debug("%s: no readable %s (%s); node-local files are kept for version %d alone",
                      self.url, rel, exc, self.version)
            return self.identity
        if not 0 <= count <= self.shards.num_rows or first.get("dataset_version") != 1:
            log.debug("%s: %s does not describe this version's first shards; node-local files are kept for "
                      "version %d alone", self.url, rel, self.version)
            return self.identity
        checksums = self.shards.column("checksum").to_pylist()[:count]
        # As version 1's own identity: readers of version 1, before or after the append, share it.
        return _identity_of(self.url, first, xxhash.xxh3_64_hexdigest("\0".join(checksums).encode()))

    def memo(self, name: str) -> dict[Any, Any]:
        """A dict kept in this process for this committed dataset, shared by every object
        opened on it (readers keep parsed per-shard manifest rows here): a loader made anew
        each epoch, or an evaluation pass, does not parse them again. Forked DataLoader
        workers inherit it. The memos of the few datasets used last stay.

        Args:
            name: which memo of the dataset.

        Returns:
            The memo, empty when first asked for.
        """
        memos = _MEMOS.pop(self.identity, None) or {}
        _MEMOS[self.identity] = memos  # most recently used last
        while len(_MEMOS) > _MEMO_DATASETS:
            _MEMOS.pop(next(iter(_MEMOS)))
        return memos.setdefault(name, {})

    @property
    def first_samples(self) -> np.ndarray:
        """Global index of each shard's first sample (read from the manifest once)."""
        if self._first_samples is None:
            self._first_samples = self.shards.column("first_sample").to_numpy()
        return self._first_samples

    def shard_sizes(self) -> np.ndarray:
        """Samples per shard, in shard order.

        Returns:
            An integer array with one entry per shard (shards.parquet's ``num_samples``).
        """
        return self.shards.column("num_samples").to_numpy()

    def _fragment(self, name: str) -> pq.ParquetFile:
        """The fragment ``name``, open. With local copies (``manifest_cache``) at most
        :data:`FRAGMENT_BYTES` of them stay open (the most recently used one always does), as
        reopening one is a local read; a copy is opened as a memory map, its pages the page
        cache's, shared by every process on the node, and only the row groups read are
        touched. Without copies every fragment read stays in memory: reopening would fetch it
        from storage again, once per shard in a shuffled epoch."""
        held = self._fragments.get(name)
        if held is None and self.manifest_cache:
            held = open_copy(self._local_path(name), name)
            if held is not None and not self._copy_of_pack(held[0], name):
                held = None
        if held is None:
            data = self.store.read_checked(name)
            held = (parquet_file(data, self.store.url_of(name)), len(data))
            check_same_pack(held[0], self.store.url_of(name), self.url, self.shard_list)
            if self.manifest_cache:
                keep_copy(self.manifest_cache, name, data)
        self._fragments.limit = FRAGMENT_BYTES if self.manifest_cache else sys.maxsize
        self._fragments.put(name, held)  # most recently used last; re-weighs the rest
        return held[0]

    def _copy_of_pack(self, fragment: pq.ParquetFile, name: str) -> bool:
        """Whether a node copy of fragment ``name`` describes this dataset's shards (the copies
        directory is the pack's, shared by its versions: it must never serve a fragment of
        another pack). One that does not is read from storage again and replaces the copy."""
        try:
            check_same_pack(fragment, self._local_path(name), self.url, self.shard_list)
        except ManifestError:
            log.warning("node copy %s of %s is of another pack of %s; reading it from storage",
                        self._local_path(name), name, self.url)
            return False
        return True

    def _local_path(self, name: str) -> str:
        """Where the node-local copy of fragment ``name`` lives (``manifest_cache`` is set)."""
        if self.manifest_cache is None:
            raise AssertionError("shardkit: a manifest copy asked for without a manifest_cache")
        return copy_path(self.manifest_cache, name)

    def shard_samples(self, shard: int, columns: Sequence[str] | None = None) -> pa.Table:
        """The manifest rows of one shard (reads only that shard's row group).

        Args:
            shard: the shard number.
            columns: only these columns (the optional ones only where the manifest has them);
                None reads every column.

        Returns:
            The shard's sample rows, in shard order.

        Raises:
            IndexError: there is no such shard.
            ManifestError: its rows are unreadable, or another number than shards.parquet lists.
        """
        if not 0 <= shard < self.num_shards:
            raise IndexError(f"shard {shard} out of range 0..{self.num_shards - 1} in {self.url}")
        info = self.shard_list[shard]
        if info.num_samples == 0:
            return self.samples.schema.empty_table() if self._samples is not None else self._empty_rows()
        if info.samples_file and info.samples_row_group >= 0:
            try:
                table = self._fragment(info.samples_file).read_row_group(info.samples_row_group, columns=columns,
                                                                         use_threads=False)
            except ShardkitError:
                raise  # storage faults say so themselves
            except (pa.ArrowException, OSError) as exc:
                raise ManifestError(f"{self.store.url_of(info.samples_file)}: rows of shard {shard} are unreadable "
                                    f"({first_line(exc)})") from exc
        else:  # a manifest without the row-group columns: filter the fragments
            table = self.samples.filter(pc.equal(self.samples.column("shard"), shard))
            if columns is not None:  # the optional ones (block_checksums) only where the manifest has them
                table = table.select([c for c in columns if c in table.column_names])
        if table.num_rows != info.num_samples:
            raise ManifestError(f"{self.url}: shard {shard} lists {info.num_samples} samples, its manifest rows are "
                                f"{table.num_rows} (re-packed since this reader opened it?)")
        return table

    def shard_rows(self, shard: int) -> ShardRows:
        """The manifest rows of one shard as a reader slices them (see :meth:`shard_samples`),
        every sample's span checked to lie in the shard and every field's in its sample
        (:func:`~shardkit.read.rows.check_spans`): every reader gets its rows here.

        Args:
            shard: the shard number.

        Returns:
            The shard's rows, only the columns of :attr:`ShardRows.COLUMNS`, parsed anew.

        Raises:
            IndexError: there is no such shard.
            ManifestError: its rows are unreadable, of another count than shards.parquet lists,
                or place a sample or field outside its bytes.
            StorageError: its samples fragment could not be read.
        """
        # Only the columns a reader slices with: decoding a row group is much cheaper without
        # the source paths and metadata, and every fresh DataLoader worker does it per shard.
        rows = ShardRows(self.shard_samples(shard, columns=ShardRows.COLUMNS))
        check_spans(self.shard_list[shard], rows)
        return rows

    def cached_rows(self, shard: int) -> ShardRows:
        """:meth:`shard_rows`, kept in this process's memo of the dataset (shared by its
        readers) within :data:`ROWS_BYTES`; the rows just parsed always stay.

        Args:
            shard: the shard number.

        Returns:
            The shard's rows: the kept object when there is one, so what readers build on it
            (keys, layout) is built once.

        Raises:
            IndexError: there is no such shard.
            ManifestError: as :meth:`shard_rows`.
            StorageError: its samples fragment could not be read.
        """
        memo: dict[int, ShardRows] = self.memo("rows")
        rows = memo.get(shard)
        if rows is None:
            # Not a util.lru.LRU: a rows object grows as readers build its keys and layout,
            # so the bound sums the sizes anew each time.
            rows = memo[shard] = self.shard_rows(shard)
            total = sum(r.nbytes for r in memo.values())
            while total > ROWS_BYTES and len(memo) > 1:
                total -= memo.pop(next(iter(memo))).nbytes
        return rows

    def _empty_rows(self) -> pa.Table:
        for info in self.shard_list:
            if info.num_samples:
                return self.shard_samples(info.shard).slice(0, 0)
        return SAMPLE_COLUMNS.empty_table()

    @property
    def samples(self) -> pa.Table:
        """All sample rows (loaded on first access: only for tools, not for every rank)."""
        if self._samples is None:
            files = sorted({s.samples_file for s in self.shard_list if s.samples_file}) or self.store.glob("manifest/samples-*.parquet")
            tables = [parquet_file(self.store.read_checked(f), self.store.url_of(f)).read(use_threads=False) for f in files]
            self._samples = pa.concat_tables(tables, promote_options="default") if tables else self._empty_rows()
        return self._samples

    def iter_samples(self, decode: str | Decoder | None = None,
                     shards: list[int] | None = None) -> Iterator[dict[str, Any]]:
        """Every sample in global order (or of ``shards``), verified, as WebDataset-style dicts.

        Args:
            decode: as :func:`shardkit.read.decode.make_decoder` takes it (None: raw bytes).
            shards: only these shards, in this order.

        Yields:
            Each sample, decoded.

        Raises:
            IntegrityError: a shard's bytes disagree with the manifest (naming the sample, if
                one is at fault).
            ConfigError: ``decode`` is not a decoder.
            DecodeError: a sample does not decode.
        """
        decoder = make_decoder(decode)
        for shard in (range(self.num_shards) if shards is None else shards):
            info = self.shard_list[shard]
            if info.num_samples == 0:
                continue
            rows = self.shard_rows(shard)
            data = self.store.read_bytes(info.path)
            view = memoryview(data)
            try:
                check_shard_bytes(data, info)  # every byte: the samples need no check of their own
            except IntegrityError:
                verify_samples(view, 0, rows, np.arange(len(rows)), info.path)  # name the bad sample, if one is
                raise
            for sample in sample_dicts(view, 0, rows, np.arange(len(rows)), info.first_sample, info.path):
                yield decoder(sample)

    def verify(self, deep: bool = False, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Check every shard is present with the manifest's size, and its manifest rows place
        every sample inside the shard and every field inside its sample (``deep``: and checksums).

        Checks every shard even after one fails, so one run lists all that need repair.

        Args:
            deep: read every byte: each sample's checksums and the shard's, and the fields.
            progress: called with each shard's size once it is checked.

        Returns:
            ``{"ok": True, "shards_checked", "deep", "num_samples"}``.

        Raises:
            IntegrityError: naming each shard (and sample, when deep) at fault (the first
                :data:`shardkit.read.verify.VERIFY_NAMED` of them; ``.failures`` lists them
                all, one line each).
        """
        manifest = manifest_faults(self.info, self.shards) + missing_samples_files(self.store, self.shard_list)
        failed, fields, checked = verify_shards(self.store, self.shard_list, self.shard_rows, deep, progress)
        if deep and not failed and fields != set(self.fields):
            manifest.append(f"dataset.json lists fields {sorted(self.fields)}, the sample rows have {sorted(fields)}")
        raise_failures(manifest, failed, checked)
        return {"ok": True, "shards_checked": checked, "deep": deep, "num_samples": self.num_samples}


def _identity_of(url: str, info: dict[str, Any], fingerprint: str) -> str:
    return f"{url}\0{info.get('created')}\0{info.get('total_bytes')}\0{fingerprint}"


def open_dataset(url: str, storage_options: dict[str, Any] | None = None, *, strict: bool = True,
                 version: int | None = None) -> Dataset:
    """Open a committed dataset (its latest version, or ``version``) for manifest access.

    Args:
        url: the dataset root (a local path or an fsspec URL such as ``s3://bucket/ds``).
        storage_options: fsspec options for the store.
        strict: refuse a dataset whose dataset.json's counts disagree with shards.parquet;
            ``False`` opens it anyway, to run :meth:`Dataset.verify`, which lists that among
            its faults.
        version: the version to open; None opens the latest (see :class:`Dataset`).

    Returns:
        The dataset.

    Raises:
        ConfigError: a bad ``version``.
        DatasetNotFoundError: there is no committed dataset at ``url``, or no such version.
        ManifestError: the manifest is unreadable, or (``strict``) its parts disagree.
    """
    return Dataset(url, storage_options, strict=strict, version=version)
