"""A dataset root on any fsspec filesystem: every metadata and small-object call shardkit makes.

A :class:`Store` is a dataset root (any fsspec URL) plus storage options. It is picklable
(it carries only the URL and options) and opens its filesystem lazily inside each process,
so it can cross into Ray tasks and DataLoader workers. Every backend error leaves it
translated into a :mod:`shardkit.errors` class whose message names the object, never a secret
(:mod:`shardkit.storage.retry`). Bulk reads go through :mod:`shardkit.storage.ranged`.
"""

from __future__ import annotations

import errno
import os
import re
from typing import Any, BinaryIO, Callable, Iterable, TypeVar

import fsspec
import xxhash
from fsspec.implementations.local import LocalFileSystem

from shardkit.errors import ConfigError, DatasetExistsError, IntegrityError, ShardkitError
from shardkit.storage.etag import EtagCheck, confirmed_read
from shardkit.storage.filesystem import create_local, open_fs, reopen_fs, replace_local
from shardkit.storage.options import boto_settings, check_storage_options, endpoint_of, s3_options
from shardkit.storage.retry import retrying, translate
from shardkit.storage.s3client import s3_client
from shardkit.storage.uploads import abort_multipart_uploads
from shardkit.storage.urls import refuse_url_credentials

__all__ = ["Store"]

T = TypeVar("T")

# 's3:/bucket/ds' or 's3:bucket/ds': a URL missing its slashes, which is also a relative local
# path (a folder named 's3:'), so it would be written to or read from the working directory.
_MISSING_SLASHES = re.compile(r"(?i)(s3|s3a|gs|gcs|az|abfs|abfss|https?):(?!//)")


