"""Parallel ranged reads straight into a preallocated buffer (the large-sample fetch path).

:func:`read_into` splits ``[start, end)`` of one object into parts of ``part_size`` bytes and
fetches them with up to ``concurrency`` threads, each writing into its own slice of ``out``:
no part is ever concatenated, so a 300 MB sample costs one 300 MB allocation (the caller's)
plus one copy from the socket at most. A part that fails with a transient fault resumes with
a new ranged GET from the byte it reached; a permanent fault raises one StorageError naming
the object.

Transports, chosen per call by ``transport`` (``"auto"`` picks the first that applies):

``boto3``   S3 only: ``get_object(Range=...)`` and ``readinto`` on the HTTP response, so bytes
            go from the socket into ``out`` with no intermediate ``bytes``. Measured here at
            about 2x s3fs (benchmarks/RESULTS.md, "Large samples"). The client is built from
            the same options as :class:`~shardkit.storage.store.Store` (see :func:`s3_client`).
``fsspec``  any filesystem: ``fs.open`` + ``seek`` + ``readinto`` (local files read straight
            into ``out``; s3fs copies each part once).

Every byte that lands in a buffer is counted in :data:`TOTAL` (per process) and in the
optional ``counter``, so callers and tests can check what a partial read really moved.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Literal

import numpy as np

from shardkit.errors import ConfigError, ShardkitError
from shardkit.storage.options import boto_settings
from shardkit.storage.retry import ShortRead, attempts_for, is_short, is_transient, pause_before_retry, translate
from shardkit.storage.s3client import s3_client
from shardkit.storage.store import Store

__all__ = ["ByteCounter", "TOTAL", "read_into", "read_range", "s3_client", "choose_transport", "DEFAULT_PART_SIZE"]

log = logging.getLogger(__name__)

DEFAULT_PART_SIZE = 16 * 2**20
DEFAULT_CONCURRENCY = 8
_READ_CHUNK = 4 * 2**20  # one readinto call; small enough to count progress for resume

Transport = Literal["auto", "boto3", "fsspec"]

class ByteCounter:
    """Thread-safe counts of bytes landed in buffers and of GET requests made."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self.bytes = 0
        self.requests = 0

    def add(self, nbytes: int = 0, requests: int = 0) -> None:
        with self._mu:
            self.bytes += nbytes
            self.requests += requests

    def snapshot(self) -> dict[str, int]:
        with self._mu:
            return {"bytes": self.bytes, "requests": self.requests}

    def reset(self) -> None:
        with self._mu:
            self.bytes = self.requests = 0


TOTAL = ByteCounter()
"""Every byte :func:`read_into` moved in this process (reset it in tests if you like)."""


def choose_transport(store: Store, transport: Transport = "auto") -> str:
    """``"boto3"`` for S3 URLs whose options boto3 can mirror, else ``"fsspec"``."""
    if transport not in ("auto", "boto3", "fsspec"):
        raise ConfigError(f"transport: expected 'auto', 'boto3' or 'fsspec', got {transport!r}")
    is_s3 = store.url.startswith(("s3://", "s3a://"))
    if transport == "boto3":
        if not is_s3:
            raise ConfigError(f"transport='boto3' needs an s3:// URL, got {store.url}")
        return "boto3"
    if transport == "fsspec" or not is_s3:
        return "fsspec"
    try:
        import boto3  # noqa: F401
    except ImportError:  # pragma: no cover - boto3 is a dependency
        return "fsspec"
    return "boto3" if boto_settings(store.storage_options) is not None else "fsspec"


# --------------------------------------------------------------------------- one part


