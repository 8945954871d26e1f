"""The one module that talks to fsspec.

A :class:`Store` is a dataset root (any fsspec URL) plus storage options. It is picklable
(it carries only the URL and options) and opens its filesystem lazily inside each process,
so it can cross into Ray tasks and DataLoader workers. Every backend error leaves this module
translated into a :mod:`shardkit.errors` class whose message names the object, never a secret.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import random
import threading
import time
from typing import Any, BinaryIO, Callable, Iterable, Iterator, TypeVar

import fsspec
from fsspec.core import url_to_fs

from shardkit.errors import (
    ConfigError,
    DatasetExistsError,
    IntegrityError,
    ShardkitError,
    StorageError,
    StoragePermissionError,
    StorageStalledError,
    first_line,
)

T = TypeVar("T")
log = logging.getLogger(__name__)

_S3_CONNECT_TIMEOUT = 5
# Seconds without a byte before a read counts as a stalled connection (then retried). AWS's
# default is 60; with botocore's, s3fs's and shardkit's retries stacked, a frozen server took
# ~12 minutes to fail, in silence.
_S3_READ_TIMEOUT = 20
RETRY_ATTEMPTS = 6
# s3fs's own tries per call, under ours: its default 5 made every stalled call of a frozen store
# wait 5 read timeouts before shardkit's retry loop (and its warning) saw it.
S3FS_RETRIES = 2
# Faults in a row after which a stall (each costs botocore's tries x the read timeout) is given
# up: a frozen store fails in about two minutes, warning at each retry.
TIMEOUT_ATTEMPTS = 3
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
        # One try per botocore call (its "max_attempts" counts retries, not tries: 2 meant 3):
        # shardkit's retry loops (and s3fs's, S3FS_RETRIES) retry, resume from the byte
        # reached, and say when the store stalls.
        "retries": {"total_max_attempts": 1, "mode": "standard"},
    }
    for name, value in (explicit or {}).items():
        if isinstance(value, dict) and isinstance(opts.get(name), dict):
            opts[name] = {**opts[name], **value}
        else:
            opts[name] = value
    return opts


def with_env_location(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` plus the S3 endpoint and region this process's environment gives (explicit
    options still win): what a process elsewhere, a Ray worker with another environment, must
    use to reach the same store. Never the keys: those come from its own environment, or from
    ``options`` as given."""
    if not url.startswith(("s3://", "s3a://")) or "endpoint_url" in options:
        return dict(options)
    here = s3_options(None).get("client_kwargs") or {}
    if not here:
        return dict(options)
    return {**options, "client_kwargs": {**here, **(options.get("client_kwargs") or {})}}


# Schemes whose first path part is a bucket name, which never holds ':'.
_BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


def _userinfo_span(part: str) -> tuple[int, int] | None:
    """(start, end) of the ``user:secret`` before an ``@`` in one URL (no ``::`` chain), or None."""
    scheme, sep, rest = part.partition("://")
    if not sep:
        return None
    at = rest.find("@")
    if at < 0:
        return None
    head = rest[:at]
    start = len(scheme) + len(sep)
    if "/" not in head:
        return start, start + at
    # An AWS secret key may hold '/', which moves the '@' past the first '/'
    # (s3://AKID:abc/def@bucket/ds); a bucket name never holds ':', so a ':' in the first
    # part still means key:secret. Elsewhere an '@' after the first '/' is part of the path.
    if scheme.lower() in _BUCKET_SCHEMES and ":" in head.split("/", 1)[0]:
        return start, start + at
    return None


def redact_url(url: str) -> str:
    """``url`` with any userinfo (``key:secret@``) replaced by ``***``, chained parts included."""
    parts = []
    for part in url.split("::"):
        span = _userinfo_span(part)
        parts.append(part if span is None else part[:span[0]] + "***" + part[span[1]:])
    return "::".join(parts)


def refuse_url_credentials(url: str, what: str = "URL") -> None:
    """ConfigError for credentials written into a URL (``s3://KEY:SECRET@bucket/ds``).

    They would be repeated by every message and log line that names the URL, so they are
    refused up front, and the message shows the URL with them replaced by ``***``.
    """
    if redact_url(url) != url:
        raise ConfigError(f"{what} {redact_url(url)}: credentials in the URL are refused (they would show in "
                          "errors and logs); give them in the AWS_* environment variables, a profile "
                          "(AWS_PROFILE) or storage_options")


