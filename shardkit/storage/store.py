"""A dataset root on any fsspec filesystem: the one module that talks to fsspec.

A :class:`Store` is a dataset root (any fsspec URL) plus storage options. It is picklable
(it carries only the URL and options) and opens its filesystem lazily inside each process,
so it can cross into Ray tasks and DataLoader workers. Every backend error leaves it
translated into a :mod:`shardkit.errors` class whose message names the object, never a secret
(:mod:`shardkit.storage.retry`).
"""

from __future__ import annotations

import errno
import functools
import os
from typing import Any, BinaryIO, Callable, Iterable, Iterator, TypeVar

import fsspec
from fsspec.core import url_to_fs

from shardkit.errors import ConfigError, DatasetExistsError, IntegrityError, ShardkitError, StorageError
from shardkit.storage.options import boto_settings, check_storage_options, endpoint_of, s3_options
from shardkit.storage.retry import (ShortRead, attempts_for, is_short, is_transient, pause_before_retry, retrying,
                                    translate)
from shardkit.storage.s3client import s3_client
from shardkit.storage.urls import refuse_url_credentials

__all__ = ["Store", "open_fs", "reopen_fs", "S3FS_RETRIES"]

T = TypeVar("T")

# s3fs's own tries per call, under ours: its default 5 made every stalled call of a frozen store
# wait 5 read timeouts before shardkit's retry loop (and its warning) saw it.
S3FS_RETRIES = 2
_STREAM_CHUNK = 1 << 20


