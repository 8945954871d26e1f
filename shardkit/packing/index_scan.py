"""Scanning one existing WebDataset tar in one sequential read: its sample rows, their checksums
and the file's digest, for ``shardkit index``.

Every byte of the file passes once through the whole-file xxh3-128 and, when it lies inside a
sample, through that sample's hashes (:class:`~shardkit.format.checksums.SampleHasher`). The
members are grouped into samples as the webdataset library groups them; the members it skips
are counted, and lie inside a sample's byte range when they sit between its members.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator

import xxhash

from shardkit.errors import SourceError, UnsafeTarError
from shardkit.format.checksums import SampleHasher
from shardkit.format.rows import SampleRows, ShardRecord
from shardkit.format.tarscan import TarMember, scan_tar, wds_split
from shardkit.packing.key_ledger import KeyLedger
from shardkit.packing.sample import case_clash_reason
from shardkit.storage.etag import EtagCheck, confirmed_read
from shardkit.storage.retry import retrying
from shardkit.storage.store import Store

__all__ = ["MAX_GAP", "index_tar"]


_READ_CHUNK = 8 * 2**20
# Bytes between two members that may still belong to one sample (headers of directories,
# pax records): more than this is not a WebDataset tar.
MAX_GAP = 16 * 2**20
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class _OnePass:
    """A forward-only, seekable view of one sequential read of a tar.

    ``scan_tar`` seeks over member data; here a forward seek reads the skipped bytes (in
    chunks) instead, so every byte of the file passes once through the file hash and, when it
    lies inside a sample, through that sample's hash. Members are reported with
    :meth:`member` as they are found, which decides which sample the bytes belong to.
    """

    def __init__(self, store: Store, rel: str, size: int, chunk: int = _READ_CHUNK,
                 check: EtagCheck | None = None) -> None:
        self.store = store
        self.check = check
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
        def attempt() -> bytes:
            try:
                if self._raw is None:
                    self._raw = self._open()
                return self._raw.read(n)
            except Exception:
                self.close()  # the next try reopens at the byte reached (_open seeks there)
                raise

        return retrying(attempt, self.rel, self.store.where)

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
            if self.check is not None:
                self.check.update(data)
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


@dataclass
class _Scan:
    """What one read of a tar found, kept apart until the read is trusted."""

    rows: SampleRows
    keys: list[str]
    fields: set[str]
    record: ShardRecord
    skipped: int
    first_skipped: str | None


def _scan_once(store: Store, rel: str, size: int, shard: int, check: EtagCheck | None) -> _Scan:
    """One sequential read of the tar: its rows, keys, fields and record."""
    url = store.url_of(rel)
    reader = _OnePass(store, rel, size, check=check)
    rows = SampleRows()
    keys: list[str] = []
    fields: set[str] = set()
    groups: list[list[tuple[TarMember, str]]] = []
    try:
        scan = scan_tar(reader, name=url, file_size=size)  # type: ignore[arg-type]  # duck-typed file
        for key, members in _samples(scan, reader):
            spans = _fields(url, key, members)
            keys.append(key)
            fields.update(s["name"] for s in spans)
            groups.append(members)
            rows.key.append(key)
            rows.shard.append(shard)
            rows.offset.append(members[0][0].offset_header)
            rows.size.append(members[-1][0].end - members[0][0].offset_header)
            rows.fields.append(spans)
            rows.meta.append({})
        checksum = reader.finish()
    finally:
        reader.close()
    rows.checksum.extend(reader.digests[m[0][0].offset_header] for m in groups)
    rows.blocks.extend(reader.blocks[m[0][0].offset_header] for m in groups)
    return _Scan(rows, keys, fields, ShardRecord(shard, rel, len(groups), size, checksum),
                 reader.skipped, reader.first_skipped)


def _trusted_scan(store: Store, rel: str, shard: int) -> _Scan:
    """A read of the tar whose bytes are the object's (:func:`~shardkit.storage.etag.confirmed_read`):
    checked against the ETag on an object store; a malformed tar is refused only when a second
    read finds it the same. A local file is read once."""
    info = store.info(rel)
    size = int(info["size"])
    if not store.is_object_store:
        return _scan_once(store, rel, size, shard, None)
    etag = info.get("ETag") or info.get("etag")

    def read() -> tuple[_Scan, bool | None, str]:
        check = EtagCheck(etag, size)
        got = _scan_once(store, rel, size, shard, check)
        return got, check.verdict(), got.record.checksum

    return confirmed_read(read, store.url_of(rel), malformed=(UnsafeTarError, SourceError))


def index_tar(store: Store, rel: str, shard: int, rows: SampleRows, keys: KeyLedger, fields: set[str],
              progress: Callable[[int, int], None] | None = None,
              skipped: list[tuple[str, int, str]] | None = None) -> ShardRecord:
    """Scan one tar in one sequential read and append its sample rows to ``rows``.

    On an object store the read is checked against the object's ETag and read again when
    it disagrees (see :func:`_trusted_scan`), so a byte corrupted in transit is never
    recorded as the tar's checksum; nothing is added to ``rows``, ``keys`` or ``fields``
    until a read is trusted.

    Args:
        store: the dataset root.
        rel: the tar's path under the root.
        shard: the shard number it becomes.
        rows: gets one row per sample, in tar order.
        keys: gets each sample's key (repeats are checked once every tar is read).
        fields: gets the field names the samples have.
        progress: called with (samples, bytes) once the tar is read.
        skipped: gets ``(rel, count, first name)`` if the tar holds members webdataset skips.

    Returns:
        The tar's shard record (its size and xxh3-128).

    Raises:
        UnsafeTarError: a hostile or malformed member, or too many bytes between members.
        SourceError: a bad field name, a field repeated in a sample, or a tar that changed
            while being read.
        IntegrityError: reads kept giving different bytes (a store or network that corrupts).
        StorageError: reading failed past its retries.
    """
    got = _trusted_scan(store, rel, shard)
    for key in got.keys:
        keys.add(key, shard)
    fields.update(got.fields)
    rows.extend(got.rows)
    if progress is not None:
        progress(len(got.keys), got.record.bytes)
    if got.first_skipped is not None and skipped is not None:
        skipped.append((rel, got.skipped, got.first_skipped))
    return got.record