def endpoint_of(url: str, options: dict[str, Any]) -> str:
    """A printable description of where ``url`` lives (endpoint, never keys)."""
    if url.startswith("s3://"):
        ep = (options.get("client_kwargs") or {}).get("endpoint_url") or options.get("endpoint_url")
        return f"{url} (endpoint {redact_url(str(ep)) if ep else 'AWS default'})"
    return url


def open_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a URL to (filesystem, path) with shardkit's option rules (its one caller, Store,
    has refused credentials in the URL already)."""
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
    """
    args = getattr(fs, "storage_args", None)
    kwargs = getattr(fs, "storage_options", None)
    if args is None or kwargs is None:
        return fs
    return type(fs)(*args, **kwargs)


class ShortRead(ConnectionError):
    """A body that ended before the range asked for: a dropped connection (retried), unless
    the object itself ends there (see :meth:`Store.check_extent`)."""


def is_short(exc: BaseException) -> bool:
    """A read that came back short, or a range the object does not reach (S3's 416)."""
    return isinstance(exc, ShortRead) or _error_code(exc) in ("InvalidRange", "416")


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: resets, timeouts, truncated bodies, 5xx and SlowDown."""
    if isinstance(exc, (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError, ShardkitError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)) or is_connect_failure(exc):
        return True  # a refused connection once more (a server restarting); attempts_for caps it
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


def is_timeout(exc: BaseException) -> bool:
    """The store accepted the request and then did not answer in time."""
    text = f"{type(exc).__name__} {exc}"
    return isinstance(exc, TimeoutError) or "Timeout" in text or "timed out" in text


def is_connect_failure(exc: BaseException) -> bool:
    """No connection to the store at all: refused, unreachable host, unknown name (botocore's
    EndpointConnectionError, aiohttp's ClientConnectorError for http(s):// and s3fs)."""
    text = f"{type(exc).__name__} {exc}"
    if any(m in text for m in ("EndpointConnectionError", "Could not connect to the endpoint",
                               "ClientConnectorError", "Cannot connect to host")):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)


def attempts_for(exc: BaseException, attempts: int = RETRY_ATTEMPTS) -> int:
    """Faults in a row worth trying through: fewer for a dead endpoint or a stalled store."""
    if is_connect_failure(exc):
        return min(attempts, CONNECT_ATTEMPTS)
    if is_timeout(exc):
        return min(attempts, TIMEOUT_ATTEMPTS)
    return attempts


def pause_before_retry(exc: BaseException, what: str, where: str, failures: int, attempts: int) -> None:
    """Sleep the backoff before retry number ``failures`` of ``what``. A stalled store is said
    at each retry (a frozen server otherwise looks like a hang); routine resets are not."""
    if is_timeout(exc):
        log.warning("storage: no answer for %s at %s (%s); retrying (%d of %d)", what, where, type(exc).__name__,
                    failures, attempts - 1)
    else:
        log.debug("storage: %s on %s at %s; retrying (%d of %d)", type(exc).__name__, what, where, failures,
                  attempts - 1)
    time.sleep(backoff_delay(failures))


def backoff_delay(attempt: int) -> float:
    # Capped exponential backoff with full jitter (spreads retries of many workers).
    return random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2**attempt))


def translate(exc: BaseException, what: str, where: str) -> ShardkitError:
    """Map a backend error to a one-line shardkit error naming ``what``."""
    if isinstance(exc, ShardkitError):
        return exc
    name = type(exc).__name__
    text = first_line(exc) or name
    code = _error_code(exc)
    if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound"):
        return StorageError(f"{what} not found at {where} ({code})")
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
        return StoragePermissionError(f"access denied to {what} at {where}: check credentials ({code})")
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        return StoragePermissionError(f"access denied to {what} at {where}: check credentials ({text})")
    if isinstance(exc, FileNotFoundError):
        return StorageError(f"{what} not found at {where}")
    if is_connect_failure(exc) or isinstance(exc, ConnectionError):
        return StorageError(f"cannot reach storage for {what} at {where}: {name}")
    if is_timeout(exc):
        return StorageStalledError(f"storage did not answer for {what} at {where} ({name}), "
                                   f"retried {TIMEOUT_ATTEMPTS} times")
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
            budget = attempts_for(exc, attempts)
            if attempt + 1 < budget and is_transient(exc):
                pause_before_retry(exc, what, where, attempt + 1, budget)
                continue
            raise translate(exc, what, where) from exc
    raise AssertionError("unreachable")  # pragma: no cover