def open_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a URL to (filesystem, path) with shardkit's option rules.

    Its one caller, :class:`Store`, has refused credentials in the URL already.

    Args:
        url: any fsspec URL.
        storage_options: options for the filesystem (for ``s3://``, merged by
            :func:`~shardkit.storage.options.s3_options`).

    Returns:
        The filesystem and the path of ``url`` on it.

    Raises:
        StorageError: fsspec cannot open the URL (unknown protocol, missing package).
    """
    opts = s3_options(storage_options) if url.startswith(("s3://", "s3a://")) else dict(storage_options or {})
    try:
        fs, path = url_to_fs(url, **opts)
    except (ImportError, ValueError) as exc:
        raise StorageError(f"cannot open {url}: {exc}") from exc
    if hasattr(fs, "retries"):  # s3fs: its own retries of each call (a class attribute, 5)
        fs.retries = S3FS_RETRIES
    return fs, path


_PARENTS_FILESYSTEMS: list[fsspec.AbstractFileSystem] = []  # a forked child's inherited ones (Store.fs)


def reopen_fs(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """A fresh instance of ``fs`` (same class and arguments) for a forked process.

    fsspec clears its instance cache when the pid changes, so this never hands back the
    parent's instance; a filesystem passed in by the caller keeps its own configuration.

    Args:
        fs: the filesystem the parent process opened.

    Returns:
        A new instance, or ``fs`` itself when it does not record its arguments.
    """
    args = getattr(fs, "storage_args", None)
    kwargs = getattr(fs, "storage_options", None)
    if args is None or kwargs is None:
        return fs
    return type(fs)(*args, **kwargs)


class Store:
    """A dataset root on any fsspec filesystem."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 fs: fsspec.AbstractFileSystem | None = None) -> None:
        refuse_url_credentials(url)  # every dataset and destination URL passes here first
        check_storage_options(url, storage_options)
        scheme, sep, rest = url.partition("://")
        if sep and scheme in ("s3", "s3a", "gs", "gcs") and not rest.strip("/"):
            raise ConfigError(f"{url!r}: no bucket in the URL (expected {scheme}://bucket/prefix)")
        self.url = url.rstrip("/") if url not in ("/",) else url
        self.storage_options = dict(storage_options or {})
        self._fs = fs
        self._fs_given = fs is not None
        self._fs_pid = os.getpid()
        self._root: str | None = None
        if fs is not None:
            self._root = fs._strip_protocol(self.url)

    def __getstate__(self) -> dict[str, Any]:
        # Never pickle an open filesystem or client (sockets, event loops): reopen in the new process.
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["storage_options"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            self._fs, self._root = open_fs(self.url, self.storage_options)
            self._fs_pid = os.getpid()
        elif self._fs_pid != os.getpid():
            # s3fs filesystems are not fork-safe (event loop and sessions belong to the parent):
            # a Store used before a fork (DataLoader workers) reopens its filesystem in the child.
            # The parent's instance is kept, never collected here: collecting it would close its
            # aiobotocore session on the parent's loop, which prints "Task exception was never
            # retrieved ... attached to a different loop" tracebacks in every worker.
            _PARENTS_FILESYSTEMS.append(self._fs)
            self._fs = reopen_fs(self._fs)
            self._fs_pid = os.getpid()
        return self._fs

    @property
    def root(self) -> str:
        self.fs  # noqa: B018 - resolves _root
        assert self._root is not None
        return self._root

    @property
    def where(self) -> str:
        opts = s3_options(self.storage_options) if self.url.startswith("s3") else {}
        return endpoint_of(self.url, opts)

    @property
    def is_object_store(self) -> bool:
        """True for stores without directories (S3 and friends)."""
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        return bool({"s3", "s3a", "gs", "gcs", "az", "abfs"} & set(protocols))

    def _parent_dir(self, rel: str) -> None:
        if not self.is_object_store:
            self.fs.makedirs(self.fs._parent(self.path(rel)), exist_ok=True)

    def path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    def url_of(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def call(self, fn: Callable[[], T], what: str) -> T:
        return retrying(fn, what, self.where)

    def exists(self, rel: str) -> bool:
        def check() -> bool:
            path = self.path(rel)
            if self.fs.exists(path):
                return True
            if not self._is_http:
                return False
            # fsspec's HTTPFileSystem.exists also answers False for a server it cannot reach
            # (or any error status), so a dead server looked like a missing dataset. A read of
            # one byte tells them apart: a 404 is FileNotFoundError; a refused connection or a
            # 403/500 raises, and is translated as such.
            try:
                self.fs.cat_file(path, start=0, end=1)
            except FileNotFoundError:
                return False
            return True
        return self.call(check, rel or self.url)

    @property
    def _is_http(self) -> bool:
        protocol = self.fs.protocol
        return bool({"http", "https"} & set((protocol,) if isinstance(protocol, str) else protocol))

    def size(self, rel: str) -> int:
        return int(self.call(lambda: self.fs.size(self.path(rel)), rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.call(lambda: self.fs.cat_file(self.path(rel)), rel)

    def check_extent(self, rel: str, end: int) -> None:
        """After a short read: raise IntegrityError if the object ``rel`` really ends before
        byte ``end`` (truncated or replaced since its manifest was written), instead of
        retrying it as a network fault and then blaming the network."""
        try:
            size = self.size(rel)
        except ShardkitError:
            return  # cannot tell: the caller goes on treating it as a fault
        if size < end:
            raise IntegrityError(f"{self.url_of(rel)} holds {size} bytes, fewer than the manifest says (a read "
                                 f"up to byte {end}): it was truncated or replaced after it was written")

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object (boto3 on S3); a short body is retried as a fault."""
        def read() -> bytes:
            try:
                data = b"".join(self._open_range(rel, start, end)) if end > start else b""
            except Exception as exc:
                if is_short(exc):
                    self.check_extent(rel, end)
                raise
            if len(data) != end - start:
                self.check_extent(rel, end)
                raise ShortRead(f"truncated read of {rel}: {len(data)} of {end - start} bytes")
            return data
        return self.call(read, rel)

    def put_bytes(self, rel: str, data: bytes) -> None:
        self._parent_dir(rel)
        self.call(lambda: self.fs.pipe_file(self.path(rel), data), rel)

    def put_create(self, rel: str, data: bytes) -> None:
        """Create-only put (S3 If-None-Match: *): DatasetExistsError if the key exists."""
        self._parent_dir(rel)
        def put() -> None:
            try:
                self.fs.pipe_file(self.path(rel), data, mode="create")
            except FileExistsError as exc:
                raise DatasetExistsError(f"{self.url_of(rel)} already exists") from exc
            except OSError as exc:
                if exc.errno == errno.EINVAL and "pre-condition" in str(exc):
                    raise DatasetExistsError(f"{self.url_of(rel)} already exists (another writer committed first)") from exc
                raise
        self.call(put, rel)

    def remove(self, rel: str, recursive: bool = False) -> None:
        def rm() -> None:
            try:
                self.fs.rm(self.path(rel), recursive=recursive)
            except FileNotFoundError:
                pass
        self.call(rm, rel)

    def listing(self, folder: str) -> list[str]:
        """What is under ``folder`` now (relative paths, sorted). s3fs keeps listings (shared
        by every Store of the same options in this process) and answers later size and
        existence queries from them: the listing is dropped before and after, or a reader here
        would see objects and sizes from before they changed."""
        self.fs.invalidate_cache(self.path(folder))
        try:
            return self.glob(f"{folder}/*")
        finally:
            self.fs.invalidate_cache(self.path(folder))

    def glob(self, pattern: str) -> list[str]:
        """Relative paths under the root matching ``pattern``, sorted."""
        prefix = self.root.rstrip("/") + "/"
        found = self.call(lambda: self.fs.glob(self.path(pattern)), pattern)
        return sorted(p[len(prefix):] if p.startswith(prefix) else p for p in found)

    def open_write(self, rel: str, block_size: int = 8 * 2**20) -> BinaryIO:
        """A streaming writer (multipart upload on S3, bounded buffer of ``block_size``)."""
        self._parent_dir(rel)
        try:
            return self.fs.open(self.path(rel), "wb", block_size=block_size)
        except Exception as exc:  # noqa: BLE001
            raise translate(exc, rel, self.where) from exc

    def abort_uploads(self, folders: Iterable[str]) -> list[str]:
        """Abort the incomplete multipart uploads whose keys lie under ``folders`` (relative to
        the root) and return their keys. S3 keeps the parts of an upload whose writer died,
        invisible in listings and billed, until it is aborted; elsewhere a dead writer leaves a
        temp file or nothing, so this does nothing there."""
        if not self.is_s3:
            return []
        fs = self.fs
        aborted: list[str] = []
        for folder in folders:
            bucket, prefix = self.bucket_key(folder)
            prefix = prefix.rstrip("/") + "/"
            params: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
            while True:
                page = self.call(functools.partial(fs.call_s3, "list_multipart_uploads", **params),
                                 f"{folder}/ (multipart uploads)")
                for up in page.get("Uploads") or []:
                    key = up["Key"]
                    if key.startswith(prefix):  # a store that ignores Prefix lists the whole bucket
                        self.call(functools.partial(self._abort_upload, bucket, key, up["UploadId"]), key)
                        aborted.append(key)
                if not page.get("IsTruncated"):
                    break
                params = {"Bucket": bucket, "Prefix": prefix, "KeyMarker": page.get("NextKeyMarker", ""),
                          "UploadIdMarker": page.get("NextUploadIdMarker", "")}
        return aborted

    def _abort_upload(self, bucket: str, key: str, upload_id: str) -> None:
        try:
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except FileNotFoundError:
            pass  # completed or aborted meanwhile (NoSuchUpload)

    @property
    def is_s3(self) -> bool:
        return self.url.startswith(("s3://", "s3a://"))

    def boto3_client(self) -> Any | None:
        """A boto3 client for this store (None when its options are s3fs-only: use fsspec).

        Plain boto3 streams a GET about twice as fast as s3fs here (PERF.md), so bulk reads use it.
        """
        if not self.is_s3 or boto_settings(self.storage_options) is None:
            return None
        return s3_client(self.storage_options)

    def boto3_writes(self) -> bool:
        """Whether uploads may use :meth:`boto3_client`. Not when s3fs would write differently:
        it adds ``s3_additional_kwargs`` (SSE, ACL...) and fsspec config defaults to every
        upload, and a filesystem passed in by the caller carries its own settings."""
        if self._fs_given or self.storage_options.get("s3_additional_kwargs") or fsspec.config.conf.get("s3"):
            return False
        return self.is_s3 and boto_settings(self.storage_options) is not None

    def bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, _, key = self.path(rel).partition("/")
        return bucket, key

    def _open_range(self, rel: str, pos: int, end: int) -> Iterator[bytes]:
        """Chunks of bytes [pos, end) of an object, one request."""
        client = self.boto3_client()
        if client is not None:
            bucket, key = self.bucket_key(rel)
            body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={pos}-{end - 1}")["Body"]
            try:
                yield from body.iter_chunks(_STREAM_CHUNK)
            finally:
                body.close()
            return
        with self.fs.open(self.path(rel), "rb", block_size=0, cache_type="none") as src:
            src.seek(pos)
            while pos < end:
                data = src.read(min(8 * _STREAM_CHUNK, end - pos))
                if not data:
                    return
                pos += len(data)
                yield data

    def fetch_into(self, rel: str, out: BinaryIO, start: int, end: int,
                   progress: Callable[[int], None] | None = None,
                   on_request: Callable[[], None] | None = None) -> None:
        """Stream bytes [start, end) of an object into ``out``.

        An interrupted transfer resumes with a ranged read from the byte it reached, with
        capped exponential backoff; after ``RETRY_ATTEMPTS`` faults in a row the error is raised
        naming the object. A body that ends early counts as such a fault. ``progress`` is
        told of every chunk written, ``on_request`` of every request made (retries included).
        """
        pos = start
        failures = 0
        while pos < end:
            try:
                if on_request:
                    on_request()
                for data in self._open_range(rel, pos, end):
                    if pos + len(data) > end:
                        raise ConnectionError(f"{rel}: server sent more than the requested range")
                    out.write(data)
                    pos += len(data)
                    failures = 0
                    if progress:
                        progress(len(data))
                if pos < end:
                    raise ShortRead(f"truncated body of {rel} at byte {pos}")
            except Exception as exc:  # noqa: BLE001 - classified below
                if isinstance(exc, ShardkitError):
                    raise
                if is_short(exc):
                    self.check_extent(rel, end)
                failures += 1
                budget = attempts_for(exc)
                if failures < budget and is_transient(exc):
                    pause_before_retry(exc, rel, self.where, failures, budget)
                    continue
                raise translate(exc, rel, self.where) from exc


def iter_chunks(data: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]
