"""``shardkit index``: a manifest for existing WebDataset tars, built in place.

The tars are not rewritten: each becomes one shard whose ``path`` is the tar's path relative
to the dataset root. Each tar is read exactly once, front to back, in bounded chunks: the
bytes pass through :func:`shardkit.format.tarscan.scan_tar` (which refuses hostile members) and,
on the way, into the whole-file xxh3-128 and the per-sample xxh3-64 of
``[offset of the sample's first header, end of its last member)`` (and of its 1 MiB blocks,
:mod:`shardkit.format.checksums`). Memory is one read chunk
plus the small headers between members, whatever the member sizes.

Samples are what the webdataset library reads from the same tars: its keys (``./0001`` for
``./0001.jpg``), its lowercased fields, and the members it skips (``README``, ``__meta__``,
``._0001.jpg``) left out, counted and listed per tar in dataset.json's ``skipped``. A skipped
member between two members of one sample lies inside that sample's byte range, in no field.

Nothing is committed unless every tar scans cleanly and no sample key repeats:
``dataset.json`` is written last, create-only, exactly as :func:`shardkit.pack` does. Keys
are checked with a :class:`~shardkit.packing.key_ledger.KeyLedger` (12 bytes a key) once every tar is
read, so the driver's memory stays small at tens of millions of samples.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from typing import Any, BinaryIO, Iterator

import xxhash

from shardkit.format.checksums import SampleHasher
from shardkit.errors import DatasetExistsError, SourceError, UnsafeTarError
from shardkit.packing.key_ledger import KeyLedger
from shardkit.format.fragments import write_fragment
from shardkit.format.manifest import (DATASET_JSON, SHARDS_PARQUET, commit, dataset_info, fragment_name, parquet_file, shards_table,
                       write_shards_table)
from shardkit.packing.progress import Progress
from shardkit.packing.sample import case_clash_reason
from shardkit.storage.retry import attempts_for, is_transient, pause_before_retry, translate
from shardkit.storage.store import Store
from shardkit.format.tarscan import TarMember, scan_tar, wds_split
from shardkit.format.rows import SampleRows, ShardRecord

log = logging.getLogger(__name__)

READ_CHUNK = 8 * 2**20
# Sample rows held before a fragment is written (bounds driver memory on huge datasets).
FRAGMENT_ROWS = 250_000
# Bytes between two members that may still belong to one sample (headers of directories,
# pax records): more than this is not a WebDataset tar.
MAX_GAP = 16 * 2**20
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_PACK_CLAIM = "_pack/plan.json"


def list_tars(store: Store) -> list[str]:
    """Every ``*.tar`` under the root, in subfolders too (as ``shardkit pack`` of a folder of
    tars reads them), relative to the root, sorted; not what an unfinished pack left in
    ``_pack/``."""
    found = set(store.glob("*.tar")) | set(store.glob("**/*.tar"))
    return sorted(t for t in found if not t.startswith("_pack/"))


class _OnePass:
    """A forward-only, seekable view of one sequential read of a tar.

    ``scan_tar`` seeks over member data; here a forward seek reads the skipped bytes (in
    chunks) instead, so every byte of the file passes once through the file hash and, when it
    lies inside a sample, through that sample's hash. Members are reported with
    :meth:`member` as they are found, which decides which sample the bytes belong to.
    """

    def __init__(self, store: Store, rel: str, size: int, chunk: int = READ_CHUNK) -> None:
        self.store = store
        self.rel = rel
        self.size = size
        self.chunk = chunk
        self.file_hash = xxhash.xxh3_128()
        self.pos = 0  # bytes consumed (seen by the scanner or skipped)
        self._buf = b""  # loaded bytes; self._buf[self._off:] starts at self.pos
        self._off = 0
        self._loaded = 0  # bytes read from storage so far
        self._raw: BinaryIO | None = None
        # Routing: bytes before _route_until go to _sink; later ones wait in _gap until the
        # next member tells whether they belong to its sample. _sink is the open sample's hash
        # or, over a member webdataset skips, a copy of it that also takes that member: kept if
        # the sample's next member follows (webdataset's sample spans it), else dropped.
        self._sample: Any = None
        self._sink: Any = None
        self._sample_key: str | None = None
        self._sample_start = 0
        self._route_until = 0
        self._gap: list[bytes] = []
        self._gap_start = 0
        self._gap_len = 0
        self._discard = False  # after the scan: bytes only feed the file hash
        self.skipped = 0  # members webdataset skips
        self.first_skipped: str | None = None
        self.digests: dict[int, int] = {}  # first header offset -> xxh3-64 of the sample
        self.blocks: dict[int, list[int] | None] = {}  # first header offset -> its block checksums

    # -- reading ---------------------------------------------------------------------------

    def _open(self) -> BinaryIO:
        fs = self.store.fs
        raw = fs.open(self.store.path(self.rel), "rb", block_size=self.chunk, cache_type="none")
        if self._loaded:
            raw.seek(self._loaded)
        return raw

    def _read_raw(self, n: int) -> bytes:
        failures = 0
        while True:
            try:
                if self._raw is None:
                    self._raw = self._open()
                return self._raw.read(n)
            except Exception as exc:  # noqa: BLE001 - classified below
                self.close()
                failures += 1
                budget = attempts_for(exc)
                if failures < budget and is_transient(exc):
                    pause_before_retry(exc, self.rel, self.store.where, failures, budget)
                    continue
                raise translate(exc, self.rel, self.store.where) from exc

    def _ensure(self, n: int) -> None:
        """Make at least ``n`` unconsumed bytes available (fewer only at end of file)."""
        have = len(self._buf) - self._off
        if have >= n:
            return
        parts = [self._buf[self._off:]]
        while have < n and self._loaded < self.size:
            data = self._read_raw(min(max(self.chunk, n - have), self.size - self._loaded))
            if not data:
                raise SourceError(f"{self.store.url_of(self.rel)}: tar shrank while reading "
                                  f"({self._loaded} of {self.size} bytes)")
            self.file_hash.update(data)
            self._loaded += len(data)
            parts.append(data)
            have += len(data)
        self._buf = b"".join(parts) if len(parts) > 1 else parts[0]
        self._off = 0

    def _consume(self, n: int) -> bytes:
        """Consume up to ``n`` bytes (routing them) and return them."""
        self._ensure(n)
        end = min(self._off + n, len(self._buf))
        data = self._buf[self._off:end]
        self._off = end
        self._route(data)
        return data

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self.size - self.pos
        return self._consume(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0 or offset < self.pos:
            raise UnsafeTarError(f"{self.store.url_of(self.rel)}: tar structure points backwards (offset {offset})")
        while self.pos < offset:
            if not self._consume(min(self.chunk, offset - self.pos)):
                break  # past the end: the scanner reports the truncation
        return self.pos

    def tell(self) -> int:
        return self.pos

    def finish(self) -> str:
        """Read the rest of the file (end-of-archive blocks, trailing bytes); the file digest."""
        # A tar cut right after its last member (no end-of-archive blocks) ends the scan
        # before that member's data is read: it belongs to the open sample, so read it first.
        self.seek(max(self.pos, self._route_until))
        self._close_sample()
        self._discard = True
        while self.pos < self.size:
            if not self._consume(min(self.chunk, self.size - self.pos)):
                break
        self._gap.clear()
        if self._loaded != self.size:
            raise SourceError(f"{self.store.url_of(self.rel)}: read {self._loaded} bytes, expected {self.size}")
        self.close()
        return self.file_hash.hexdigest()

    def close(self) -> None:
        if self._raw is not None:
            try:
                self._raw.close()
            finally:
                self._raw = None

    # -- routing ---------------------------------------------------------------------------

    def _route(self, data: bytes) -> None:
        start = self.pos
        self.pos += len(data)
        if not data or self._discard:
            return
        inside = max(0, min(len(data), self._route_until - start))
        if inside and self._sink is not None:
            self._sink.update(memoryview(data)[:inside])
        if inside < len(data):
            if not self._gap:
                self._gap_start = start + inside
            self._gap.append(data[inside:])
            self._gap_len += len(data) - inside
            if self._gap_len > MAX_GAP:
                raise UnsafeTarError(f"{self.store.url_of(self.rel)}: {self._gap_len} bytes of non-member data "
                                     f"after offset {self._gap_start}; refused")

    def member(self, m: TarMember, key: str) -> None:
        """Attach the member just scanned (its header consumed, data not yet) to a sample."""
        gap = b"".join(self._gap)
        self._gap.clear()
        self._gap_len = 0
        if self._sample is not None and key == self._sample_key:
            # Headers and skipped members between members of one sample are part of it.
            self._sample = self._sink
            self._sample.update(gap)
        else:
            self._close_sample()
            self._sample = SampleHasher()
            self._sample_key = key
            self._sample_start = m.offset_header
            self._sample.update(gap[m.offset_header - self._gap_start:])
        self._sink = self._sample
        self._route_until = m.end

    def skip(self, m: TarMember) -> None:
        """Pass over a member webdataset skips (its header consumed, data not yet). Its bytes
        go to a copy of the open sample's hash, not to the gap, so a big one costs no memory."""
        self.skipped += 1
        if self.first_skipped is None:
            self.first_skipped = m.name
        gap = b"".join(self._gap)
        self._gap.clear()
        self._gap_len = 0
        if self._sample is not None:
            if self._sink is self._sample:
                self._sink = self._sample.copy()
            self._sink.update(gap)
        self._route_until = m.end

    def _close_sample(self) -> None:
        if self._sample is not None:
            self.digests[self._sample_start] = self._sample.intdigest()
            self.blocks[self._sample_start] = self._sample.blocks()
            self._sample = None
            self._sink = None
            self._sample_key = None


