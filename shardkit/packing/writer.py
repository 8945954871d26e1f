"""ShardWriter: samples -> deterministic WebDataset tar shards + manifest rows.

Shards stream to their destination through a bounded buffer: bytes gather in parts of
``PART_BYTES`` that one background thread (:class:`Uploader`) writes in order, as a single PUT
for a shard of one part and a multipart upload otherwise (boto3 on S3), or a temp file renamed
at the end on local disk. No shard is held whole in memory unless it fits in one part. While
bytes go out they are hashed: xxh3-64 per sample (the range ``[offset, offset+size)``), per
1 MiB block of samples larger than that (:mod:`shardkit.format.checksums`), and xxh3-128 per shard
file.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import deque
from typing import Any, Callable

import xxhash

from shardkit.format.checksums import SampleHasher
from shardkit.errors import SourceError
from shardkit.packing.sample import PackSample, StreamedField, case_clash, case_clash_reason, check_field_name
from shardkit.storage.store import Store
from shardkit.format.rows import PIECE_ROWS, SampleRows, ShardRecord, shard_name
from shardkit.format.tar import END_OF_ARCHIVE, member_header, padding

log = logging.getLogger(__name__)

# Part size and bytes in flight. The writer holds one part filling plus INFLIGHT_BYTES queued or
# uploading: 2 x 16 MiB, the writer's share of the memory bound that tests/test_pack_ray.py
# checks while packing 300 MB samples (32 MiB parts measured ~5-10% faster on SeaweedFS for
# 27 MB shards, one PUT instead of two parts, but peaked ~45 MB higher and broke that bound).
# One part uploading while the next fills keeps the link busy; more in flight gained nothing.
PART_BYTES = 16 * 2**20
INFLIGHT_BYTES = PART_BYTES

class Uploader:
    """Runs storage writes on one background thread, strictly in the order they were submitted.

    Reading and framing the next samples then overlaps the upload of earlier parts, and (when
    one Uploader serves several shards or tasks) the tail of a shard and its task's manifest
    fragment overlap the next shard. Uploads release the GIL.

    Memory is bounded: :meth:`submit` blocks while parts holding ``max_bytes`` are queued or
    running (a part is always accepted when nothing is in flight, so one part larger than the
    bound cannot deadlock). A full-size part buffer that was written is kept as the spare that
    :meth:`take_buffer` hands out next: refilling memory already mapped costs about a sixth of
    filling fresh pages, and growing a new buffer part after part fragments the heap.

    The first job that fails stops the queue: later jobs are skipped, except cleanup jobs
    (``always=True``), and the error is raised in the submitting thread by the next
    :meth:`submit`, :meth:`flush` or :meth:`close`. The order is what keeps resume safe: a
    task's fragment job runs only after every job of its shards succeeded.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = INFLIGHT_BYTES if max_bytes is None else max_bytes
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Callable[[], None], bytearray | None, bool]] = deque()
        self._inflight = 0  # bytes held by parts queued or being written
        self._spare: bytearray | None = None
        self._pending = 0  # jobs queued or running
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="shardkit-upload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                fn, part, always = self._jobs.popleft()
                skip = self._error is not None and not always
            done = False
            try:
                if not skip:
                    fn()
                    done = True
            except BaseException as exc:  # noqa: BLE001 - handed to the submitting thread
                if always:
                    log.debug("cleanup job failed", exc_info=True)
                else:
                    with self._cond:
                        self._error = self._error or exc
            finally:
                del fn  # the closure holds the part too: only `part` may outlive the job
                with self._cond:
                    if part is not None:
                        self._inflight -= len(part)
                        if done:
                            self._spare = part  # boto3 and files keep no reference once a call returned
                    part = None
                    self._pending -= 1
                    self._cond.notify_all()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def take_buffer(self, size: int) -> bytearray:
        """A part buffer of ``size`` bytes to overwrite: the spare one, or a new one."""
        with self._cond:
            spare, self._spare = self._spare, None
        return spare if spare is not None and len(spare) == size else bytearray(size)

    def submit(self, fn: Callable[[], None], part: bytearray | None = None, *, always: bool = False) -> None:
        """Queue ``fn``, which writes ``part`` (if any; it must not change until then). A
        cleanup job (``always``) never raises."""
        nbytes = len(part) if part is not None else 0
        with self._cond:
            if self._stopping:
                raise RuntimeError("Uploader is closed")
            if not always:
                while self._inflight and self._inflight + nbytes > self.max_bytes and self._error is None:
                    self._cond.wait()
                self._check()
            self._jobs.append((fn, part, always))
            self._inflight += nbytes
            self._pending += 1
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every submitted job has run (or been skipped); raise the first error."""
        with self._cond:
            while self._pending:
                self._cond.wait()
            self._check()

    def close(self, check: bool = True) -> None:
        """Run what is queued, stop the thread; raise the first error unless ``check`` is False
        (an error path, where the caller's own exception is the one to report)."""
        with self._cond:
            while self._pending:
                self._cond.wait()
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        if check:
            self._check()


class _S3Target:
    """A shard written with boto3: one PUT when it fits in one part, else a multipart upload.

    s3fs's own writer (``open("wb")``) was the bottleneck when packing small images: each
    8 MiB block was copied into and out of its buffer, sent through the aiobotocore event loop
    thread, and the object only started once the whole first block was buffered. Plain boto3
    sends the part buffer as it is. Every call runs on the Uploader thread (the first one also
    makes the process's client, ~0.1 s, while the first part is still being framed); calls are
    retried on transient faults by :meth:`Store.call` (a part is a whole body, safe to resend).
    """

    def __init__(self, store: Store, rel: str) -> None:
        self.store = store
        self.client: Any = None
        self.rel = rel
        self.bucket, self.key = store.bucket_key(rel)
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.aborted = False

    def send(self, part: bytearray, final: bool) -> None:
        if self.aborted:
            return
        if self.client is None:
            self.client = self.store.boto3_client()
        client, loc = self.client, {"Bucket": self.bucket, "Key": self.key}
        try:
            if final and self.upload_id is None:
                self.store.call(lambda: client.put_object(Body=part, **loc), self.rel)
                return
            if self.upload_id is None:
                self.upload_id = self.store.call(lambda: client.create_multipart_upload(**loc)["UploadId"], self.rel)
            number = len(self.parts) + 1
            etag = self.store.call(lambda: client.upload_part(Body=part, UploadId=self.upload_id, PartNumber=number,
                                                              **loc)["ETag"], self.rel)
            self.parts.append({"PartNumber": number, "ETag": etag})
            if final:
                self.store.call(lambda: client.complete_multipart_upload(
                    UploadId=self.upload_id, MultipartUpload={"Parts": self.parts}, **loc), self.rel)
                self.upload_id = None
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Abort an unfinished multipart upload (nothing was visible yet)."""
        self.aborted = True
        upload_id, self.upload_id = self.upload_id, None
        if upload_id is not None and self.client is not None:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - best effort; an unfinished upload is invisible anyway
                log.debug("abort of the multipart upload of %s failed", self.rel, exc_info=True)


class _FileTarget:
    """A shard written through an fsspec file: on local disk a temp file renamed at the end
    (readers never see a partial shard), elsewhere the filesystem's own streaming writer
    (e.g. s3fs when the store's options need it). Every call runs on the Uploader thread."""

    def __init__(self, store: Store, write_rel: str, final_rel: str) -> None:
        self.store = store
        self.write_rel = write_rel
        self.final_rel = final_rel
        self.local = write_rel != final_rel
        self.file: Any = None
        self.aborted = False

    def send(self, part: bytearray, final: bool) -> None:
        if self.aborted:
            return
        try:
            if self.file is None:
                self.file = self.store.open_write(self.write_rel)
            # A local file has written the bytes when write() returns; another filesystem's
            # writer might keep the object it was given, and part buffers are reused: copy.
            self.file.write(part if self.local else bytes(part))
            if final:
                self.file.close()
                if self.local:
                    self.store.fs.mv(self.store.path(self.write_rel), self.store.path(self.final_rel))
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        self.aborted = True
        file, self.file = self.file, None
        if file is None:
            return
        try:
            if self.local:
                # Local files write straight to the .tmp name (autocommit): fsspec's
                # LocalFileOpener.discard() raises in that mode, so close and delete instead.
                file.close()
                self.store.remove(self.write_rel)
            elif hasattr(file, "discard"):
                file.discard()
                # s3fs's discard drops the buffer but leaves the file "open": its __del__ would
                # then flush a None buffer (AttributeError at garbage collection). Mark it closed.
                setattr(file, "closed", True)  # noqa: B010 - read-only in the IO stubs
            else:
                file.close()
        except Exception:  # noqa: BLE001 - best effort cleanup while another error propagates
            log.debug("cleanup of %s failed", self.write_rel, exc_info=True)


class TarShard:
    """One shard file being written; call :meth:`add` per sample, then :meth:`close`.

    Bytes gather in a part buffer of ``part_bytes`` that is handed whole (no copy) to the
    ``uploader``. With a shared uploader, :meth:`close` returns as soon as the last part is
    queued: the shard exists once ``uploader.flush()`` returns. Without one, the shard gets its
    own and :meth:`close` waits.

    Its manifest rows gather in :attr:`rows`; with ``on_rows``, every :data:`PIECE_ROWS` of them
    go to ``on_rows(rows)`` instead and :attr:`rows` starts over (it holds the rest at close).
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
        self._target: _S3Target | _FileTarget
        if store.is_object_store and store.boto3_writes():
            self._target = _S3Target(store, self.path)
        elif store.is_object_store:
            self._target = _FileTarget(store, self.path, self.path)
        else:
            # A temp name per writer: two packs racing on one local directory never interleave.
            unique = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
            self._target = _FileTarget(store, f"{self.path}.tmp.{unique}", self.path)
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
        return self.pos

    @property
    def num_samples(self) -> int:
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
        when that part is written (before ``close`` returns if the shard owns its uploader)."""
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

    With ``on_shard``, each finished shard's record and rows go to ``on_shard(record, rows)``
    (which may queue work after the shard's upload with :meth:`submit`) instead of into
    ``rows``, so a long stream of samples keeps no rows here; with ``on_rows`` too, a shard's
    rows go to ``on_rows`` in pieces while it is written and ``on_shard`` gets the last ones
    (see :class:`TarShard`).
    """

    def __init__(self, store: Store, *, shard_bytes: int, shard_samples: int | None = None,
                 first_shard: int = 0, name_for: Callable[[int], str] = shard_name,
                 on_shard: Callable[[ShardRecord, SampleRows], None] | None = None,
                 on_rows: Callable[[SampleRows], None] | None = None) -> None:
        self.store = store
        self.shard_bytes = shard_bytes
        self.shard_samples = shard_samples
        self.name_for = name_for
        if on_rows is not None and on_shard is None:
            raise ValueError("ShardWriter: on_rows needs on_shard (which gets each shard's last rows)")
        self.on_shard = on_shard
        self.on_rows = on_rows
        self._next = first_shard
        self._current: TarShard | None = None
        # One upload thread for all shards: a shard's last part uploads while the next fills.
        self._uploader: Uploader | None = None
        self.shards: list[ShardRecord] = []
        self.rows = SampleRows()

    def write(self, sample: PackSample) -> None:
        cur = self._current
        if cur is not None and cur.num_samples > 0:
            # Count what the sample really adds (headers, padding) and the end-of-archive
            # blocks, so a shard of two or more samples never grows past shard_bytes.
            full_bytes = cur.bytes_written + tar_size(sample) + len(END_OF_ARCHIVE) > self.shard_bytes
            full_count = self.shard_samples is not None and cur.num_samples >= self.shard_samples
            if full_bytes or full_count:
                self._finish()
        if self._current is None:
            if self._uploader is None:
                self._uploader = Uploader()
            self._current = TarShard(self.store, self._next, self.name_for(self._next), self._uploader,
                                     on_rows=self.on_rows)
            self._next += 1
        self._current.add(sample)

    def _finish(self) -> None:
        if self._current is not None:
            shard, self._current = self._current, None
            record = shard.close()
            self.shards.append(record)
            if self.on_shard is not None:
                self.on_shard(record, shard.rows)
            else:
                self.rows.extend(shard.rows)

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the upload thread once every part queued so far is written (it is
        skipped if one of them failed); :meth:`close` waits for it and raises its error."""
        if self._uploader is None:
            self._uploader = Uploader()
        self._uploader.submit(fn)

    def close(self) -> None:
        """Finish the last shard and wait until every shard is stored."""
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        uploader, self._uploader = self._uploader, None
        if uploader is not None:
            uploader.close()

    def abort(self) -> None:
        if self._current is not None:
            self._current.abort()
            self._current = None
        uploader, self._uploader = self._uploader, None
        if uploader is not None:
            uploader.close(check=False)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
