"""Getting shard bytes to storage: a few upload threads that run writes in order (S3 parts of
shards side by side), and the targets a shard's parts go to (a boto3 single PUT or multipart
upload on S3, an fsspec file elsewhere).

Uploads release the GIL, so framing the next samples overlaps the upload of earlier parts.
Memory is bounded by :data:`INFLIGHT_BYTES` of parts queued or being written.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable

from shardkit.storage.store import Store

__all__ = ["INFLIGHT_BYTES", "UPLOAD_THREADS", "FileTarget", "S3Target", "Uploader"]

log = logging.getLogger(__name__)

# Bytes of parts queued or uploading beyond the one being filled: two of the writer's
# PART_BYTES parts, uploading side by side. With one at a time the link sat idle while the
# store handled each part before answering (SeaweedFS writes it before it replies): a second
# part sending meanwhile made the images pack ~1.4x faster, as fast as a bare multipart PUT
# (see benchmarks/RESULTS.md "Packing"). The writer then holds three part buffers at most (one
# filling, two uploading), the peak memory tests/pack/test_pack_ray.py bounds.
INFLIGHT_BYTES = 16 * 2**20
# Jobs that may run at once (S3 parts; every other job runs alone, in order).
UPLOAD_THREADS = 2


def _done() -> None:
    """What a finished job's call becomes (its closure, holding the part, is let go)."""


class _Job:
    """A queued write: the call, the part it sends (counted in flight), and how it runs."""

    __slots__ = ("fn", "part", "always", "parallel")

    def __init__(self, fn: Callable[[], None], part: bytearray | None, always: bool, parallel: bool) -> None:
        self.fn, self.part, self.always, self.parallel = fn, part, always, parallel