def _samples(members: Iterator[TarMember], reader: _OnePass) -> Iterator[tuple[str, list[tuple[TarMember, str]]]]:
    """Group consecutive members by key as the webdataset library does (``group_by_keys`` over
    ``base_plus_ext``, the name kept as it is: ``./0001.jpg`` is key ``./0001``), passing over
    the members it skips, and telling the reader which sample each member's bytes belong to;
    yields ``(key, [(member, field), ...])``."""
    key: str | None = None
    group: list[tuple[TarMember, str]] = []
    for m in members:
        split = wds_split(m.name)
        if split is None:
            reader.skip(m)
            continue
        reader.member(m, split[0])
        if group and split[0] != key:
            yield key, group  # type: ignore[misc]  # key is set once group is not empty
            group = []
        key = split[0]
        group.append((m, split[1]))
    if group:
        yield key, group  # type: ignore[misc]


def _fields(url: str, key: str, members: list[tuple[TarMember, str]]) -> list[dict[str, Any]]:
    """The field spans of one sample, names lowercased as webdataset does. Any field name it
    reads is kept (``jpg~``, ``depth+16.png``, ``a b``); refused: an empty one, a backslash,
    a control character or bytes that are not UTF-8 in the name (unreadable in the manifest, or
    a path on extraction), and two fields that lowercase alike (webdataset refuses the sample)."""
    spans: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for m, field in members:
        problem = ("has an empty field name" if not field else
                   "has a backslash in its field name" if "\\" in field else
                   "has a control character in its name" if _CONTROL.search(m.name) else
                   "has a name that is not UTF-8" if not _is_utf8(m.name) else None)
        if problem:
            raise SourceError(f"{url}: member {m.name!r} {problem}; refused")
        name = field.lower()
        if name in seen:
            if seen[name] == field:
                raise SourceError(f"{url}: member {m.name!r} repeats field {field!r} in its sample")
            raise SourceError(f"{url}: sample {key!r}: {case_clash_reason(seen[name], field)}")
        seen[name] = field
        spans.append({"name": name, "offset": m.offset_data, "size": m.size})
    return spans


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")  # names are decoded with surrogateescape: bad bytes fail here
    except UnicodeEncodeError:
        return False
    return True