class Store:
    """A dataset root on any fsspec filesystem, with retried and translated storage calls.

    Args:
        url: the root (``s3://bucket/prefix``, a local path, any fsspec URL); credentials in
            it are refused.
        storage_options: options for the filesystem (for ``s3://``: s3fs's, checked up front).
        fs: an open filesystem to use instead of opening one from ``url`` (it keeps its own
            configuration, and uploads then go through it).

    Raises:
        ConfigError: credentials in the URL, an S3 URL without a bucket or missing the slashes
            of ``s3://`` (``s3:/bucket``), or a storage option s3fs does not take.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 fs: fsspec.AbstractFileSystem | None = None) -> None:
        refuse_url_credentials(url)  # every dataset and destination URL passes here first
        check_storage_options(url, storage_options)
        if _MISSING_SLASHES.match(url):
            scheme = url.partition(":")[0]
            raise ConfigError(f"{url!r}: not a {scheme}:// URL (a URL is {scheme}://bucket/prefix); write it so, or "
                              f"./{url} for a local folder named {scheme}:")
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
        """The filesystem, opened on first use in each process."""
        if self._fs is None:
            self._fs, self._root = open_fs(self.url, self.storage_options)
            self._fs_pid = os.getpid()
        elif self._fs_pid != os.getpid():
            # s3fs filesystems are not fork-safe (event loop and sessions belong to the parent):
            # a Store used before a fork (DataLoader workers) reopens its filesystem in the child.
            self._fs = reopen_fs(self._fs)
            self._fs_pid = os.getpid()
        return self._fs

    @property
    def root(self) -> str:
        """The root's path on :attr:`fs` (no protocol)."""
        fs = self.fs
        if self._root is None:  # opening the filesystem sets it; a caller's filesystem too
            self._root = fs._strip_protocol(self.url)
        return self._root

    @property
    def where(self) -> str:
        """The URL and, for S3, its endpoint: how messages name the store (never a secret)."""
        opts = s3_options(self.storage_options) if self.url.startswith("s3") else {}
        return endpoint_of(self.url, opts)

    @property
    def is_object_store(self) -> bool:
        """True for stores without directories (S3 and friends)."""
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        return bool({"s3", "s3a", "gs", "gcs", "az", "abfs"} & set(protocols))

    @property
    def is_s3(self) -> bool:
        """True for ``s3://`` and ``s3a://`` URLs."""
        return self.url.startswith(("s3://", "s3a://"))

    @property
    def _is_http(self) -> bool:
        protocol = self.fs.protocol
        return bool({"http", "https"} & set((protocol,) if isinstance(protocol, str) else protocol))

    def _parent_dir(self, rel: str) -> None:
        if not self.is_object_store:
            self.fs.makedirs(self.fs._parent(self.path(rel)), exist_ok=True)

    def path(self, rel: str) -> str:
        """The path on :attr:`fs` of a path relative to the root.

        Args:
            rel: the relative path (``""``: the root).

        Returns:
            The path without protocol.
        """
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    def url_of(self, rel: str) -> str:
        """The URL of a path relative to the root, for messages.

        Args:
            rel: the relative path.

        Returns:
            The URL (credentials never appear in it: they are refused in URLs).
        """
        return f"{self.url}/{rel}"

    def bucket_key(self, rel: str) -> tuple[str, str]:
        """Where a path relative to the root lives on an object store.

        Args:
            rel: the relative path.

        Returns:
            ``(bucket, key)``.
        """
        bucket, _, key = self.path(rel).partition("/")
        return bucket, key

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Run one storage call with retries (:func:`~shardkit.storage.retry.retrying`).

        Args:
            fn: the call.
            what: the object it is about, named by the error.

        Returns:
            What ``fn`` returned.

        Raises:
            ShardkitError: the last fault, translated.
        """
        return retrying(fn, what, self.where)

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists.

        Args:
            rel: a path relative to the root; ``""`` for the root itself.

        Returns:
            True when it exists.

        Raises:
            StorageError: the store cannot be asked (an unreachable HTTP server is not "missing").
        """
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

    def info(self, rel: str) -> dict[str, Any]:
        """What the store says about an object (fsspec's ``info``: ``size``, and on S3 ``ETag``).

        Args:
            rel: the object, relative to the root.

        Returns:
            Its details.

        Raises:
            StorageError: it is missing, or the store failed.
        """
        return dict(self.call(lambda: self.fs.info(self.path(rel)), rel))

    def size(self, rel: str) -> int:
        """The size of an object.

        Args:
            rel: the object, relative to the root.

        Returns:
            Its size in bytes.

        Raises:
            StorageError: it is missing, or the store failed.
        """
        return int(self.call(lambda: self.fs.size(self.path(rel)), rel))

    def read_bytes(self, rel: str) -> bytes:
        """The whole of an object.

        Args:
            rel: the object, relative to the root.

        Returns:
            Its bytes.

        Raises:
            StorageError: it is missing, or the store failed.
        """
        return self.call(lambda: self.fs.cat_file(self.path(rel)), rel)

    def read_checked(self, rel: str) -> bytes:
        """The whole of a small object (a manifest file), its bytes checked against the
        object's ETag on an object store (:mod:`shardkit.storage.etag`): a byte corrupted in
        transit would otherwise become a wrong key, offset or checksum in every reader. On a
        mismatch it is read again; where the ETag cannot tell (no MD5 of the bytes: KMS
        encryption, another store's scheme), two reads that agree are trusted.

        Args:
            rel: the object, relative to the root.

        Returns:
            Its bytes.

        Raises:
            StorageError: it is missing, or the store failed.
            IntegrityError: every read gave other bytes, none matching the ETag.
        """
        if not self.is_object_store:
            return self.read_bytes(rel)
        reads = 0

        def read() -> tuple[bytes, bool | None, str]:
            nonlocal reads
            if reads:
                self.fs.invalidate_cache(self.path(rel))  # a listing's ETag may predate an overwrite
            reads += 1
            info = self.info(rel)
            data = self.read_bytes(rel)
            check = EtagCheck(info.get("ETag") or info.get("etag"), int(info.get("size", -1)))
            check.update(data)
            return data, check.verdict(), xxhash.xxh3_128_hexdigest(data)

        return confirmed_read(read, self.url_of(rel))

    def check_extent(self, rel: str, end: int) -> None:
        """After a short read: tell a truncated object from a dropped connection.

        Raises IntegrityError if the object ``rel`` really ends before byte ``end`` (truncated
        or replaced since its manifest was written), instead of retrying it as a network fault
        and then blaming the network. Returns quietly when the size cannot be had.

        Args:
            rel: the object.
            end: the byte the read should have reached.

        Raises:
            IntegrityError: the object holds fewer than ``end`` bytes.
        """
        try:
            size = self.size(rel)
        except ShardkitError:
            return  # cannot tell: the caller goes on treating it as a fault
        if size < end:
            raise IntegrityError(f"{self.url_of(rel)} holds {size} bytes, fewer than the manifest says (a read "
                                 f"up to byte {end}): it was truncated or replaced after it was written")

    def put_bytes(self, rel: str, data: bytes) -> None:
        """Write an object, replacing it.

        Args:
            rel: the object, relative to the root.
            data: its bytes.

        Raises:
            StorageError: the store failed.
        """
        self._parent_dir(rel)
        if isinstance(self.fs, LocalFileSystem):  # whole or not there, if the process dies mid-write
            self.call(lambda: replace_local(self.path(rel), data), rel)
        else:  # an S3 PUT is atomic already
            self.call(lambda: self.fs.pipe_file(self.path(rel), data), rel)

    def put_create(self, rel: str, data: bytes) -> None:
        """Create an object only if it does not exist (S3 ``If-None-Match: *``; a local or NFS
        file appears complete, exclusively: :func:`~shardkit.storage.filesystem.create_local`).

        Args:
            rel: the object, relative to the root.
            data: its bytes.

        Raises:
            DatasetExistsError: the key exists (another writer committed first).
            StorageError: the store failed.
        """
        self._parent_dir(rel)
        def put() -> None:
            try:
                if isinstance(self.fs, LocalFileSystem):
                    create_local(self.path(rel), data)
                else:
                    self.fs.pipe_file(self.path(rel), data, mode="create")
            except FileExistsError as exc:
                raise DatasetExistsError(f"{self.url_of(rel)} already exists") from exc
            except OSError as exc:
                if exc.errno == errno.EINVAL and "pre-condition" in str(exc):
                    raise DatasetExistsError(f"{self.url_of(rel)} already exists (another writer committed first)") from exc
                raise
        self.call(put, rel)

    def remove(self, rel: str, recursive: bool = False) -> None:
        """Delete ``rel``; gone already is fine.

        Args:
            rel: a path relative to the root.
            recursive: also everything under it.

        Raises:
            StorageError: the store failed.
        """
        def rm() -> None:
            try:
                self.fs.rm(self.path(rel), recursive=recursive)
            except FileNotFoundError:
                pass
        self.call(rm, rel)

    def listing(self, folder: str) -> list[str]:
        """What is under ``folder`` now (relative paths, sorted).

        s3fs keeps listings (shared by every Store of the same options in this process) and
        answers later size and existence queries from them: the listing is dropped before and
        after, or a reader here would see objects and sizes from before they changed.

        Args:
            folder: a folder relative to the root.

        Returns:
            Paths relative to the root.

        Raises:
            StorageError: the store failed.
        """
        self.fs.invalidate_cache(self.path(folder))
        try:
            return self.glob(f"{folder}/*")
        finally:
            self.fs.invalidate_cache(self.path(folder))

    def glob(self, pattern: str) -> list[str]:
        """Paths under the root matching a glob.

        Args:
            pattern: a glob relative to the root.

        Returns:
            Matching paths relative to the root, sorted.

        Raises:
            StorageError: the store failed.
        """
        prefix = self.root.rstrip("/") + "/"
        found = self.call(lambda: self.fs.glob(self.path(pattern)), pattern)
        return sorted(p[len(prefix):] if p.startswith(prefix) else p for p in found)

    def open_write(self, rel: str, block_size: int = 8 * 2**20) -> BinaryIO:
        """A streaming writer of an object (a multipart upload on S3).

        Args:
            rel: the object, relative to the root.
            block_size: bytes buffered before each part goes.

        Returns:
            A binary file open for writing; closing it completes the object.

        Raises:
            StorageError: the store failed.
        """
        self._parent_dir(rel)
        try:
            return self.fs.open(self.path(rel), "wb", block_size=block_size)
        except Exception as exc:  # noqa: BLE001
            raise translate(exc, rel, self.where) from exc

    def abort_uploads(self, folders: Iterable[str]) -> list[str]:
        """Abort the incomplete multipart uploads whose keys lie under ``folders``.

        S3 keeps the parts of an upload whose writer died, invisible in listings and billed,
        until it is aborted (:mod:`~shardkit.storage.uploads`); elsewhere a dead writer leaves
        a temp file or nothing, so this does nothing there.

        Args:
            folders: folders relative to the root.

        Returns:
            The keys aborted.

        Raises:
            StorageError: the store failed.
        """
        if not self.is_s3:
            return []
        return abort_multipart_uploads(self.fs, [(folder, *self.bucket_key(folder)) for folder in folders], self.call)

    def boto3_client(self) -> Any | None:
        """A boto3 client for this store, or None when its options are s3fs-only (use fsspec).

        Plain boto3 streams a GET faster than s3fs (see benchmarks/RESULTS.md), so bulk reads
        and uploads use it.

        Returns:
            The shared client for this store's endpoint and credentials, or None.
        """
        if not self.is_s3 or boto_settings(self.storage_options) is None:
            return None
        return s3_client(self.storage_options)

    def boto3_writes(self) -> bool:
        """Whether uploads may use :meth:`boto3_client`.

        Not when s3fs would write differently: it adds ``s3_additional_kwargs`` (SSE, ACL...)
        and fsspec config defaults to every upload, and a filesystem passed in by the caller
        carries its own settings.

        Returns:
            True when a boto3 upload writes what s3fs would.
        """
        if self._fs_given or self.storage_options.get("s3_additional_kwargs") or fsspec.config.conf.get("s3"):
            return False
        return self.is_s3 and boto_settings(self.storage_options) is not None