class _Part:
    """Bytes ``[pos, end)`` of the object, landing in ``view[pos - base:end - base]``."""

    def __init__(self, view: memoryview, base: int, start: int, end: int, counter: ByteCounter | None) -> None:
        self.view, self.base = view, base
        self.pos, self.end = start, end
        self.counter = counter

    def dest(self, nbytes: int) -> memoryview:
        """Where the next ``nbytes`` (at most) go."""
        lo = self.pos - self.base
        return self.view[lo: lo + min(nbytes, self.end - self.pos)]

    def landed(self, n: int) -> None:
        self.pos += n
        TOTAL.add(n)
        if self.counter is not None:
            self.counter.add(n)

    def requested(self) -> None:
        TOTAL.add(requests=1)
        if self.counter is not None:
            self.counter.add(requests=1)


Reader = Callable[[_Part], None]


def _run_part(part: _Part, read: Reader, what: str, store: Store) -> None:
    """Fetch one part; after a transient fault resume from the byte it reached (unless the
    object itself ends before the part does: IntegrityError)."""
    failures = 0
    while part.pos < part.end:
        pos0 = part.pos
        try:
            part.requested()
            read(part)
        except Exception as exc:  # noqa: BLE001 - classified below
            if isinstance(exc, ShardkitError):
                raise
            if is_short(exc):
                store.check_extent(what, part.end)
            failures = 1 if part.pos > pos0 else failures + 1  # progress renews the fault budget
            budget = attempts_for(exc)
            if failures < budget and is_transient(exc):
                pause_before_retry(exc, what, store.where, failures, budget)
                continue
            raise translate(exc, what, store.where) from exc


def _reporting(on_part: Callable[[int, int], None], base: int) -> Callable[[_Part, Reader, str, Store], None]:
    def run(part: _Part, read: Reader, what: str, store: Store) -> None:
        lo = part.pos - base
        _run_part(part, read, what, store)
        on_part(lo, part.end - base)
    return run


def _fill(part: _Part, readinto: Callable[[memoryview], int | None], what: str) -> None:
    """Call ``readinto`` until the part is complete; an empty read is a truncated body."""
    while part.pos < part.end:
        n = readinto(part.dest(_READ_CHUNK))
        if not n:
            raise ShortRead(f"truncated body of {what} at byte {part.pos}")
        part.landed(n)


def _boto_reader(client: Any, bucket: str, key: str, extra: dict[str, Any]) -> Reader:
    def read(part: _Part) -> None:
        resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={part.pos}-{part.end - 1}", **extra)
        body = resp["Body"]
        raw = getattr(body, "_raw_stream", None)
        fp = getattr(raw, "_fp", None)
        done = False
        try:
            length = int(resp.get("ContentLength", part.end - part.pos))
            if length != part.end - part.pos:
                raise ShortRead(f"ranged GET of {key} returned {length} bytes, asked {part.end - part.pos}")
            if fp is not None and hasattr(fp, "readinto") and hasattr(raw, "release_conn"):
                # http.client's readinto moves bytes socket -> out with no temporary bytes;
                # botocore's StreamingBody.read would allocate and copy every chunk.
                _fill(part, fp.readinto, key)
            else:  # pragma: no cover - a botocore without urllib3 underneath: one copy per chunk
                def copy(dest: memoryview) -> int:
                    data = body.read(len(dest))
                    dest[:len(data)] = data
                    return len(data)
                _fill(part, copy, key)
            done = True
        finally:
            if done and raw is not None and hasattr(raw, "release_conn"):
                raw.release_conn()  # body fully read: the connection goes back to the pool
            else:
                body.close()
    return read


def _fsspec_reader(store: Store, rel: str) -> Reader:
    fs = store.fs
    path = store.path(rel)

    def read(part: _Part) -> None:
        with fs.open(path, "rb", block_size=0, cache_type="none") as src:
            src.seek(part.pos)
            readinto = getattr(src, "readinto", None)
            if readinto is None:  # pragma: no cover - file objects without readinto
                def readinto(dest: memoryview) -> int:
                    data = src.read(len(dest))
                    dest[:len(data)] = data
                    return len(data)
            _fill(part, readinto, rel)
    return read


# --------------------------------------------------------------------------- public