def index_tar(store: Store, rel: str, shard: int, rows: SampleRows, keys: KeyLedger,
              fields: set[str], progress: Any = None, skipped: list[tuple[str, int, str]] | None = None) -> ShardRecord:
    """Scan one tar (one sequential read) and append its sample rows to ``rows``, and to
    ``skipped`` ``(rel, count, first name)`` if it holds members webdataset skips."""
    url = store.url_of(rel)
    size = store.size(rel)
    reader = _OnePass(store, rel, size)
    groups: list[tuple[str, list[tuple[TarMember, str]]]] = []
    first = len(rows)
    try:
        scan = scan_tar(reader, name=url, file_size=size)  # type: ignore[arg-type]  # duck-typed file
        for key, members in _samples(scan, reader):
            spans = _fields(url, key, members)
            keys.add(key, shard)
            fields.update(s["name"] for s in spans)
            groups.append((key, members))
            rows.key.append(key)
            rows.shard.append(shard)
            rows.offset.append(members[0][0].offset_header)
            rows.size.append(members[-1][0].end - members[0][0].offset_header)
            rows.fields.append(spans)
            rows.meta.append({})
            if progress is not None:
                progress(1, 0)
        checksum = reader.finish()
    finally:
        reader.close()
    rows.checksum.extend(reader.digests[m[0][0].offset_header] for _, m in groups)
    rows.blocks.extend(reader.blocks[m[0][0].offset_header] for _, m in groups)
    if len(rows.checksum) != len(rows.key) or len(rows) - first != len(groups):
        raise AssertionError("index bookkeeping out of step")  # pragma: no cover
    if progress is not None:
        progress(0, size)
    if reader.first_skipped is not None and skipped is not None:
        skipped.append((rel, reader.skipped, reader.first_skipped))
    return ShardRecord(shard, rel, len(groups), size, checksum)


