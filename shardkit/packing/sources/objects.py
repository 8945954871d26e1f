"""A source's files at fsspec URLs (``s3://``, ``gs://``, ...): reading them, and reading ahead.

Sources hold URLs and storage options only (they are pickled into Ray tasks); each process
opens its own :class:`~shardkit.storage.store.Store` per bucket on first use, so every read
goes through shardkit's storage options (the ``AWS_*`` environment, endpoint, timeouts),
retries and error translation, and no message names a credential.

A pack task of many small objects must not wait for one GET at a time: :class:`ReadAhead`
keeps up to :data:`READ_AHEAD` objects (and at most :data:`READ_AHEAD_BYTES`) in flight on a
small thread pool, in the order of the plan, and hands them out in that same order, so the
shards are byte-identical to a sequential read.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, Callable, Generic, Iterator, Sequence, TypeVar

from shardkit.errors import SourceError, SourceNotFoundError, StorageError
from shardkit.format.streams import iter_exact
from shardkit.packing.sample import FieldValue, StreamedField
from shardkit.packing.sources.base import SourceItem
from shardkit.storage.store import Store
from shardkit.storage.urls import redact_url

__all__ = ["READ_AHEAD", "READ_AHEAD_BYTES", "Objects", "ReadAhead", "ReadsAhead", "is_url", "join_url"]

#: Objects a task keeps in flight ahead of the one it packs.
READ_AHEAD = 16
#: ... and at most this many bytes of them (by the items' planned sizes).
READ_AHEAD_BYTES = 64 * 2**20
# Objects up to this size are fetched whole with one GET; larger ones stream in _CHUNK pieces
# (the same threshold as local files: shardkit.packing.sources.files.STREAM_THRESHOLD).
_WHOLE = 16 * 2**20
_CHUNK = 8 * 2**20
# Block size of file objects opened for random access (HDF5, zip, .npy headers): one GET each.
_BLOCK = 2 * 2**20

T = TypeVar("T")


def is_url(text: str) -> bool:
    """True for a remote fsspec URL (``s3://...``); ``file://`` URLs and paths are local.

    Args:
        text: a path or URL.

    Returns:
        Whether it names a remote object.
    """
    return "://" in text and not text.startswith("file://")


def join_url(base: str, rel: str) -> str:
    """``rel`` under the URL ``base`` (one ``/`` between them).

    Args:
        base: a folder URL.
        rel: a relative posix path.

    Returns:
        The URL.
    """
    return f"{base.rstrip('/')}/{rel}"


class Objects:
    """Reads objects at fsspec URLs with one set of storage options, opening a Store per
    bucket in each process (not pickled: a copy in a Ray task opens its own).

    Args:
        storage_options: fsspec options (credentials, endpoint); never shown.
    """

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options) if storage_options else None
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Options only: stores hold sockets and event loops."""
        return {"storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy opens its own stores."""
        self.__init__(state["storage_options"])  # type: ignore[misc]

    def locate(self, url: str) -> tuple[Store, str]:
        """The Store of ``url``'s bucket and the object's path under it.

        Args:
            url: ``scheme://bucket/key``.

        Returns:
            (store, relative key).
        """
        scheme, _, rest = url.partition("://")
        bucket, _, key = rest.partition("/")
        root = f"{scheme}://{bucket}"
        with self._lock:
            store = self._stores.get(root)
            if store is None:
                store = self._stores[root] = Store(root, self.storage_options)
        return store, key

    def call(self, url: str, fn: Callable[[Any, str], T]) -> T:
        """Run ``fn(fs, path)`` for ``url`` with the store's retries; a missing object is a
        SourceNotFoundError, any other fault a SourceError, each naming the URL.

        Args:
            url: the object or folder.
            fn: the call, given the filesystem and the object's path on it.

        Returns:
            What ``fn`` returned.

        Raises:
            SourceNotFoundError: no such object.
            SourceError: the store failed (translated, no secrets).
        """
        store, key = self.locate(url)
        missing = False

        def once() -> Any:
            nonlocal missing
            try:
                return fn(store.fs, store.path(key))
            except FileNotFoundError:
                missing = True
                return None
        try:
            out = store.call(once, redact_url(url))
        except StorageError as exc:
            raise SourceError(f"cannot read {redact_url(url)}: {exc}") from exc
        if missing:
            raise SourceNotFoundError(f"{redact_url(url)} does not exist")
        return out  # type: ignore[no-any-return]

    def size(self, url: str) -> int:
        """The size of an object.

        Args:
            url: the object.

        Returns:
            Its size in bytes.

        Raises:
            SourceNotFoundError: no such object.
            SourceError: the store failed.
        """
        return int(self.call(url, lambda fs, p: fs.size(p)))

    def read(self, url: str, at_most: int) -> FieldValue:
        """An object as a field value: its bytes with one GET, or a StreamedField when it is
        over 16 MiB (read in pieces when the tar is written).

        Args:
            url: the object.
            at_most: an upper bound of its size (the item's planned bytes): objects surely
                small are fetched without asking their size first.

        Returns:
            The bytes or a StreamedField.

        Raises:
            SourceNotFoundError: no such object.
            SourceError: the store failed.
        """
        if at_most > _WHOLE:
            size = self.size(url)
            if size > _WHOLE:
                return StreamedField(size, lambda: self._chunks(url, size))
        return bytes(self.call(url, lambda fs, p: fs.cat_file(p)))

    def _chunks(self, url: str, size: int) -> Iterator[bytes]:
        for start in range(0, size, _CHUNK):
            end = min(start + _CHUNK, size)
            piece = self.call(url, lambda fs, p: fs.cat_file(p, start=start, end=end))  # noqa: B023 - called at once
            if len(piece) != end - start:
                raise SourceError(f"{redact_url(url)}: changed while packed (read {len(piece)} bytes at {start}, "
                                  f"expected {end - start})")
            yield piece

    def open(self, url: str, block_size: int = _BLOCK) -> BinaryIO:
        """``url`` as a seekable binary file (ranged GETs of ``block_size``, read ahead).

        Args:
            url: the object.
            block_size: bytes per GET.

        Returns:
            The open file.

        Raises:
            SourceNotFoundError: no such object.
            SourceError: the store failed.
        """
        return self.call(url, lambda fs, p: fs.open(p, "rb", block_size=block_size, cache_type="readahead"))

    def chunks(self, url: str, offset: int, size: int, chunk: int) -> Iterator[bytes]:
        """``size`` bytes of ``url`` from ``offset``, in pieces of at most ``chunk``.

        Args:
            url: the object.
            offset: the first byte.
            size: how many bytes.
            chunk: the largest piece.

        Yields:
            The pieces.

        Raises:
            SourceError: the object is missing or shorter.
        """
        with self.open(url, block_size=chunk) as f:
            f.seek(offset)
            yield from iter_exact(f, size, f"{redact_url(url)} at byte {offset}", chunk)


class ReadAhead(Generic[T]):
    """Fetches a task's items ahead of use on a few threads, handing them out in order.

    :meth:`start` gives it the task's items; :meth:`get` returns one item's fetch result
    (re-raising its error), after which the next items are fetched. An item asked for out of
    order (a shard rewritten without a skipped sample) restarts the window there. Without
    :meth:`start`, :meth:`get` just fetches.

    Args:
        fetch: reads one item (called on the pool's threads).
        depth: items in flight at most.
        max_bytes: and at most these planned bytes (one item always goes, however big).
    """

    def __init__(self, fetch: Callable[[SourceItem], T], depth: int = READ_AHEAD,
                 max_bytes: int = READ_AHEAD_BYTES) -> None:
        self.fetch, self.depth, self.max_bytes = fetch, depth, max_bytes
        self._items: Sequence[SourceItem] = ()
        self._index: dict[str, int] = {}
        self._next = 0
        self._pending: OrderedDict[str, tuple[Future[T], int]] = OrderedDict()
        self._bytes = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def start(self, items: Sequence[SourceItem]) -> None:
        """Read ``items`` ahead from now on, in this order.

        Args:
            items: a task's items, in the order it packs them.
        """
        self.close()
        self._items = items
        self._index = {it.key: i for i, it in enumerate(items)}
        self._next = 0
        self._fill()

    def get(self, item: SourceItem) -> T:
        """``item``'s fetch result.

        Args:
            item: the next item the task packs.

        Returns:
            What ``fetch`` returned for it.

        Raises:
            Exception: what ``fetch`` raised for it.
        """
        entry = self._pending.pop(item.key, None)
        if entry is None:
            at = self._index.get(item.key)
            if at is not None:  # out of order: drop the window, go on from here
                self._drop()
                self._next = at + 1
                self._fill()
            return self.fetch(item)
        self._bytes -= entry[1]
        self._fill()
        return entry[0].result()

    def _fill(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's threads are not ours
            self._pool, self._pending, self._bytes, self._pid = None, OrderedDict(), 0, os.getpid()
        while self._next < len(self._items) and len(self._pending) < self.depth:
            item = self._items[self._next]
            if self._pending and self._bytes + item.nbytes > self.max_bytes:
                break
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="shardkit-read")
            self._pending[item.key] = (self._pool.submit(self.fetch, item), item.nbytes)
            self._bytes += item.nbytes
            self._next += 1

    def _drop(self) -> None:
        for fut, _ in self._pending.values():
            fut.cancel()
        self._pending.clear()
        self._bytes = 0

    def close(self) -> None:
        """Drop what was read ahead and stop the threads (a later :meth:`start` makes new ones)."""
        self._drop()
        self._items, self._index, self._next = (), {}, 0
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None


class ReadsAhead:
    """A source that reads a task's objects ahead through its ``_fetch`` (folders, file lists).

    The :class:`ReadAhead` is made on first use, so a copy pickled into a task (without it)
    makes its own; ``task_done`` is the packer's hook that stops it.
    """

    _ahead: ReadAhead[Any] | None = None

    def _fetch(self, item: SourceItem) -> Any:  # pragma: no cover - defined by each source
        raise NotImplementedError

    def _read_ahead(self) -> ReadAhead[Any]:
        if self._ahead is None:
            self._ahead = ReadAhead(self._fetch)
        return self._ahead

    def task_done(self) -> None:
        """The packer's hook after a task: stop reading ahead."""
        if self._ahead is not None:
            self._ahead.close()
