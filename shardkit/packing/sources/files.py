"""Sources over a folder of plain files: a keyed folder, an ImageFolder; and reading one file.

Files are listed with their sizes (one ``stat`` each, no data read) so the planner can split
work by bytes; data is read inside pack tasks. Large files stream into the tar in chunks.
The root may also be a URL prefix (``s3://raw/train/``): its objects are listed many prefixes at
once (:mod:`~shardkit.packing.sources.listing`) and read ahead within each task
(:class:`~shardkit.packing.sources.objects.ReadAhead`), packing to the same bytes as the same
folder on disk.
(A CSV/Parquet file list is :mod:`shardkit.packing.sources.filelist`.)
"""

from __future__ import annotations

import io
import json
import logging
import os
from itertools import chain
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from PIL import Image, UnidentifiedImageError

from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.format.fields import IMAGE_EXTS
from shardkit.packing.sample import FieldValue, PackSample, StreamedField, safe_key
from shardkit.packing.sources.base import ListingSkips, SourceItem, item_bytes
from shardkit.packing.sources.image_header import header_ok
from shardkit.packing.sources.keys import unique_keys
from shardkit.packing.sources.listing import walk_objects
from shardkit.packing.sources.objects import Objects, ReadAhead, ReadsAhead, is_url, join_url
from shardkit.packing.sources.walk import walk_in_order

__all__ = ["STREAM_THRESHOLD", "FolderRoot", "FolderSource", "check_image", "check_root", "ensure_unique", "text_name",
           "read_field"]

log = logging.getLogger(__name__)

# Files up to this size are read whole; larger ones stream into the tar in _CHUNK pieces.
STREAM_THRESHOLD = 16 * 2**20
_CHUNK = 8 * 2**20


def _sample_entry(name: str) -> str | None:
    """How a keyed folder's file sorts in its directory (the first dot made a NUL: by key,
    then name), or None if the name is no ``<key>.<field>``."""
    stem, dot, field = name.partition(".")
    if not dot or not stem or not field:
        return None
    return name.replace(".", "\0", 1)




def read_field(path: str | os.PathLike[str]) -> FieldValue:
    """A file as a field value: its bytes, or a StreamedField for a file over STREAM_THRESHOLD.

    One open and an fstat of it, unbuffered: a separate stat and a buffered reader's setup cost
    small files much of their read time.

    Args:
        path: the file.

    Returns:
        The bytes, or a StreamedField that reads the file in chunks when the tar is written.

    Raises:
        SourceError: naming the file, when it cannot be opened or read.
    """
    try:
        # Opened even for a big file, so the error names it before a tar member is started.
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size <= STREAM_THRESHOLD:
                return f.readall()
    except OSError as exc:
        raise SourceError(f"cannot read {Path(path)}: {exc.strerror or exc}") from exc

    def chunks() -> Iterator[bytes]:
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                yield block

    return StreamedField(size, chunks)


def _shown(path: str | os.PathLike[str]) -> str:
    """A path or URL as messages name it (``Path`` would fold a URL's ``//``)."""
    return path if isinstance(path, str) and is_url(path) else str(Path(path))


def check_image(path: str | os.PathLike[str], field: str, value: FieldValue,
                opener: Callable[[], BinaryIO] | None = None) -> None:
    """Refuse an image field (by its last extension, as the reader decodes it) that is empty or
    whose header is no image format PIL knows.

    Only the header is parsed (``Image.open`` without ``load``): cheap at pack time, where a
    corrupt file packed as is would end the first training epoch instead.

    Args:
        path: the file the value came from (named in the error; a big file's header is read
            from it).
        field: the field name.
        value: the field's value.
        opener: opens the file for a big (streamed) value's header, for a ``path`` that is
            no local file (an object URL).

    Raises:
        SourceError: naming ``path``, when the image is empty or unreadable.
    """
    if field.rpartition(".")[2] not in IMAGE_EXTS:
        return
    size = value.size if isinstance(value, StreamedField) else len(value)
    if size == 0:
        raise SourceError(f"{_shown(path)} is not a readable image: it is empty (0 bytes)")
    if not isinstance(value, StreamedField) and header_ok(value):
        return  # a plain JPEG or PNG header, checked as PIL would, at a fraction of its cost
    try:
        # A big file streams: PIL reads the header from the file, not the whole of it.
        if not isinstance(value, StreamedField):
            source: Any = io.BytesIO(value)
        else:
            source = opener() if opener is not None else path
        with Image.open(source):
            pass
    except Image.DecompressionBombError:
        pass  # a very large image is still an image: PIL knew its format and its size
    except UnidentifiedImageError as exc:
        raise SourceError(f"{_shown(path)} is not a readable image: its {size} bytes are in no image format "
                          "PIL recognises") from exc
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for corrupt headers
        raise SourceError(f"{_shown(path)} is not a readable image: {type(exc).__name__}: {exc}") from exc