def index_tars(dest: str, *, overwrite: bool = False, progress: bool = True,
               storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build a shardkit manifest for the WebDataset tars at ``dest`` without rewriting them.

    Args:
        dest: a dataset root (any fsspec URL) holding ``*.tar`` directly or under ``shards/``.
        overwrite: replace an existing dataset.json and everything under ``manifest/`` (the
            tars are kept). Without it, files under ``manifest/`` and no dataset.json are
            refused rather than deleted.
        progress: show a progress bar on stderr.
        storage_options: fsspec options (credentials, endpoint).

    Returns:
        The committed dataset.json content.

    Raises:
        DatasetExistsError: ``dest`` already holds a dataset or files under ``manifest/`` (and
            not ``overwrite``), or an unfinished pack is writing there.
        UnsafeTarError: a tar holds a hostile member (names it); nothing is committed.
        SourceError: no tars, or a sample key repeats (names both tars).
    """
    started = time.monotonic()
    store = Store(dest, storage_options)
    if store.exists(DATASET_JSON):
        if not overwrite:
            raise DatasetExistsError(f"{store.url} already holds a dataset; pass --overwrite (overwrite=True) to re-index it")
        store.remove(DATASET_JSON)  # uncommit first, so nobody reads a half-replaced manifest
    elif store.exists(_PACK_CLAIM):
        raise DatasetExistsError(f"{store.url} holds an unfinished pack ({_PACK_CLAIM}); finish or remove it first")
    if not overwrite:
        _refuse_foreign_manifest(store)
    tars = list_tars(store)
    if not tars:
        raise SourceError(f"no .tar files at {store.url} (looked at **/*.tar)")
    if overwrite:
        store.remove("manifest", recursive=True)  # --overwrite replaces manifest/ as a whole
    total = sum(store.size(t) for t in tars)
    records: list[ShardRecord] = []
    files: list[str] = []
    groups: list[int] = []
    fields: set[str] = set()
    keys = KeyLedger()
    rows = SampleRows()
    pending: list[ShardRecord] = []
    skipped: list[tuple[str, int, str]] = []  # tars with members webdataset skips
    try:
        with Progress(None, total, len(tars), "index", enabled=progress) as bar:
            for rel in tars:
                rec = index_tar(store, rel, len(records) + len(pending), rows, keys, fields, bar.advance,
                                skipped)
                bar.task_done()
                if rec.num_samples == 0:
                    log.warning("%s holds no samples; left out of the manifest", store.url_of(rel))
                    continue
                pending.append(rec)
                if len(rows) >= FRAGMENT_ROWS:
                    _flush(store, len(set(files)), rows, pending, records, files, groups)
                    rows = SampleRows()
            if pending:
                _flush(store, len(set(files)), rows, pending, records, files, groups)
        if not records:
            raise SourceError(f"the tars at {store.url} hold no samples")
        _refuse_repeated_keys(store, keys, records, files, groups)
        table = shards_table(records, files, groups)
        write_shards_table(store, table)
        passed = sum(n for _, n, _ in skipped)
        if skipped:
            log.warning("skipped %d members in %d tars that the webdataset library skips too (no dot in the name, "
                        "__*__ metadata, hidden ._ files), first %r in %s; listed in dataset.json", passed,
                        len(skipped), skipped[0][2], store.url_of(skipped[0][0]))
        # One entry a tar, not a member: a collection can hold a ._ file beside every sample.
        listed = [{"ref": rel, "key": "", "reason": f"{n} members the webdataset library skips too, first {first!r}"}
                  for rel, n, first in skipped]
        info = dataset_info(table, sorted(fields), {"type": "index", "path": store.url, "tars": len(tars)}, None,
                            listed, {"index": {"tars": len(records), "skipped_members": passed}})
        commit(store, info)
    except BaseException:
        # Only what this run wrote (manifest/ was empty or cleared when it started): its
        # fragments, the one it may have been writing, and shards.parquet.
        ours = [fragment_name(i) for i in range(len(set(files)) + 1)] + [SHARDS_PARQUET]
        try:
            for rel in ours:
                store.remove(rel)
            if not store.is_object_store and not store.glob("manifest/*"):
                store.remove("manifest", recursive=True)  # the empty folder this run made
        except Exception:  # noqa: BLE001 - best-effort cleanup while the real error propagates
            log.debug("cleanup of %s/manifest failed", store.url, exc_info=True)
        raise
    log.info("indexed %d samples in %d tars (%d bytes) in %.1fs", info["num_samples"], info["num_shards"],
             info["total_bytes"], time.monotonic() - started)
    return info


def _refuse_foreign_manifest(store: Store) -> None:
    """DatasetExistsError when manifest/ holds anything while no dataset is committed: index
    writes its manifest there and must not delete or mix with files it did not write (a
    user's notes, or what an index killed midway left: --overwrite replaces those)."""
    found = store.listing("manifest")
    if found:
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        raise DatasetExistsError(f"{store.url} holds no dataset but its manifest/ is not empty "
                                 f"({store.url_of(found[0])}{more}); move those files away, or pass --overwrite "
                                 "(overwrite=True) to replace manifest/ (the tars are kept)")


def _flush(store: Store, number: int, rows: SampleRows, pending: list[ShardRecord], records: list[ShardRecord],
           files: list[str], groups: list[int]) -> None:
    name = fragment_name(number)
    row_groups = write_fragment(store, name, rows, pending)
    records.extend(pending)
    files.extend(name for _ in pending)
    groups.extend(row_groups)
    pending.clear()


def _refuse_repeated_keys(store: Store, keys: KeyLedger, records: list[ShardRecord], files: list[str],
                          groups: list[int]) -> None:
    """Raise SourceError naming a key that two samples share (and their tars), reading back
    only the keys of shards the ledger suspects (equal 64-bit hashes)."""
    fragments: dict[str, Any] = {}

    def keys_of(shard: int) -> list[str]:
        name = files[shard]
        if name not in fragments:
            fragments[name] = parquet_file(store.read_bytes(name), store.url_of(name))
        return fragments[name].read_row_group(groups[shard], columns=["key"], use_threads=False).column(0).to_pylist()

    for a, b in keys.suspects():
        url, rel_a, rel_b = store.url_of(records[a].path), records[a].path, records[b].path
        if a == b:
            repeated = sorted(k for k, n in Counter(keys_of(a)).items() if n > 1)
            if repeated:
                raise SourceError(f"{url}: sample key {repeated[0]!r} appears twice "
                                  "(members of a sample must be adjacent)")
        else:
            both = sorted(set(keys_of(a)) & set(keys_of(b)))
            if both:
                raise SourceError(f"duplicate sample key {both[0]!r}: in {rel_a} and {rel_b}")
