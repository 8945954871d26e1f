"""One WebDataset tar shard being written: samples framed as tar members, hashed, and sent to
storage in parts.

Bytes gather in parts of ``PART_BYTES`` that one background thread
(:class:`~shardkit.packing.upload.Uploader`) writes in order, as a single PUT for a shard of
one part and a multipart upload otherwise (boto3 on S3), or a temp file renamed at the end on
local disk. No shard is held whole in memory unless it fits in one part. While bytes go out
they are hashed: xxh3-64 per sample (the range ``[offset, offset+size)``), per 1 MiB block of
samples larger than that (:mod:`shardkit.format.checksums`), and xxh3-128 per shard file.
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

# The part size: the writer holds one part filling plus the uploader's INFLIGHT_BYTES queued or
# uploading. Larger parts send big shards in fewer requests but raise the pack's peak memory
# past the bound tests/pack/test_pack_ray.py checks while packing 300 MB samples (see
# benchmarks/RESULTS.md).
PART_BYTES = 16 * 2**20


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
        self.pos = 0
        self.file_hash = xxhash.xxh3_128()
        self.sample_hash = SampleHasher()
        self.rows = SampleRows()
        self.closed = False

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

    def _put(self, data: bytes | memoryview) -> None:
        end = self._fill + len(data)
        if end > len(self._buf):
            if end <= _GROW_LIMIT:
                # A small shard's buffer grows with it (a tiny shard never costs a whole part).
                self._buf += data
                self._fill = end
                return
            # Past that, switch once to a full-size part (the spare one if the uploader has it):
            # growing by reallocation would copy tens of MB and briefly hold two copies.
            full = self._uploader.take_buffer(self.part_bytes)
            full[:self._fill] = memoryview(self._buf)[:self._fill]
            self._buf = full
        self._buf[self._fill:end] = data  # same length: a plain copy, no resize
        self._fill = end

    def _send(self, final: bool) -> None:
        part = self._buf
        if len(part) > self._fill:
            # A recycled buffer the shard's last part did not fill. Should anything still hold
            # a view of it (nothing we know of does), a resize raises: copy instead.
            try:
                del part[self._fill:]
            except BufferError:
                part = bytearray(memoryview(part)[:self._fill])
        target = self._target
        self._uploader.submit(lambda: target.send(part, final), part)
        # The next buffer is taken once it outgrows _GROW_LIMIT, after submit returned (the
        # previous part is written by then and is the spare): two full buffers at most.
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
        if not sample.fields:
            raise SourceError(f"sample {sample.key!r} has no fields")
        clash = case_clash(sample.fields)
        if clash is not None:  # before any byte of it is written: with on_error="skip" it is left out
            raise SourceError(f"sample {sample.key!r}: {case_clash_reason(*clash)}")
        self.sample_hash.reset()
        start = self.pos
        spans: list[dict[str, Any]] = []
        for name in sorted(sample.fields):
            check_field_name(name)
            value = sample.fields[name]
            size = value.size if isinstance(value, StreamedField) else len(value)
            self._write(member_header(f"{sample.key}.{name}", size))
            spans.append({"name": name, "offset": self.pos, "size": size})
            if isinstance(value, StreamedField):
                _copy_stream(self, value, f"{sample.key}.{name}")
            else:
                self._write(value)
            self._write(_ZEROS[:padding(size)])
        rows = self.rows
        rows.key.append(sample.key)
        rows.shard.append(self.index)
        rows.offset.append(start)
        rows.size.append(self.pos - start)
        rows.fields.append(spans)
        rows.checksum.append(self.sample_hash.intdigest())
        rows.blocks.append(self.sample_hash.blocks())
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


def _copy_stream(shard: TarShard, value: StreamedField, member: str) -> None:
    written = 0
    for chunk in value.chunks():
        written += len(chunk)
        if written > value.size:
            break
        shard._write(chunk)
    if written != value.size:
        raise SourceError(f"member {member}: source produced {written} bytes, declared {value.size}")
