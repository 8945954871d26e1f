"""ShardWriter: samples -> deterministic WebDataset tar shards + manifest rows.

Shards stream straight to their destination (a multipart upload on S3) through a bounded
buffer; no shard is ever held whole in memory. While bytes go out they are hashed: xxh3-64
per sample (the range ``[offset, offset+size)``) and xxh3-128 per shard file.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import xxhash

from .errors import SourceError
from .sample import PackSample, StreamedField, check_field_name
from .storage import Store
from .tarfmt import END_OF_ARCHIVE, member_header, padding

log = logging.getLogger(__name__)

_COPY_CHUNK = 8 * 2**20


def shard_name(index: int) -> str:
    """Deterministic shard path relative to the dataset root."""
    return f"shards/shard-{index:06d}.tar"


@dataclass
class ShardRecord:
    """One row of manifest/shards.parquet (``first_sample`` is filled in at commit)."""

    shard: int
    path: str
    num_samples: int
    bytes: int
    checksum: str


@dataclass
class SampleRows:
    """Column lists of manifest/samples rows (columnar to keep millions of rows small)."""

    key: list[str] = field(default_factory=list)
    shard: list[int] = field(default_factory=list)
    offset: list[int] = field(default_factory=list)
    size: list[int] = field(default_factory=list)
    fields: list[list[dict[str, Any]]] = field(default_factory=list)
    checksum: list[int] = field(default_factory=list)
    meta: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.key)

    def extend(self, other: "SampleRows") -> None:
        for name in ("key", "shard", "offset", "size", "fields", "checksum", "meta"):
            getattr(self, name).extend(getattr(other, name))


class _BackgroundWriter:
    """Hands full buffers to a thread that writes them, so reading and hashing the next
    samples overlaps the upload of the previous ones (uploads release the GIL).

    Memory is bounded: one buffer being filled plus ``depth`` waiting, each ~``chunk`` bytes.
    An error in the thread is raised by the next ``write`` or by ``close``.
    """

    def __init__(self, out: Any, chunk: int = 8 * 2**20, depth: int = 1) -> None:
        self.out = out
        self.chunk = chunk
        self._buf = bytearray()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shardkit-upload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self.out.write(item)
                except BaseException as exc:  # noqa: BLE001 - handed to the writing thread
                    self._error = exc

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def write(self, data: bytes | memoryview) -> None:
        self._check()
        if len(data) >= self.chunk:
            # A big piece (a streamed member's chunk) goes as it is: no copy into the buffer.
            self._flush()
            self._queue.put(data if isinstance(data, bytes) else bytes(data))
            return
        self._buf += data
        if len(self._buf) >= self.chunk:
            self._flush()

    def _flush(self) -> None:
        if self._buf:
            self._queue.put(bytes(self._buf))
            self._buf.clear()

    def _drain(self) -> None:
        self._flush()
        self._queue.put(None)
        self._thread.join()

    def close(self) -> None:
        """Write what is left and wait for the thread; does not close ``out``."""
        self._drain()
        self._check()

    def stop(self) -> None:
        """Stop without caring about errors (the shard is being aborted)."""
        self._buf.clear()
        self._error = self._error or RuntimeError("aborted")
        self._drain()


class _HashingSink:
    """Writes to a file while hashing the whole stream and the current sample's span."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.pos = 0
        self.file_hash = xxhash.xxh3_128()
        self.sample_hash = xxhash.xxh3_64()

    def write(self, data: bytes | memoryview) -> None:
        self.out.write(data)
        self.file_hash.update(data)
        self.sample_hash.update(data)
        self.pos += len(data)


