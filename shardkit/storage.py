"""The one module that talks to fsspec.

A :class:`Store` is a dataset root (any fsspec URL) plus storage options. It is picklable
(it carries only the URL and options) and opens its filesystem lazily inside each process,
so it can cross into Ray tasks and DataLoader workers. Every backend error leaves this module
translated into a :mod:`shardkit.errors` class whose message names the object, never a secret.
"""

from __future__ import annotations

import errno
import os
import random
import time
from typing import Any, BinaryIO, Callable, Iterator, TypeVar

import fsspec
from fsspec.core import url_to_fs

from .errors import (
    DatasetExistsError,
    ShardkitError,
    StorageError,
    StoragePermissionError,
)

T = TypeVar("T")

_S3_CONNECT_TIMEOUT = 5
_S3_READ_TIMEOUT = 60
RETRY_ATTEMPTS = 6
_BACKOFF_BASE = 0.2
_BACKOFF_CAP = 5.0
_STREAM_CHUNK = 1 << 20


def s3_options(explicit: dict[str, Any] | None) -> dict[str, Any]:
    """s3fs options: explicit storage options win, then the standard AWS variables."""
    opts: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    client_kwargs: dict[str, Any] = {}
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        client_kwargs["region_name"] = region
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    # Short connect timeout so a wrong endpoint fails in seconds, not minutes.
    opts["config_kwargs"] = {
        "connect_timeout": _S3_CONNECT_TIMEOUT,
        "read_timeout": _S3_READ_TIMEOUT,
        "retries": {"max_attempts": 2, "mode": "standard"},
    }
    for name, value in (explicit or {}).items():
        if isinstance(value, dict) and isinstance(opts.get(name), dict):
            opts[name] = {**opts[name], **value}
        else:
            opts[name] = value
    return opts


def endpoint_of(url: str, options: dict[str, Any]) -> str:
    """A printable description of where ``url`` lives (endpoint, never keys)."""
    if url.startswith("s3://"):
        ep = (options.get("client_kwargs") or {}).get("endpoint_url") or options.get("endpoint_url")
        return f"{url} (endpoint {ep or 'AWS default'})"
    return url


def open_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a URL to (filesystem, path) with shardkit's option rules."""
    opts = s3_options(storage_options) if url.startswith(("s3://", "s3a://")) else dict(storage_options or {})
    try:
        return url_to_fs(url, **opts)
    except (ImportError, ValueError) as exc:
        raise StorageError(f"cannot open {url}: {exc}") from exc


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: resets, timeouts, truncated bodies, 5xx and SlowDown."""
    if isinstance(exc, (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError, ShardkitError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE, errno.EIO, errno.EBUSY):
        return True
    if _error_code(exc) in ("NoSuchKey", "NoSuchBucket", "AccessDenied", "InvalidAccessKeyId",
                            "SignatureDoesNotMatch", "404", "403", "InvalidRange", "PreconditionFailed"):
        return False
    text = f"{type(exc).__name__} {exc}"
    markers = ("SlowDown", "ServiceUnavailable", "InternalError", "503", "500", "502", "504",
               "Timeout", "timed out", "Connection", "IncompleteRead", "ResponseStreamingError",
               "ClientPayloadError", "ServerDisconnected", "reset by peer", "ContentLength")
    return any(m in text for m in markers)


# s3fs and botocore already retry a refused connect several times (~3 s) before it reaches us;
# retrying that RETRY_ATTEMPTS more times made a wrong endpoint take ~15 s per call. One more
# try covers a server restarting; a dead endpoint then fails in seconds.
CONNECT_ATTEMPTS = 2


def _attempts_for(exc: BaseException, attempts: int) -> int:
    text = f"{type(exc).__name__} {exc}"
    if "EndpointConnectionError" in text or "Could not connect to the endpoint" in text:
        return min(attempts, CONNECT_ATTEMPTS)
    return attempts


def _backoff(attempt: int) -> float:
    # Capped exponential backoff with full jitter (spreads retries of many workers).
    return random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2**attempt))


def translate(exc: BaseException, what: str, where: str) -> ShardkitError:
    """Map a backend error to a one-line shardkit error naming ``what``."""
    if isinstance(exc, ShardkitError):
        return exc
    name = type(exc).__name__
    text = str(exc).splitlines()[0] if str(exc) else name
    code = _error_code(exc)
    if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound"):
        return StorageError(f"{what} not found at {where} ({code})")
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
        return StoragePermissionError(f"access denied to {what} at {where}: check credentials ({code})")
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        return StoragePermissionError(f"access denied to {what} at {where}: check credentials ({text})")
    if isinstance(exc, FileNotFoundError):
        return StorageError(f"{what} not found at {where}")
    if "EndpointConnectionError" in name or "Could not connect" in text or isinstance(exc, ConnectionError):
        return StorageError(f"cannot reach storage for {what} at {where}: {name}")
    return StorageError(f"storage error on {what} at {where}: {name}: {text}")


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code")) or None
    return None


def retrying(fn: Callable[[], T], what: str, where: str, attempts: int = RETRY_ATTEMPTS) -> T:
    """Call ``fn``, retrying transient storage faults; translate the final error."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below, re-raised translated
            if isinstance(exc, ShardkitError):
                raise
            if attempt + 1 < _attempts_for(exc, attempts) and is_transient(exc):
                time.sleep(_backoff(attempt))
                continue
            raise translate(exc, what, where) from exc
    raise AssertionError("unreachable")  # pragma: no cover