def _as_bytes_view(out: memoryview | np.ndarray | bytearray) -> memoryview:
    if isinstance(out, np.ndarray):
        if not out.flags.c_contiguous:
            raise ConfigError("read_into: out must be a C-contiguous array")
        if not out.flags.writeable:
            raise ConfigError("read_into: out is read-only")
        out = out.reshape(-1).view(np.uint8).data
    view = memoryview(out)
    if view.readonly:
        raise ConfigError("read_into: out is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def read_into(store: Store, path: str, start: int, end: int, out: memoryview | np.ndarray | bytearray,
              part_size: int = DEFAULT_PART_SIZE, concurrency: int = DEFAULT_CONCURRENCY, *,
              transport: Transport = "auto", counter: ByteCounter | None = None,
              on_part: Callable[[int, int], None] | None = None) -> None:
    """Read bytes ``[start, end)`` of ``store``'s object ``path`` into ``out`` (exactly that many bytes).

    Args:
        store: the dataset root; ``path`` is relative to it (``shards/shard-000001.tar``).
        start, end: byte range of the object.
        out: a writable buffer of exactly ``end - start`` bytes (a ``bytearray``, a
            memoryview, or a C-contiguous numpy array of any dtype).
        part_size: bytes per ranged GET; ranges up to this size use one GET in the calling thread.
        concurrency: threads for the parts of a larger range.
        transport: ``"auto"``, ``"boto3"`` (S3 only) or ``"fsspec"``.
        counter: also count landed bytes and requests here.
        on_part: called as ``on_part(lo, hi)`` (offsets into ``out``) in the thread that read
            each part, once all of it has landed; parts start at multiples of ``part_size``.

    Raises:
        ConfigError: bad arguments or ``out`` of the wrong size.
        StorageError: a permanent fault, or transient faults that outlasted the retries (names the object).
    """
    if start < 0 or end < start:
        raise ConfigError(f"read_into: bad range [{start}, {end}) of {path}")
    if part_size <= 0 or concurrency <= 0:
        raise ConfigError(f"read_into: part_size and concurrency must be positive, got {part_size}, {concurrency}")
    view = _as_bytes_view(out)
    if len(view) != end - start:
        raise ConfigError(f"read_into: out holds {len(view)} bytes, range [{start}, {end}) of {path} is {end - start}")
    if end == start:
        return
    kind = choose_transport(store, transport)
    if kind == "boto3":
        bucket, key = store.bucket_key(path)
        extra = (boto_settings(store.storage_options) or {}).get("get_extra") or {}
        read = _boto_reader(s3_client(store.storage_options, max_pool=concurrency), bucket, key, extra)
    else:
        read = _fsspec_reader(store, path)
    bounds = list(range(start, end, part_size)) + [end]
    parts = [_Part(view, start, a, b, counter) for a, b in zip(bounds[:-1], bounds[1:])]
    run = _run_part if on_part is None else _reporting(on_part, start)
    if len(parts) == 1 or concurrency == 1:
        for part in parts:
            run(part, read, path, store)
        return
    # A pool per call: threads are cheap next to 16 MB parts, and none outlive the read.
    with ThreadPoolExecutor(max_workers=min(concurrency, len(parts)), thread_name_prefix="shardkit-ranged") as pool:
        futures = [pool.submit(run, part, read, path, store) for part in parts]
        try:
            for fut in futures:
                fut.result()
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise


def read_range(store: Store, path: str, start: int, end: int, part_size: int = DEFAULT_PART_SIZE,
               concurrency: int = DEFAULT_CONCURRENCY, *, transport: Transport = "auto",
               counter: ByteCounter | None = None) -> np.ndarray:
    """Bytes ``[start, end)`` of ``path`` as a fresh ``uint8`` array (see :func:`read_into`)."""
    out = np.empty(max(0, end - start), dtype=np.uint8)
    read_into(store, path, start, end, out, part_size, concurrency, transport=transport, counter=counter)
    return out