class Uploader:
    """Runs storage writes on background threads, in the order they were submitted.

    Reading and framing the next samples then overlaps the upload of earlier parts, and (when
    one Uploader serves several shards or tasks) the tail of a shard and its task's manifest
    fragment overlap the next shard. Uploads release the GIL.

    Order: a job runs alone, once every job submitted before it has finished, unless it is
    submitted ``parallel`` (an S3 part: :class:`S3Target` numbers its parts, so they may land
    in any order); up to ``threads`` consecutive parallel jobs run at once. A multipart
    upload's completion, a file's writes and a task's fragment are ordered jobs, so none runs
    before the parts queued ahead of it are stored.

    Memory is bounded: :meth:`submit` blocks while parts holding ``max_bytes`` are queued or
    running (a part is always accepted when nothing is in flight, so one part larger than the
    bound cannot deadlock). Full-size part buffers that were written are kept as spares that
    :meth:`take_buffer` hands out next: refilling memory already mapped is much cheaper than
    filling fresh pages, and growing a new buffer part after part fragments the heap.

    The first job that fails stops the queue: later jobs are skipped, except cleanup jobs
    (``always=True``), and the error is raised in the submitting thread by the next
    :meth:`submit`, :meth:`flush` or :meth:`close`. The order is what keeps resume safe: a
    task's fragment job runs only after every job of its shards succeeded.

    Args:
        max_bytes: the most bytes of parts queued or being written (default INFLIGHT_BYTES).
        threads: the most parallel jobs running at once (default UPLOAD_THREADS).
    """

    def __init__(self, max_bytes: int | None = None, threads: int | None = None) -> None:
        self.max_bytes = INFLIGHT_BYTES if max_bytes is None else max_bytes
        self.threads = max(1, UPLOAD_THREADS if threads is None else threads)
        self._cond = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._running = 0  # jobs being run
        self._alone = False  # the running job is an ordered one
        self._inflight = 0  # bytes held by parts queued or being written
        self._spares: list[bytearray] = []
        self._pending = 0  # jobs queued or running
        self._error: BaseException | None = None
        self._stopping = False
        self._workers = [threading.Thread(target=self._run, name="shardkit-upload", daemon=True)
                         for _ in range(self.threads)]
        for t in self._workers:
            t.start()

    def _startable(self) -> bool:
        """Whether the next queued job may start now (called with the lock held)."""
        if not self._jobs or self._alone:
            return False
        return self._running == 0 or self._jobs[0].parallel

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._startable():
                    if self._stopping and not self._jobs:
                        return
                    self._cond.wait()
                job = self._jobs.popleft()
                self._running += 1
                self._alone = not job.parallel
                skip = self._error is not None and not job.always
                if self._jobs:
                    self._cond.notify_all()  # the next parallel job may start beside this one
            done = False
            try:
                if not skip:
                    job.fn()
                    done = True
            except BaseException as exc:  # noqa: BLE001 - handed to the submitting thread
                if job.always:
                    log.debug("cleanup job failed", exc_info=True)
                else:
                    with self._cond:
                        self._error = self._error or exc
            finally:
                # The call's closure holds the part too: only `part` may outlive the job.
                part, job.fn, job.part = job.part, _done, None
                with self._cond:
                    self._running -= 1
                    self._alone = False
                    if part is not None:
                        self._inflight -= len(part)
                        # boto3 and files keep no reference once a call returned
                        if done and len(self._spares) < self.threads:
                            self._spares.append(part)
                    part = None
                    self._pending -= 1
                    self._cond.notify_all()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def take_buffer(self, size: int) -> bytearray:
        """A part buffer to overwrite: a spare one, or a new one.

        Args:
            size: the buffer's length.

        Returns:
            A bytearray of ``size`` bytes (its content is stale).
        """
        with self._cond:
            for i, spare in enumerate(self._spares):
                if len(spare) == size:
                    return self._spares.pop(i)
            self._spares.clear()  # another size: they would only hold memory
        return bytearray(size)

    def submit(self, fn: Callable[[], None], part: bytearray | None = None, *, always: bool = False,
               parallel: bool = False) -> None:
        """Queue a job, waiting while the bytes in flight are at the bound.

        Args:
            fn: the job, run on an upload thread.
            part: the buffer ``fn`` writes, if any (it must not change until then); counts
                towards the bound and may become a spare buffer.
            always: a cleanup job: run even after a failure, and never raises here.
            parallel: the job may run beside the parallel jobs next to it in the queue
                (default: it runs alone, after every job before it).

        Raises:
            RuntimeError: the uploader is closed.
            BaseException: the first error of an earlier job.
        """
        nbytes = len(part) if part is not None else 0
        with self._cond:
            if self._stopping:
                raise RuntimeError("Uploader is closed")
            if not always:
                while self._inflight and self._inflight + nbytes > self.max_bytes and self._error is None:
                    self._cond.wait()
                self._check()
            self._jobs.append(_Job(fn, part, always, parallel))
            self._inflight += nbytes
            self._pending += 1
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every submitted job has run (or been skipped).

        Raises:
            BaseException: the first error of a job.
        """
        with self._cond:
            while self._pending:
                self._cond.wait()
            self._check()

    def close(self, check: bool = True) -> None:
        """Run what is queued and stop the threads.

        Args:
            check: raise the first error of a job (False on an error path, where the caller's
                own exception is the one to report).

        Raises:
            BaseException: the first error of a job, with ``check``.
        """
        with self._cond:
            while self._pending:
                self._cond.wait()
            self._stopping = True
            self._cond.notify_all()
        for t in self._workers:
            t.join()
        if check:
            self._check()


class S3Target:
    """A shard written with boto3: one PUT when it fits in one part, else a multipart upload.

    s3fs's own writer (``open("wb")``) was the bottleneck when packing small images: each
    8 MiB block was copied into and out of its buffer, sent through the aiobotocore event loop
    thread, and the object only started once the whole first block was buffered. Plain boto3
    sends the part buffer as it is. Parts are numbered when queued and upload side by side
    (:meth:`queue`); the completion waits for all of them. Every call runs on an upload
    thread (the first one also makes the process's client, while the first part is still
    being framed); calls are retried on transient faults by :meth:`Store.call` (a part is a
    whole body, safe to resend).

    Args:
        store: the destination (an object store).
        rel: the shard's path under it.
    """

    def __init__(self, store: Store, rel: str) -> None:
        self.store = store
        self.client: Any = None
        self.rel = rel
        self.bucket, self.key = store.bucket_key(rel)
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.aborted = False
        self._queued = 0  # parts numbered so far
        self._lock = threading.Lock()  # the first part starts the upload; the others wait for it

    def connect(self) -> None:
        """Make the process's boto3 client (cached per process) if this target has none yet."""
        if self.client is None:
            self.client = self.store.boto3_client()

    def queue(self, uploader: Uploader, part: bytearray, final: bool) -> None:
        """Queue the shard's next part: a parallel job, and after the last one the ordered
        completion of the upload (a shard of one part is one parallel PUT).

        Args:
            uploader: the upload threads.
            part: the part's bytes (not changed until it is written).
            final: the shard's last part.

        Raises:
            BaseException: the first error of an earlier job (see :meth:`Uploader.submit`).
        """
        if final and not self._queued:
            uploader.submit(lambda: self._put(part), part, parallel=True)
            return
        self._queued += 1
        number = self._queued
        uploader.submit(lambda: self._send_part(part, number), part, parallel=True)
        if final:
            uploader.submit(self._complete)

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)`` with the store's retries; the upload is discarded if it fails."""
        try:
            self.connect()
            client = self.client
            return self.store.call(lambda: fn(client), self.rel)
        except BaseException:
            self.discard()
            raise

    def _put(self, part: bytearray) -> None:
        if not self.aborted:
            self._call(lambda c: c.put_object(Body=part, Bucket=self.bucket, Key=self.key))

    def _upload_id(self) -> str | None:
        """The multipart upload's id, started by the first part to ask (None once discarded)."""
        with self._lock:
            if self.aborted:
                return None
            if self.upload_id is None:
                self.upload_id = self._call(
                    lambda c: c.create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"])
            return self.upload_id

    def _send_part(self, part: bytearray, number: int) -> None:
        upload_id = self._upload_id()
        if upload_id is None:
            return
        etag = self._call(lambda c: c.upload_part(Body=part, UploadId=upload_id, PartNumber=number,
                                                  Bucket=self.bucket, Key=self.key)["ETag"])
        with self._lock:
            self.parts.append({"PartNumber": number, "ETag": etag})

    def _complete(self) -> None:
        upload_id = self.upload_id
        if self.aborted or upload_id is None:
            return
        parts = sorted(self.parts, key=lambda p: int(p["PartNumber"]))
        if len(parts) != self._queued:  # only if a part job was skipped, which a failure reports first
            raise RuntimeError(f"{self.rel}: {len(parts)} of {self._queued} parts uploaded")
        self._call(lambda c: c.complete_multipart_upload(UploadId=upload_id, MultipartUpload={"Parts": parts},
                                                         Bucket=self.bucket, Key=self.key))
        self.upload_id = None

    def discard(self) -> None:
        """Abort an unfinished multipart upload (nothing was visible yet)."""
        self.aborted = True
        upload_id, self.upload_id = self.upload_id, None
        if upload_id is not None and self.client is not None:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - best effort; an unfinished upload is invisible anyway
                log.debug("abort of the multipart upload of %s failed", self.rel, exc_info=True)


class FileTarget:
    """A shard written through an fsspec file: on local disk a temp file renamed at the end
    (readers never see a partial shard), elsewhere the filesystem's own streaming writer
    (e.g. s3fs when the store's options need it). Its writes are ordered jobs, run on an
    upload thread one after another.

    Args:
        store: the destination.
        write_rel: the path written (a temp name on local disk).
        final_rel: the shard's path, where it appears when done.
    """

    def __init__(self, store: Store, write_rel: str, final_rel: str) -> None:
        self.store = store
        self.write_rel = write_rel
        self.final_rel = final_rel
        self.local = write_rel != final_rel
        self.file: Any = None
        self.aborted = False

    def queue(self, uploader: Uploader, part: bytearray, final: bool) -> None:
        """Queue the shard's next part as an ordered job (see :meth:`send`).

        Args:
            uploader: the upload threads.
            part: the part's bytes (not changed until it is written).
            final: the shard's last part.

        Raises:
            BaseException: the first error of an earlier job (see :meth:`Uploader.submit`).
        """
        uploader.submit(lambda: self.send(part, final), part)

    def send(self, part: bytearray, final: bool) -> None:
        """Write the shard's next part (discarding the file if it fails).

        Args:
            part: the part's bytes.
            final: the shard's last part: close the file (and rename a local temp file).

        Raises:
            OSError: the write failed (as the filesystem raises it).
        """
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
        """Drop the unfinished file (best effort): a local temp file is deleted."""
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
