"""Ranged reads of one object into buffers the caller owns: the one read-into protocol.

A :class:`RangeReader` (in the spirit of fsspec's ``Fetcher = Callable[[int, int], bytes]``,
but filling the caller's memory) is what the node cache downloads shards with and what the
read side reads samples with. Two readers implement it:

:class:`RangedReader`  ``parallel``: splits a range into parts of ``part_size`` bytes, fetched
                       by up to ``concurrency`` threads, each writing into its own slice of
                       ``out``; no part is ever concatenated, so a 300 MB sample costs one
                       300 MB allocation (the caller's) plus one copy from the socket at most.
:class:`StreamReader`  sequential: one request at a time, front to back; each call returns what
                       one read gave and the next call continues the same request.

Both resume a request that fails with a transient fault from the byte it reached, over boto3
or fsspec (:mod:`shardkit.storage.resumable`, :func:`choose_transport`); a permanent fault
raises one StorageError naming the object, and a body that ends early because the object
itself is shorter raises IntegrityError.

Every byte a :class:`RangedReader` lands is counted in :data:`TOTAL` (per process), and every
reader counts into an optional :class:`ByteCounter`, so callers and tests can check what a
read really moved.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Literal, Protocol, runtime_checkable

import numpy as np

from shardkit.errors import ConfigError, IntegrityError
from shardkit.storage.options import boto_settings
from shardkit.storage.resumable import Count, Cursor, Opener, opener
from shardkit.storage.s3client import have_boto3, s3_client
from shardkit.storage.store import Store

__all__ = ["RangeReader", "PartCallback", "RangedReader", "StreamReader", "ByteCounter", "TOTAL", "Transport",
           "choose_transport", "prepare", "read_fully", "read_into", "read_range", "DEFAULT_PART_SIZE",
           "DEFAULT_CONCURRENCY"]

DEFAULT_PART_SIZE = 16 * 2**20
DEFAULT_CONCURRENCY = 8
_READ_CHUNK = 4 * 2**20  # one readinto call of a part: small enough to count progress for resume

Transport = Literal["auto", "boto3", "fsspec"]

PartCallback = Callable[[int, int], None]
"""``on_part(lo, hi)``: object bytes ``[lo, hi)`` are all in the caller's buffer now."""
_REPORT_ALIGN = 4096  # a part's progress is reported in pieces starting at multiples of this (O_DIRECT writes)


@runtime_checkable
class RangeReader(Protocol):
    """Reads byte ranges of one object into buffers the caller owns.

    ``read_into(start, out)`` puts bytes of the object from offset ``start`` at the front of
    ``out`` and returns how many, like ``io.RawIOBase.readinto``. A reader whose
    :attr:`parallel` is True fills all of ``out`` (parts land out of order, from several
    threads); a sequential reader may return fewer bytes, what one read of its open request
    gave, and a call from ``start + n`` continues that request. ``0`` means the object ends
    at ``start``.
    """

    @property
    def parallel(self) -> bool:
        """Whether parts of ``out`` land out of order (parallel requests): a failed read then
        leaves nothing worth keeping in ``out``, and a caller gives it the whole range at once.
        False: bytes land front to back, so what landed before a fault is a valid prefix."""
        ...

    def read_into(self, start: int, out: memoryview, on_part: PartCallback | None = None) -> int:
        """Read object bytes from ``start`` into ``out``.

        Args:
            start: object offset of ``out[0]``.
            out: a writable, 1-D byte view.
            on_part: told ``(lo, hi)`` (object offsets) of each part once all of it is in
                ``out``, from the thread that read it. A reader may not report parts: the
                caller then takes the bytes it returned as landed when it returns.

        Returns:
            Bytes put at the front of ``out``: all of them for a parallel reader.

        Raises:
            StorageError: a permanent fault, or transient faults that outlasted the retries.
            IntegrityError: the object is shorter than the range asked for.
        """
        ...