def check_root(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path, once it is known to exist.

    Args:
        path: a source's root folder or file.

    Returns:
        The path.

    Raises:
        SourceNotFoundError: it does not exist.
    """
    root = Path(path)
    if not root.exists():
        raise SourceNotFoundError(f"source {root} does not exist")
    return root


def ensure_unique(items: list[SourceItem], where: str) -> None:
    """Refuse two items with one key.

    Args:
        items: a source's listing.
        where: the source, for the error.

    Raises:
        SourceError: naming the key and both inputs.
    """
    for _ in unique_keys(items, where, lambda: items):
        pass


class FolderRoot(ReadsAhead):
    """A folder source's root, a local folder or a URL prefix: listing and reading its files.

    A remote root's objects are read ahead within a task (``task_items``/``task_done``, the
    packer's hooks); the reader and its threads are never pickled.

    Args:
        root: the folder: a local path, or a URL prefix of objects.
        storage_options: fsspec options for a URL (credentials, endpoint); never shown.
    """

    def __init__(self, root: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> None:
        self.root = str(root).rstrip("/") if is_url(str(root)) else str(root)
        self.remote = is_url(self.root)
        self.storage_options = dict(storage_options) if storage_options and self.remote else None
        self._objects: Objects | None = None
        self._ahead: ReadAhead[Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Paths and options: a copy (a Ray task) opens its own stores and threads."""
        return {**self.__dict__, "_objects": None, "_ahead": None}

    @property
    def objects(self) -> Objects:
        """The reader of a remote root's objects (made on first use, with :attr:`storage_options`)."""
        if self._objects is None:
            self._objects = Objects(self.storage_options)
        return self._objects

    def _walk(self, top: str, entry: Callable[[str], str | None],
              rejected: list[str] | None = None) -> Iterator[tuple[str, int]]:
        """(relative path, size) of the kept files under ``top`` (``root/<top>``), in order."""
        if self.remote:
            return walk_objects(self.objects, join_url(self.root, top) if top else self.root, entry, rejected)
        return walk_in_order(f"{self.root}/{top}" if top else self.root, entry, rejected)

    def _where(self, rel: str) -> str:
        return join_url(self.root, rel) if self.remote else f"{self.root}/{rel}"

    def _read(self, rel: str, at_most: int) -> FieldValue:
        """One file's field value (``at_most``: an upper bound of its size)."""
        return self.objects.read(self._where(rel), at_most) if self.remote else read_field(self._where(rel))

    def _check_image(self, rel: str, field: str, value: FieldValue) -> None:
        where = self._where(rel)
        check_image(where, field, value, (lambda: self.objects.open(where)) if self.remote else None)

    def _fetched(self, item: SourceItem) -> Any:
        """``_fetch(item)``, read ahead in a task over a remote root."""
        if not self.remote:
            return self._fetch(item)
        return self._read_ahead().get(item)

    def task_items(self, items: list[SourceItem]) -> None:
        """The packer's hook at a task's start: read its objects ahead, in this order.

        Args:
            items: the task's items, in order.
        """
        if self.remote:
            self._read_ahead().start(items)


class FolderSource(FolderRoot):
    """A directory whose files group into samples by key: ``a.jpg`` + ``a.cls`` + ``a.json``.

    As in WebDataset, the key is the path up to the first dot of the file name and the field
    is the rest (``dir/a.seg.png`` -> key ``dir/a``, field ``seg.png``); keys are made tar-safe
    with :func:`~shardkit.packing.sample.safe_key` and the original kept in the ``source`` column.

    Args:
        root: the folder: a local path, or a URL prefix of objects (``s3://bucket/train``).
        storage_options: fsspec options for a URL (credentials, endpoint); never shown.
    """

    def __init__(self, root: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(root, storage_options)
        self.listing = ListingSkips()

    def list_items(self) -> list[SourceItem]:
        """One item per sample (its files' names and sizes; no data read), in key order.

        Returns:
            The items; ``ref`` is the JSON list of the sample's files.

        Raises:
            SourceNotFoundError: the folder does not exist.
            SourceError: it holds no files, two files of a sample are one field, two samples
                share a key, or a file name is no ``<key>.<field>`` (unless skipped).
        """
        return list(self.iter_items())

    def iter_items(self) -> Iterator[SourceItem]:
        """:meth:`list_items`, streamed as the folder is walked (the packer plans tasks as they come).

        A bad file name, or two files of one field, is reported once the walk ended (after
        the items before it were yielded), as :meth:`list_items` reports it.

        Returns:
            An iterator of the items, in key order.

        Raises:
            SourceNotFoundError: the folder does not exist.
            SourceError: as :meth:`list_items`.
        """
        return unique_keys(self._items(), self.root, self._items)

    def _items(self) -> Iterator[SourceItem]:
        # One streamed pass over the files in sample order (by key, then path, so that each
        # sample's files are next to each other), no per-file objects kept: a folder of tens
        # of millions of files must list in bounded memory on the driver.
        root: Any = self.root
        if not self.remote:
            root = check_root(self.root)
            if not root.is_dir():
                raise SourceError(f"source {root} is not a directory")
        self.listing.skipped.clear()
        bad: list[str] = []  # names that are no <key>.<field>: reported once listed, in path order
        clash = None  # the first sample with two files of one field: raised after the bad names
        listed = 0
        members: list[tuple[str, int]] = []
        raw = None
        for rel, size in chain(self._walk("", _sample_entry, bad), ((None, 0),)):
            key_of = None if rel is None else _raw_key(rel)
            if members and key_of != raw:
                fields = [_field(r) for r, _ in members]
                if len(set(fields)) < len(fields):  # x.JPG and x.jpg: one would overwrite the other
                    if clash is None:
                        field = next(f for f in fields if fields.count(f) > 1)
                        first, other = (r for (r, _), f in zip(members, fields) if f == field)
                        clash = SourceError(f"{self.root}/{first} and {self.root}/{other} are both field {field!r} "
                                            f"of sample {raw!r} (field names are lowercased); rename one")
                else:
                    # A JSON list of the files: names may hold any character but "/" and NUL.
                    key = safe_key(raw)  # type: ignore[arg-type]
                    listed += 1
                    yield SourceItem(ref=json.dumps([r for r, _ in members]),
                                     nbytes=item_bytes(key, zip(fields, (s for _, s in members))), key=key)
                members = []
            raw = key_of
            members.append((rel, size))  # type: ignore[arg-type]
        for rel in sorted(bad):
            where = self._where(rel)
            self.listing.bad(where, f"cannot group {where} into a sample: name it <key>.<field> "
                                    "(e.g. 0001.jpg), or pack with --on-error skip to leave it out")
        if not listed and clash is None:
            raise SourceError(f"source {root} holds no files")
        if clash is not None:
            raise clash

    def load(self, item: SourceItem) -> PackSample:
        """Read one sample's files.

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample; meta ``source`` is its original key.

        Raises:
            SourceError: a file is unreadable, or an image field is no image.
        """
        fields: dict[str, FieldValue] = {}
        first = None
        for rel, value in self._fetched(item):
            first = first or rel
            name = _field(rel)
            fields[name] = value
            self._check_image(rel, name, value)
        return PackSample(item.key, fields, {"source": text_name(_raw_key(first or item.key))})

    def _fetch(self, item: SourceItem) -> list[tuple[str, FieldValue]]:
        return [(rel, self._read(rel, item.nbytes)) for rel in json.loads(item.ref)]

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json.

        Returns:
            ``{"type": "folder", "path": <the root>}``.
        """
        return {"type": "folder", "path": self.root}

    def labels(self) -> dict[str, int] | None:
        """A keyed folder has no classes.

        Returns:
            None.
        """
        return None


def text_name(name: str) -> str:
    """A file name as valid UTF-8 for the manifest: undecodable bytes (surrogate-escaped by
    ``os.scandir``) become U+FFFD; Arrow refuses lone surrogates.

    Args:
        name: a file name or relative path.

    Returns:
        The text.
    """
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _field(rel: str) -> str:
    """``dir/a.Seg.PNG`` -> ``seg.png``: the (lowercased) WebDataset field of a relative path."""
    return rel.rpartition("/")[2].partition(".")[2].lower()


def _raw_key(rel: str) -> str:
    """``dir/a.seg.png`` -> ``dir/a``: the WebDataset key of a relative path."""
    head, _, name = rel.rpartition("/")
    stem = name.partition(".")[0]
    return f"{head}/{stem}" if head else stem
