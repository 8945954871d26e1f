"""One ranged request at a time over boto3 or fsspec, resumed from the byte it reached after a
transient fault: what each reader of :mod:`shardkit.storage.ranged` (and each of its parts) runs.

``boto3``   S3 only: ``get_object(Range=...)`` and ``readinto`` on the HTTP response, so bytes
            go from the socket into the caller's buffer with no intermediate ``bytes``; faster
            than s3fs (see benchmarks/RESULTS.md, "Large samples"). The client is built from
            the store's options (:func:`~shardkit.storage.s3client.s3_client`).
``fsspec``  any filesystem: ``fs.open`` + ``seek`` + ``readinto`` (local files read straight
            into the buffer; s3fs copies each read once).
"""

from __future__ import annotations

from typing import Any, Callable

from shardkit.errors import ShardkitError
from shardkit.storage.options import boto_settings
from shardkit.storage.retry import ShortRead, attempts_for, is_short, is_transient, pause_before_retry, translate
from shardkit.storage.store import Store

__all__ = ["Body", "Opener", "Count", "opener", "Cursor"]


class Body:
    """One open ranged request: :meth:`readinto` continues it, :meth:`close` ends it."""

    def readinto(self, out: memoryview) -> int:
        """Read the response on into the front of ``out``.

        Args:
            out: a writable, 1-D byte view.

        Returns:
            Bytes read; 0 when the body ended.
        """
        raise NotImplementedError

    def close(self, complete: bool) -> None:
        """End the request.

        Args:
            complete: its whole range was read (its connection may be reused).
        """
        raise NotImplementedError


Opener = Callable[[int, int], Body]
"""``open(pos, end)``: a request for object bytes ``[pos, end)``."""

Count = Callable[[int, int], None]
"""``count(nbytes, requests)``: told of every read and every request made."""


class _BotoBody(Body):
    def __init__(self, resp: dict[str, Any], key: str, pos: int, end: int) -> None:
        self._body = resp["Body"]
        self._raw = getattr(self._body, "_raw_stream", None)
        fp = getattr(self._raw, "_fp", None)
        length = int(resp.get("ContentLength", end - pos))
        if length != end - pos:
            self._body.close()
            raise ShortRead(f"ranged GET of {key} returned {length} bytes, asked {end - pos}")
        # http.client's readinto moves bytes socket -> out with no temporary bytes; botocore's
        # StreamingBody.read would allocate and copy every chunk.
        self._readinto: Callable[[memoryview], int] = self._copy
        if fp is not None and hasattr(fp, "readinto") and hasattr(self._raw, "release_conn"):
            self._readinto = fp.readinto

    def readinto(self, out: memoryview) -> int:
        return self._readinto(out)

    def _copy(self, out: memoryview) -> int:  # pragma: no cover - a botocore without urllib3 underneath
        data = self._body.read(len(out))
        out[:len(data)] = data
        return len(data)

    def close(self, complete: bool) -> None:
        if complete and self._raw is not None and hasattr(self._raw, "release_conn"):
            self._raw.release_conn()  # body fully read: the connection goes back to the pool
        else:
            self._body.close()


class _FsspecBody(Body):
    def __init__(self, fs: Any, path: str, pos: int) -> None:
        self._src = fs.open(path, "rb", block_size=0, cache_type="none")
        try:
            self._src.seek(pos)
        except BaseException:
            self._src.close()
            raise

    def readinto(self, out: memoryview) -> int:
        readinto = getattr(self._src, "readinto", None)
        if readinto is not None:
            return int(readinto(out) or 0)
        data = self._src.read(len(out))  # pragma: no cover - file objects without readinto
        out[:len(data)] = data
        return len(data)

    def close(self, complete: bool) -> None:
        self._src.close()


def opener(store: Store, path: str, client: Any | None) -> Opener:
    """How requests for object ``path`` of ``store`` are made.

    Args:
        store: the dataset root.
        path: the object, relative to the root.
        client: a boto3 S3 client for ``get_object`` (with the store's extra GET arguments),
            or None for fsspec (``fs.open`` + ``seek``, no read-ahead).

    Returns:
        ``open(pos, end)``.
    """
    if client is None:
        fs, full = store.fs, store.path(path)
        return lambda pos, end: _FsspecBody(fs, full, pos)
    bucket, key = store.bucket_key(path)
    extra = (boto_settings(store.storage_options) or {}).get("get_extra") or {}

    def open_boto(pos: int, end: int) -> Body:
        resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={pos}-{end - 1}", **extra)
        return _BotoBody(resp, key, pos, end)
    return open_boto


class Cursor:
    """Reads bytes of one object up to ``end``, front to back, one request at a time.

    A fault closes the request, and the read is retried with a new request from the byte
    reached; progress renews the fault budget (:func:`~shardkit.storage.retry.attempts_for`).
    A body that ends early is a fault, unless the object itself is shorter (IntegrityError).

    Args:
        open_body: how requests are made (:func:`opener`).
        store: the dataset root (for the size check and messages).
        what: the object, as messages name it.
        end: the byte reads stop at (each request asks up to it).
        count: told of every read (bytes) and request made.
    """

    def __init__(self, open_body: Opener, store: Store, what: str, end: int, count: Count | None = None) -> None:
        self._open, self._store, self._what, self._end = open_body, store, what, end
        self._count = count
        self._body: Body | None = None
        self._pos = -1

    def read(self, pos: int, out: memoryview) -> int:
        """Object bytes from ``pos`` (below ``end``) into the front of ``out``.

        Continues the open request when it stands at ``pos``, else makes one.

        Args:
            pos: object offset of ``out[0]``.
            out: a writable, 1-D byte view (at most ``end - pos`` bytes are asked for).

        Returns:
            Bytes read, at least one.

        Raises:
            StorageError: a permanent fault, or transient faults that outlasted the retries.
            IntegrityError: the object ends before ``end``.
        """
        failures = 0
        while True:
            try:
                if self._body is None or self._pos != pos:
                    self.close()
                    if self._count is not None:
                        self._count(0, 1)
                    self._body = self._open(pos, self._end)
                    self._pos = pos
                n = self._body.readinto(out)
                if not n:
                    raise ShortRead(f"truncated body of {self._what} at byte {pos}")
                self._pos += n
                if self._count is not None:
                    self._count(n, 0)
                if self._pos >= self._end:
                    self._body.close(complete=True)
                    self._body = None
                return n
            except Exception as exc:  # noqa: BLE001 - classified below
                self.close()
                if isinstance(exc, ShardkitError):
                    raise
                if is_short(exc):
                    self._store.check_extent(self._what, self._end)
                failures += 1
                budget = attempts_for(exc)
                if failures < budget and is_transient(exc):
                    pause_before_retry(exc, self._what, self._store.where, failures, budget)
                    continue
                raise translate(exc, self._what, self._store.where) from exc

    def close(self) -> None:
        """Drop the open request, if any."""
        if self._body is not None:
            body, self._body = self._body, None
            try:
                body.close(complete=False)
            except Exception:  # noqa: BLE001 - a request dropped after a fault may fail to close too
                pass