# storage_options keys whose meaning we reproduce exactly for boto3; anything else -> fsspec.
_BOTO_OPTION_KEYS = frozenset({"key", "secret", "token", "anon", "client_kwargs", "config_kwargs", "endpoint_url",
                               "profile", "s3_additional_kwargs", "skip_instance_cache", "use_listings_cache",
                               "default_block_size", "default_fill_cache", "default_cache_type", "asynchronous",
                               "loop", "version_aware", "listings_expiry_time", "max_concurrency"})
_GET_EXTRA_KEYS = ("RequestPayer", "SSECustomerAlgorithm", "SSECustomerKey", "SSECustomerKeyMD5", "ExpectedBucketOwner")




_clients: dict[tuple[int, str], Any] = {}
_clients_mu = threading.Lock()


def boto_settings(storage_options: dict[str, Any] | None) -> dict[str, Any] | None:
    """What boto3 needs to reach the same bucket as Store, or None when it cannot be sure."""
    opts = s3_options(storage_options)
    if set(opts) - _BOTO_OPTION_KEYS:
        return None  # an s3fs option we do not mirror: stay with s3fs rather than guess
    client_kwargs = dict(opts.get("client_kwargs") or {})
    if opts.get("endpoint_url"):
        client_kwargs.setdefault("endpoint_url", opts["endpoint_url"])
    extra = {k: v for k, v in (opts.get("s3_additional_kwargs") or {}).items() if k in _GET_EXTRA_KEYS}
    return {
        "client_kwargs": client_kwargs,
        "config_kwargs": dict(opts.get("config_kwargs") or {}),
        "key": opts.get("key") or opts.get("aws_access_key_id"),
        "secret": opts.get("secret") or opts.get("aws_secret_access_key"),
        "token": opts.get("token") or opts.get("aws_session_token"),
        "anon": bool(opts.get("anon")),
        "profile": opts.get("profile"),
        "get_extra": extra,
    }


def s3_client(storage_options: dict[str, Any] | None = None, max_pool: int = 8) -> Any:
    """A boto3 S3 client configured like :class:`~shardkit.storage.store.Store` would configure s3fs.

    Explicit ``storage_options`` win (``key``/``secret``/``token``, ``client_kwargs``
    ``endpoint_url``/``region_name``, ``config_kwargs``, ``anon``, ``profile``), then
    ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``/``AWS_REGION`` (via
    :func:`~shardkit.storage.store.s3_options`), then boto3's own chain (environment keys, config
    files). One client per process and settings (clients are thread-safe; a forked child
    builds its own). Secrets are never logged: the cache key is a digest.

    Raises:
        ConfigError: the options hold something boto3 cannot mirror (use the fsspec transport).
    """
    settings = boto_settings(storage_options)
    if settings is None:
        raise ConfigError("storage_options: holds s3fs options the boto3 transport does not mirror; use transport='fsspec'")
    ident = hashlib.sha256(json.dumps([settings, max_pool], sort_keys=True, default=repr).encode()).hexdigest()
    cache_key = (os.getpid(), ident)
    with _clients_mu:
        client = _clients.get(cache_key)
        if client is not None:
            return client
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(profile_name=settings["profile"]) if settings["profile"] else boto3.session.Session()
    cfg_kwargs = dict(settings["config_kwargs"])
    cfg_kwargs["max_pool_connections"] = max(int(cfg_kwargs.get("max_pool_connections", 10)), max_pool + 2)
    if settings["anon"]:
        from botocore import UNSIGNED
        cfg_kwargs["signature_version"] = UNSIGNED
    kwargs: dict[str, Any] = dict(settings["client_kwargs"])
    if settings["key"] and not settings["anon"]:
        kwargs.update(aws_access_key_id=settings["key"], aws_secret_access_key=settings["secret"],
                      aws_session_token=settings["token"])
    client = session.client("s3", config=Config(**cfg_kwargs), **kwargs)
    with _clients_mu:
        return _clients.setdefault(cache_key, client)


class Store:
    """A dataset root on any fsspec filesystem."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 fs: fsspec.AbstractFileSystem | None = None) -> None:
        refuse_url_credentials(url)  # every dataset and destination URL passes here first
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