class ByteCounter:
    """Thread-safe counts of bytes landed in buffers and of GET requests made."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self.bytes = 0
        self.requests = 0

    def add(self, nbytes: int = 0, requests: int = 0) -> None:
        """Count ``nbytes`` more bytes and ``requests`` more requests.

        Args:
            nbytes: bytes landed.
            requests: requests made.
        """
        with self._mu:
            self.bytes += nbytes
            self.requests += requests

    def snapshot(self) -> dict[str, int]:
        """The counts so far.

        Returns:
            ``{"bytes": ..., "requests": ...}``.
        """
        with self._mu:
            return {"bytes": self.bytes, "requests": self.requests}

    def reset(self) -> None:
        """Set both counts back to 0."""
        with self._mu:
            self.bytes = self.requests = 0


TOTAL = ByteCounter()
"""Every byte a :class:`RangedReader` moved in this process (reset it in tests if you like)."""


def choose_transport(store: Store, transport: Transport = "auto") -> str:
    """The transport ranged reads of ``store`` use.

    Args:
        store: the dataset root.
        transport: ``"auto"``, ``"boto3"`` (S3 only) or ``"fsspec"``.

    Returns:
        ``"boto3"`` for S3 URLs whose options boto3 can mirror (with ``"auto"``), else ``"fsspec"``.

    Raises:
        ConfigError: an unknown transport, or ``"boto3"`` for a URL that is not S3.
    """
    if transport not in ("auto", "boto3", "fsspec"):
        raise ConfigError(f"transport: expected 'auto', 'boto3' or 'fsspec', got {transport!r}")
    is_s3 = store.url.startswith(("s3://", "s3a://"))
    if transport == "boto3":
        if not is_s3:
            raise ConfigError(f"transport='boto3' needs an s3:// URL, got {store.url}")
        return "boto3"
    if transport == "fsspec" or not is_s3 or not have_boto3():
        return "fsspec"
    return "boto3" if boto_settings(store.storage_options) is not None else "fsspec"


def prepare(store: Store, transport: Transport = "auto") -> None:
    """Build this process's S3 client for ``store`` now, if its ranged reads go through boto3.

    DataLoader workers forked afterwards make theirs from the service model it parsed (see
    :mod:`shardkit.storage.s3client`): a cold epoch's first reads in each worker then do not
    wait for a client of their own to be built from scratch.

    Args:
        store: the dataset root.
        transport: as for :func:`choose_transport`.

    Raises:
        ConfigError: as :func:`choose_transport`.
    """
    if choose_transport(store, transport) == "boto3":
        s3_client(store.storage_options, max_pool=DEFAULT_CONCURRENCY)


# --------------------------------------------------------------------------- the readers


class StreamReader:
    """A sequential :class:`RangeReader` of bytes ``[0, end)`` of one object: one request at a
    time, front to back; each :meth:`read_into` returns what one read gave.

    Args:
        store: the dataset root.
        path: the object, relative to the root.
        end: the object's size (as the manifest says: a shorter object is an IntegrityError).
        counter: also count landed bytes and requests here.
    """

    parallel = False

    def __init__(self, store: Store, path: str, end: int, *, counter: ByteCounter | None = None) -> None:
        self.store, self.path, self.end = store, path, end
        self._count: Count | None = counter.add if counter is not None else None
        self._cursor: Cursor | None = None

    def read_into(self, start: int, out: memoryview, on_part: PartCallback | None = None) -> int:
        """Bytes from ``start`` into the front of ``out`` (see :class:`RangeReader`).

        Args:
            start: object offset of ``out[0]``.
            out: a writable, 1-D byte view.
            on_part: told ``(start, start + n)`` once they landed.

        Returns:
            Bytes read, at least one unless ``start`` is at ``end``.

        Raises:
            StorageError: a permanent fault, or transient faults that outlasted the retries.
            IntegrityError: the object ends before ``end``.
        """
        want = min(len(out), self.end - start)
        if want <= 0:
            return 0
        if self._cursor is None:  # on first use, so a reader made ahead costs no client or filesystem
            self._cursor = Cursor(opener(self.store, self.path, self.store.boto3_client()), self.store,
                                  self.path, self.end, self._count)
        n = self._cursor.read(start, out[:want])
        if on_part is not None:
            on_part(start, start + n)
        return n


class RangedReader:
    """A parallel :class:`RangeReader`: ranged requests of ``part_size`` bytes, ``concurrency``
    at a time, each written straight into its own slice of ``out``.

    Args:
        store: the dataset root.
        path: the object, relative to the root.
        part_size: bytes per ranged GET; a range up to this size is one GET in the calling thread.
        concurrency: threads for the parts of a larger range.
        transport: ``"auto"``, ``"boto3"`` (S3 only) or ``"fsspec"``.
        counter: also count landed bytes and requests here.

    Raises:
        ConfigError: a bad transport, or a part size or concurrency that is not positive.
    """

    parallel = True

    def __init__(self, store: Store, path: str, *, part_size: int = DEFAULT_PART_SIZE,
                 concurrency: int = DEFAULT_CONCURRENCY, transport: Transport = "auto",
                 counter: ByteCounter | None = None) -> None:
        if part_size <= 0 or concurrency <= 0:
            raise ConfigError(f"read_into: part_size and concurrency must be positive, got {part_size}, {concurrency}")
        self.store, self.path = store, path
        self.part_size, self.concurrency = part_size, concurrency
        self.transport = choose_transport(store, transport)
        self._counter = counter
        self._open: Opener | None = None

    def read_into(self, start: int, out: memoryview, on_part: PartCallback | None = None) -> int:
        """Fill all of ``out`` with object bytes ``[start, start + len(out))``.

        Args:
            start: object offset of ``out[0]``.
            out: a writable, 1-D byte view.
            on_part: told ``(lo, hi)`` (object offsets) of each piece of a part once all of it
                landed, in the thread that read it, pieces of a part in order: parts start at
                ``start`` plus multiples of ``part_size``, and a piece ends at the part's end
                or, every few MiB of it, at ``start`` plus a multiple of 4096 (a reader then
                uses the first bytes of a part before its last ones arrive).

        Returns:
            ``len(out)``.

        Raises:
            StorageError: a permanent fault, or transient faults that outlasted the retries.
            IntegrityError: the object ends before the range does.
        """
        end = start + len(out)
        if end == start:
            return 0
        if self._open is None:  # on first use, so a reader made ahead costs no client or filesystem
            client = s3_client(self.store.storage_options, max_pool=self.concurrency) if self.transport == "boto3" else None
            self._open = opener(self.store, self.path, client)
        open_body = self._open
        bounds = list(range(start, end, self.part_size)) + [end]
        parts = list(zip(bounds[:-1], bounds[1:]))
        if len(parts) == 1 or self.concurrency == 1:
            for lo, hi in parts:
                self._read_part(open_body, out, start, lo, hi, on_part)
            return len(out)
        # A pool per call: threads are cheap next to 16 MB parts, and none outlive the read.
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(parts)), thread_name_prefix="shardkit-ranged") as pool:
            futures = [pool.submit(self._read_part, open_body, out, start, lo, hi, on_part) for lo, hi in parts]
            try:
                for fut in futures:
                    fut.result()
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise
        return len(out)

    def _count(self, nbytes: int, requests: int) -> None:
        TOTAL.add(nbytes, requests)
        if self._counter is not None:
            self._counter.add(nbytes, requests)

    def _read_part(self, open_body: Opener, out: memoryview, base: int, lo: int, hi: int,
                   on_part: PartCallback | None) -> None:
        """Object bytes ``[lo, hi)`` into ``out[lo - base:hi - base]``, resumed after faults;
        ``on_part`` hears of them piece by piece (each piece at least ``_READ_CHUNK`` bytes)."""
        cursor = Cursor(open_body, self.store, self.path, hi, self._count)
        pos = told = lo
        while pos < hi:
            pos += cursor.read(pos, out[pos - base:pos - base + min(_READ_CHUNK, hi - pos)])
            if on_part is not None and pos < hi and pos - told >= _READ_CHUNK:
                cut = pos - (pos - base) % _REPORT_ALIGN  # pieces start aligned as the part does
                on_part(told, cut)
                told = cut
        if on_part is not None:
            on_part(told, hi)


# --------------------------------------------------------------------------- helpers


def read_fully(reader: RangeReader, start: int, out: memoryview, what: str) -> None:
    """Call ``reader.read_into`` until all of ``out`` holds object bytes from ``start``.

    Args:
        reader: the object's reader.
        start: object offset of ``out[0]``.
        out: a writable, 1-D byte view.
        what: the object, for the error.

    Raises:
        IntegrityError: the object ended before ``out`` was full.
        Whatever ``reader.read_into`` raises.
    """
    done = 0
    while done < len(out):
        n = reader.read_into(start + done, out[done:])
        if n <= 0:
            raise IntegrityError(f"{what} ended at byte {start + done}, before byte {start + len(out)}")
        done += n


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
              transport: Transport = "auto", counter: ByteCounter | None = None) -> None:
    """Read bytes ``[start, end)`` of ``store``'s object ``path`` into ``out`` (exactly that many
    bytes) with a :class:`RangedReader`.

    Args:
        store: the dataset root; ``path`` is relative to it (``shards/shard-000001.tar``).
        path: the object.
        start: first byte of the range.
        end: the byte after the range.
        out: a writable buffer of exactly ``end - start`` bytes (a ``bytearray``, a
            memoryview, or a C-contiguous numpy array of any dtype).
        part_size: bytes per ranged GET; ranges up to this size use one GET in the calling thread.
        concurrency: threads for the parts of a larger range.
        transport: ``"auto"``, ``"boto3"`` (S3 only) or ``"fsspec"``.
        counter: also count landed bytes and requests here.

    Raises:
        ConfigError: bad arguments or ``out`` of the wrong size.
        StorageError: a permanent fault, or transient faults that outlasted the retries (names the object).
        IntegrityError: the object ends before ``end``.
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
    RangedReader(store, path, part_size=part_size, concurrency=concurrency, transport=transport,
                 counter=counter).read_into(start, view)


def read_range(store: Store, path: str, start: int, end: int, part_size: int = DEFAULT_PART_SIZE,
               concurrency: int = DEFAULT_CONCURRENCY, *, transport: Transport = "auto",
               counter: ByteCounter | None = None) -> np.ndarray:
    """Bytes ``[start, end)`` of ``path`` as a fresh ``uint8`` array (see :func:`read_into`).

    Args:
        store: the dataset root.
        path: the object, relative to the root.
        start: first byte of the range.
        end: the byte after the range.
        part_size: bytes per ranged GET.
        concurrency: threads for the parts of a larger range.
        transport: ``"auto"``, ``"boto3"`` (S3 only) or ``"fsspec"``.
        counter: also count landed bytes and requests here.

    Returns:
        A new array of ``end - start`` bytes.

    Raises:
        ConfigError: bad arguments.
        StorageError: a permanent fault, or transient faults that outlasted the retries.
        IntegrityError: the object ends before ``end``.
    """
    out = np.empty(max(0, end - start), dtype=np.uint8)
    read_into(store, path, start, end, out, part_size, concurrency, transport=transport, counter=counter)
    return out