class Store:
    """A dataset root on any fsspec filesystem."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 fs: fsspec.AbstractFileSystem | None = None) -> None:
        self.url = url.rstrip("/") if url not in ("/",) else url
        self.storage_options = dict(storage_options or {})
        self._fs = fs
        self._boto3: Any = None
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
        return self.call(lambda: self.fs.exists(self.path(rel)), rel or self.url)

    def size(self, rel: str) -> int:
        return int(self.call(lambda: self.fs.size(self.path(rel)), rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.call(lambda: self.fs.cat_file(self.path(rel)), rel)

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object; a short body counts as a transient fault."""
        def read() -> bytes:
            data = self.fs.cat_file(self.path(rel), start=start, end=end)
            if len(data) != end - start:
                raise ConnectionError(f"truncated read of {rel}: {len(data)} of {end - start} bytes")
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

    def glob(self, pattern: str) -> list[str]:
        """Relative paths under the root matching ``pattern``, sorted."""
        prefix = self.root.rstrip("/") + "/"
        found = self.call(lambda: self.fs.glob(self.path(pattern)), pattern)
        return sorted(p[len(prefix):] if p.startswith(prefix) else p for p in found)

    def open_write(self, rel: str, block_size: int = 16 * 2**20) -> BinaryIO:
        """A streaming writer (multipart upload on S3, bounded buffer of ``block_size``)."""
        self._parent_dir(rel)
        try:
            return self.fs.open(self.path(rel), "wb", block_size=block_size)
        except Exception as exc:  # noqa: BLE001
            raise translate(exc, rel, self.where) from exc

    @property
    def is_s3(self) -> bool:
        return self.url.startswith(("s3://", "s3a://"))

    def boto3_client(self) -> Any:
        """A boto3 S3 client with the same endpoint, keys and region as this store's s3fs.

        Plain boto3 streams a GET about twice as fast as s3fs here (PERF.md), so bulk reads
        use it. Created once per process (clients are thread-safe; never pickled).
        """
        client = self._boto3
        if client is None:
            import boto3
            from botocore.config import Config

            opts = s3_options(self.storage_options)
            ck = dict(opts.get("client_kwargs") or {})
            cfg = dict(opts.get("config_kwargs") or {})
            cfg.setdefault("max_pool_connections", 32)
            if opts.get("endpoint_url"):
                ck.setdefault("endpoint_url", opts["endpoint_url"])
            creds = {"aws_access_key_id": opts.get("key"), "aws_secret_access_key": opts.get("secret"),
                     "aws_session_token": opts.get("token")}
            session = boto3.session.Session(**{k: v for k, v in creds.items() if v})
            client = session.client("s3", config=Config(**cfg), **ck)
            self._boto3 = client
        return client

    def bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, _, key = self.path(rel).partition("/")
        return bucket, key

    def _open_range(self, rel: str, pos: int, end: int) -> Iterator[bytes]:
        """Chunks of bytes [pos, end) of an object, one request."""
        if self.is_s3:
            bucket, key = self.bucket_key(rel)
            body = self.boto3_client().get_object(Bucket=bucket, Key=key, Range=f"bytes={pos}-{end - 1}")["Body"]
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
                   progress: Callable[[int], None] | None = None) -> None:
        """Stream bytes [start, end) of an object into ``out``.

        An interrupted transfer resumes with a ranged read from the byte it reached, with
        capped exponential backoff; after ``RETRY_ATTEMPTS`` faults in a row the error is raised
        naming the object. A body that ends early counts as such a fault.
        """
        pos = start
        failures = 0
        while pos < end:
            try:
                for data in self._open_range(rel, pos, end):
                    if pos + len(data) > end:
                        raise ConnectionError(f"{rel}: server sent more than the requested range")
                    out.write(data)
                    pos += len(data)
                    failures = 0
                    if progress:
                        progress(len(data))
                if pos < end:
                    raise ConnectionError(f"truncated body of {rel} at byte {pos}")
            except Exception as exc:  # noqa: BLE001 - classified below
                if isinstance(exc, ShardkitError):
                    raise
                failures += 1
                if failures < _attempts_for(exc, RETRY_ATTEMPTS) and is_transient(exc):
                    time.sleep(_backoff(failures))
                    continue
                raise translate(exc, rel, self.where) from exc


def iter_chunks(data: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]
