"""Getting shard bytes to storage: one upload thread that runs writes in order, and the targets
a shard's parts go to (a boto3 single PUT or multipart upload on S3, an fsspec file elsewhere).

Uploads release the GIL, so framing the next samples overlaps the upload of earlier parts.
Memory is bounded by :data:`INFLIGHT_BYTES` of parts queued or being written.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable

from shardkit.storage.store import Store

__all__ = ["INFLIGHT_BYTES", "FileTarget", "S3Target", "Uploader"]

log = logging.getLogger(__name__)

# Bytes of parts queued or uploading beyond the one being filled: one part (the writer's
# PART_BYTES) uploading while the next fills keeps the link busy; more in flight gained
# nothing, and the memory bound tests/pack/test_pack_ray.py checks leaves room for no more
# (see benchmarks/RESULTS.md).
INFLIGHT_BYTES = 16 * 2**20


class Uploader:
    """Runs storage writes on one background thread, strictly in the order they were submitted.

    Reading and framing the next samples then overlaps the upload of earlier parts, and (when
    one Uploader serves several shards or tasks) the tail of a shard and its task's manifest
    fragment overlap the next shard. Uploads release the GIL.

    Memory is bounded: :meth:`submit` blocks while parts holding ``max_bytes`` are queued or
    running (a part is always accepted when nothing is in flight, so one part larger than the
    bound cannot deadlock). A full-size part buffer that was written is kept as the spare that
    :meth:`take_buffer` hands out next: refilling memory already mapped is much cheaper than
    filling fresh pages, and growing a new buffer part after part fragments the heap.

    The first job that fails stops the queue: later jobs are skipped, except cleanup jobs
    (``always=True``), and the error is raised in the submitting thread by the next
    :meth:`submit`, :meth:`flush` or :meth:`close`. The order is what keeps resume safe: a
    task's fragment job runs only after every job of its shards succeeded.

    Args:
        max_bytes: the most bytes of parts queued or being written (default INFLIGHT_BYTES).
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
        """A part buffer to overwrite: the spare one, or a new one.

        Args:
            size: the buffer's length.

        Returns:
            A bytearray of ``size`` bytes (its content is stale).
        """
        with self._cond:
            spare, self._spare = self._spare, None
        return spare if spare is not None and len(spare) == size else bytearray(size)

    def submit(self, fn: Callable[[], None], part: bytearray | None = None, *, always: bool = False) -> None:
        """Queue a job, waiting while the bytes in flight are at the bound.

        Args:
            fn: the job, run on the upload thread.
            part: the buffer ``fn`` writes, if any (it must not change until then); counts
                towards the bound and may become the spare buffer.
            always: a cleanup job: run even after a failure, and never raises here.

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
            self._jobs.append((fn, part, always))
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
        """Run what is queued and stop the thread.

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
        self._thread.join()
        if check:
            self._check()


class S3Target:
    """A shard written with boto3: one PUT when it fits in one part, else a multipart upload.

    s3fs's own writer (``open("wb")``) was the bottleneck when packing small images: each
    8 MiB block was copied into and out of its buffer, sent through the aiobotocore event loop
    thread, and the object only started once the whole first block was buffered. Plain boto3
    sends the part buffer as it is. Every call runs on the Uploader thread (the first one also
    makes the process's client, while the first part is still being framed); calls are
    retried on transient faults by :meth:`Store.call` (a part is a whole body, safe to resend).

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

    def send(self, part: bytearray, final: bool) -> None:
        """Upload the shard's next part (discarding the upload if it fails).

        Args:
            part: the part's bytes.
            final: the shard's last part: complete the upload (or PUT the one part).

        Raises:
            StorageError: the call failed past its retries.
        """
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


class FileTarget:
    """A shard written through an fsspec file: on local disk a temp file renamed at the end
    (readers never see a partial shard), elsewhere the filesystem's own streaming writer
    (e.g. s3fs when the store's options need it). Every call runs on the Uploader thread.

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
