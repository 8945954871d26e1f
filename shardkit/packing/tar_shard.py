"""One WebDataset tar shard being written: samples framed as tar members, hashed, and sent to
storage in parts.

Bytes gather in parts of ``PART_BYTES`` that background threads
(:class:`~shardkit.packing.upload.Uploader`) write, as a single PUT for a shard of one part and
a multipart upload otherwise (boto3 on S3; two parts upload side by side), or a temp file
renamed at the end on local disk. No shard is held whole in memory unless it fits in one part.
While bytes go out they are hashed: xxh3-64 per sample (the range ``[offset, offset+size)``),
per 1 MiB block of samples larger than that (:mod:`shardkit.format.checksums`), and xxh3-128
per shard file. A small sample is copied into the part whole and hashed there in one call per
hash; the rest go piece by piece.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable

import xxhash

from shardkit.errors import SourceError
from shardkit.format.checksums import SampleHasher
from shardkit.format.rows import PIECE_ROWS, SampleRows, ShardRecord, shard_name
from shardkit.format.tar import END_OF_ARCHIVE, member_header, padding
from shardkit.packing.sample import PackSample, StreamedField, case_clash, case_clash_reason, check_field_name
from shardkit.packing.upload import FileTarget, S3Target, Uploader
from shardkit.storage.store import Store

__all__ = ["PART_BYTES", "TarShard"]

# The part size: the writer holds one part filling plus the uploader's INFLIGHT_BYTES (two
# parts) queued or uploading. Two parts of 8 MiB uploading side by side packed as fast as two
# of 16 MiB and faster than one of 16 MiB; 16 MiB ones would raise the pack's peak memory past
# the bound tests/pack/test_pack_ray.py checks while packing 300 MB samples (see
# benchmarks/RESULTS.md "Packing").
PART_BYTES = 8 * 2**20
# S3 takes 10,000 parts an upload: a shard's parts double in size every this many, so even a
# shard of terabytes fits (8 GiB in parts of 8 MiB, the next 16 GiB in parts of 16 MiB, ...).
PARTS_PER_SIZE = 1000


class TarShard:
    """One shard file being written; call :meth:`add` per sample, then :meth:`close`.

    Bytes gather in a part buffer of ``part_bytes`` that is handed whole (no copy) to the
    ``uploader``. With a shared uploader, :meth:`close` returns as soon as the last part is
    queued: the shard exists once ``uploader.flush()`` returns. Without one, the shard gets its
    own and :meth:`close` waits.

    Its manifest rows gather in :attr:`rows`; with ``on_rows``, every :data:`PIECE_ROWS` of them
    go to ``on_rows(rows)`` instead and :attr:`rows` starts over (it holds the rest at close).

    Args:
        store: the destination.
        index: the shard's number.
        path: its path under the destination (default :func:`~shardkit.format.rows.shard_name`).
        uploader: an upload thread shared with other shards (default: the shard's own).
        part_bytes: the part size (default PART_BYTES).
        on_rows: takes the manifest rows in pieces as they are made.
    """

    def __init__(self, store: Store, index: int, path: str | None = None, uploader: Uploader | None = None,
                 part_bytes: int | None = None, on_rows: Callable[[SampleRows], None] | None = None) -> None:
        self.store = store
        self.index = index
        self.on_rows = on_rows
        self._handed = 0  # rows given to on_rows
        self.path = path or shard_name(index)
        self.part_bytes = PART_BYTES if part_bytes is None else part_bytes
        self._own_uploader = uploader is None
        self._uploader = uploader or Uploader()
        self._target: S3Target | FileTarget
        if store.is_object_store and store.boto3_writes():
            self._target = S3Target(store, self.path)
            # The process's client is made (once) while the first part fills, not after.
            self._uploader.submit(self._target.connect, parallel=True)
        elif store.is_object_store:
            self._target = FileTarget(store, self.path, self.path)
        else:
            # A temp name per writer: two packs racing on one local directory never interleave.
            unique = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
            self._target = FileTarget(store, f"{self.path}.tmp.{unique}", self.path)
        # The part being filled: bytes [0, _fill) are this shard's. A buffer is either growing
        # (len == _fill) or a recycled full-size one being overwritten (len == part_bytes).
        self._buf = bytearray()
        self._fill = 0
        self._parts = 0  # parts queued
        self.pos = 0
        self.file_hash = xxhash.xxh3_128()
        self.sample_hash = SampleHasher()
        self.rows = SampleRows()
        self.closed = False
        self._layouts: set[tuple[str, ...]] = set()  # field names whose checks passed

    @property
    def bytes_written(self) -> int:
        """The shard's bytes so far."""
        return self.pos

    @property
    def num_samples(self) -> int:
        """The samples added so far."""
        return self._handed + len(self.rows)

    def _write(self, data: bytes | memoryview) -> None:
        if isinstance(data, memoryview):
            data = data.cast("B")  # len() in bytes, whatever the item size
        # Hashing here, while the bytes are still in cache, rather than over the part later.
        self.file_hash.update(data)
        self.sample_hash.update(data)
        self.pos += len(data)
        room = self.part_bytes - self._fill
        if len(data) <= room:
            self._put(data)
            return
        # Parts are exactly part_bytes long except each shard's last one, which is never empty:
        # a full part goes out only once more bytes follow it.
        view = memoryview(data)
        while len(view) > room:
            self._put(view[:room])
            self._send(final=False)
            view, room = view[room:], self.part_bytes
        self._put(view)

    def _reserve(self, end: int) -> bytearray:
        """The part buffer, made to hold ``end`` bytes (at most ``part_bytes``)."""
        buf = self._buf
        if end > len(buf):
            if end <= _GROW_LIMIT:
                # A small shard's buffer grows with it (a tiny shard never costs a whole part).
                buf += bytes(end - len(buf))
            else:
                # Past that, switch once to a full-size part (a spare one if the uploader has
                # it): growing by reallocation would copy tens of MB and briefly hold two copies.
                full = self._uploader.take_buffer(self.part_bytes)
                full[:self._fill] = memoryview(buf)[:self._fill]
                self._buf = buf = full
        return buf

    def _put(self, data: bytes | memoryview) -> None:
        end = self._fill + len(data)
        self._reserve(end)[self._fill:end] = data  # same length: a plain copy, no resize
        self._fill = end

    def _put_sample(self, pieces: list[bytes], total: int) -> int:
        """Copy a small sample's pieces into the part (they fit) and hash them there, each hash
        in one call; returns the sample's xxh3-64 (what :class:`SampleHasher` gives for a
        sample of one block or less)."""
        fill = self._fill
        end = fill + total
        buf = self._reserve(end)
        at = fill
        for piece in pieces:
            nxt = at + len(piece)
            buf[at:nxt] = piece
            at = nxt
        view = memoryview(buf)[fill:end]
        try:
            self.file_hash.update(view)
            checksum = xxhash.xxh3_64_intdigest(view)
        finally:
            view.release()  # a live view would pin the buffer's size
        self._fill = end
        self.pos += total
        return checksum

    def _send(self, final: bool) -> None:
        part = self._buf
        if len(part) > self._fill:
            # A recycled buffer the shard's last part did not fill. Should anything still hold
            # a view of it (nothing we know of does), a resize raises: copy instead.
            try:
                del part[self._fill:]
            except BufferError:
                part = bytearray(memoryview(part)[:self._fill])
        self._target.queue(self._uploader, part, final)
        self._parts += 1
        if self._parts % PARTS_PER_SIZE == 0:
            self.part_bytes *= 2
        # The next buffer is taken once it outgrows _GROW_LIMIT, after queue() returned (a part
        # written by then is a spare): three full buffers at most (see upload.INFLIGHT_BYTES).
        self._buf = bytearray()
        self._fill = 0

    def add(self, sample: PackSample) -> None:
        """Write one sample's members (fields in sorted order) and note its manifest row.

        Args:
            sample: the sample.

        Raises:
            SourceError: the sample has no fields, fields differing only in case, a bad field
                name (all before any of its bytes is written), or a streamed field of the wrong
                size.
            StorageError: an earlier part's upload failed.
        """
        fields = sample.fields
        if not fields:
            raise SourceError(f"sample {sample.key!r} has no fields")
        names = sorted(fields)
        layout = tuple(names)
        if layout not in self._layouts:  # most samples repeat the fields of one before them
            clash = case_clash(names)
            if clash is not None:  # before any byte of it is written: with on_error="skip" it is left out
                raise SourceError(f"sample {sample.key!r}: {case_clash_reason(*clash)}")
            for name in names:
                check_field_name(name)
            if len(self._layouts) < _MAX_LAYOUTS:
                self._layouts.add(layout)
        # The members' pieces (header, body, padding) and where each body lands in the shard.
        start = self.pos
        at = start
        pieces: list[Any] = []
        spans: list[dict[str, Any]] = []
        whole = True  # every body in memory as bytes: the sample may be copied and hashed at once
        for name in names:
            value = fields[name]
            if isinstance(value, StreamedField):
                size, whole = value.size, False
            else:
                size = len(value)
                whole = whole and type(value) in _WHOLE_TYPES
            header = member_header(f"{sample.key}.{name}", size)
            at += len(header)
            spans.append({"name": name, "offset": at, "size": size})
            pad = padding(size)
            at += size + pad
            pieces.append(header)
            # A streamed body goes with its member name, for the error if it is not its size.
            pieces.append(_Stream(value, f"{sample.key}.{name}") if isinstance(value, StreamedField) else value)
            if pad:
                pieces.append(_ZEROS[:pad])
        total = at - start
        if whole and total <= self.sample_hash.block_bytes and self._fill + total <= self.part_bytes:
            checksum, blocks = self._put_sample(pieces, total), None
        else:  # streamed, big, or across a part boundary: piece by piece, hashed as they go
            self.sample_hash.reset()
            for piece in pieces:
                if isinstance(piece, _Stream):
                    _copy_stream(self, piece.field, piece.member)
                else:
                    self._write(piece)
            checksum, blocks = self.sample_hash.intdigest(), self.sample_hash.blocks()
        rows = self.rows
        rows.key.append(sample.key)
        rows.shard.append(self.index)
        rows.offset.append(start)
        rows.size.append(self.pos - start)
        rows.fields.append(spans)
        rows.checksum.append(checksum)
        rows.blocks.append(blocks)
        rows.meta.append(sample.meta)
        if self.on_rows is not None and len(rows) >= PIECE_ROWS:
            self.rows = SampleRows()
            self._handed += len(rows)
            self.on_rows(rows)

    def close(self) -> ShardRecord:
        """Finish the archive and queue its last part; the shard appears under its final name
        when that part is written (before ``close`` returns if the shard owns its uploader).

        Returns:
            The shard's record (size and xxh3-128).

        Raises:
            StorageError: an upload failed (the shard is aborted).
        """
        try:
            self._write(END_OF_ARCHIVE)
            self._send(final=True)
        except BaseException:  # an earlier upload failed: drop this shard too
            self.abort()
            raise
        self.closed = True
        if self._own_uploader:
            self._uploader.close()  # a failing part already discarded its upload
        return ShardRecord(self.index, self.path, self.num_samples, self.pos, self.file_hash.hexdigest())

    def abort(self) -> None:
        """Drop a shard that failed midway (an unfinished S3 multipart upload is discarded)."""
        if self.closed:
            return
        self.closed = True
        self._buf = bytearray()
        self._fill = 0
        target = self._target
        # Parts of this shard still queued are skipped; the cleanup job runs after them.
        target.aborted = True
        self._uploader.submit(target.discard, always=True)
        if self._own_uploader:
            self._uploader.close(check=False)


_ZEROS = bytes(512)
_GROW_LIMIT = 2**20
# Field-name sets a shard remembers as checked (samples rarely have more than a few).
_MAX_LAYOUTS = 64
# Bodies copied into a part as they are (a memoryview of wider items, or any other buffer,
# goes through TarShard._write, which casts it to bytes).
_WHOLE_TYPES = (bytes, bytearray)


class _Stream:
    """A streamed body among a sample's pieces, with its member name (for a size error)."""

    __slots__ = ("field", "member")

    def __init__(self, field: StreamedField, member: str) -> None:
        self.field, self.member = field, member


def _copy_stream(shard: TarShard, value: StreamedField, member: str) -> None:
    written = 0
    for chunk in value.chunks():
        written += len(chunk)
        if written > value.size:
            break
        shard._write(chunk)
    if written != value.size:
        raise SourceError(f"member {member}: source produced {written} bytes, declared {value.size}")