class TarShard:
    """One shard file being written; call :meth:`add` per sample, then :meth:`close`."""

    def __init__(self, store: Store, index: int, path: str | None = None) -> None:
        self.store = store
        self.index = index
        self.path = path or shard_name(index)
        self._local = not store.is_object_store
        # A temp name per writer: two packs racing on one local directory never interleave.
        unique = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self._write_path = f"{self.path}.tmp.{unique}" if self._local else self.path
        self._file = store.open_write(self._write_path)
        self._upload = _BackgroundWriter(self._file)
        self._sink = _HashingSink(self._upload)
        self.rows = SampleRows()
        self.closed = False

    @property
    def bytes_written(self) -> int:
        return self._sink.pos

    def add(self, sample: PackSample) -> None:
        if not sample.fields:
            raise SourceError(f"sample {sample.key!r} has no fields")
        sink = self._sink
        sink.sample_hash.reset()
        start = sink.pos
        spans: list[dict[str, Any]] = []
        for name in sorted(sample.fields):
            check_field_name(name)
            value = sample.fields[name]
            size = value.size if isinstance(value, StreamedField) else len(value)
            sink.write(member_header(f"{sample.key}.{name}", size))
            spans.append({"name": name, "offset": sink.pos, "size": size})
            if isinstance(value, StreamedField):
                _copy_stream(sink, value, f"{sample.key}.{name}")
            else:
                sink.write(value)
            sink.write(b"\0" * padding(size))
        rows = self.rows
        rows.key.append(sample.key)
        rows.shard.append(self.index)
        rows.offset.append(start)
        rows.size.append(sink.pos - start)
        rows.fields.append(spans)
        rows.checksum.append(sink.sample_hash.intdigest())
        rows.meta.append(sample.meta)

    def close(self) -> ShardRecord:
        """Finish the archive and make it visible under its final name."""
        self._sink.write(END_OF_ARCHIVE)
        try:
            self._upload.close()
        except BaseException:
            self.abort()
            raise
        self._file.close()
        if self._local:
            fs = self.store.fs
            fs.mv(self.store.path(self._write_path), self.store.path(self.path))
        self.closed = True
        return ShardRecord(self.index, self.path, len(self.rows), self._sink.pos, self._sink.file_hash.hexdigest())

    def abort(self) -> None:
        """Drop a shard that failed midway (an unfinished S3 multipart upload is discarded)."""
        if self.closed:
            return
        self.closed = True
        self._upload.stop()
        try:
            if self._local:
                # Local files write straight to the .tmp name (autocommit): fsspec's
                # LocalFileOpener.discard() raises in that mode, so close and delete instead.
                self._file.close()
                self.store.remove(self._write_path)
            elif hasattr(self._file, "discard"):
                self._file.discard()
                # s3fs's discard drops the buffer but leaves the file "open": its __del__ would
                # then flush a None buffer (AttributeError at garbage collection). Mark it closed.
                setattr(self._file, "closed", True)  # noqa: B010 - read-only in the IO stubs
            else:
                self._file.close()
        except Exception:  # noqa: BLE001 - best effort cleanup while another error propagates
            log.debug("cleanup of %s failed", self._write_path, exc_info=True)


def _copy_stream(sink: _HashingSink, value: StreamedField, member: str) -> None:
    written = 0
    for chunk in value.chunks():
        written += len(chunk)
        if written > value.size:
            break
        sink.write(chunk)
    if written != value.size:
        raise SourceError(f"member {member}: source produced {written} bytes, declared {value.size}")


def tar_size(sample: PackSample) -> int:
    """Bytes :meth:`TarShard.add` writes for ``sample``: headers, bodies and padding."""
    total = 0
    for name, value in sample.fields.items():
        size = value.size if isinstance(value, StreamedField) else len(value)
        total += len(member_header(f"{sample.key}.{name}", size)) + size + padding(size)
    return total


class ShardWriter:
    """Streams samples into shards that roll over at ``shard_bytes`` / ``shard_samples``.

    Example::

        with ShardWriter(Store("s3://bucket/ds"), shard_bytes=512 * 10**6) as w:
            for s in samples:
                w.write(s)
        w.shards, w.rows   # manifest rows for shards.parquet and samples-*.parquet
    """

    def __init__(self, store: Store, *, shard_bytes: int, shard_samples: int | None = None,
                 first_shard: int = 0, name_for: Callable[[int], str] = shard_name) -> None:
        self.store = store
        self.shard_bytes = shard_bytes
        self.shard_samples = shard_samples
        self.name_for = name_for
        self._next = first_shard
        self._current: TarShard | None = None
        self.shards: list[ShardRecord] = []
        self.rows = SampleRows()

    def write(self, sample: PackSample) -> None:
        cur = self._current
        if cur is not None and len(cur.rows) > 0:
            # Count what the sample really adds (headers, padding) and the end-of-archive
            # blocks, so a shard of two or more samples never grows past shard_bytes.
            full_bytes = cur.bytes_written + tar_size(sample) + len(END_OF_ARCHIVE) > self.shard_bytes
            full_count = self.shard_samples is not None and len(cur.rows) >= self.shard_samples
            if full_bytes or full_count:
                self._finish()
        if self._current is None:
            self._current = TarShard(self.store, self._next, self.name_for(self._next))
            self._next += 1
        self._current.add(sample)

    def _finish(self) -> None:
        if self._current is not None:
            self.shards.append(self._current.close())
            self.rows.extend(self._current.rows)
            self._current = None

    def close(self) -> None:
        self._finish()

    def abort(self) -> None:
        if self._current is not None:
            self._current.abort()
            self._current = None

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
