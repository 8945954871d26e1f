"""Sources over a folder of plain files: a keyed folder, an ImageFolder; and reading one file.

Files are listed with their sizes (one ``stat`` each, no data read) so the planner can split
work by bytes; data is read inside pack tasks. Large files stream into the tar in chunks.
(A CSV/Parquet file list is :mod:`shardkit.packing.sources.filelist`.)
"""

from __future__ import annotations

import io
import json
import logging
import os
from itertools import chain
from pathlib import Path
from typing import Any, Iterator

from PIL import Image, UnidentifiedImageError

from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.format.fields import IMAGE_EXTS, PACK_IMAGE_EXTS
from shardkit.packing.sample import FieldValue, PackSample, StreamedField, safe_key
from shardkit.packing.sources.base import ListingSkips, SourceItem, item_bytes
from shardkit.packing.sources.walk import walk_in_order

__all__ = ["STREAM_THRESHOLD", "FolderSource", "ImageFolderSource", "check_image", "check_root", "ensure_unique",
           "read_field"]

log = logging.getLogger(__name__)

# Files up to this size are read whole; larger ones stream into the tar in _CHUNK pieces.
STREAM_THRESHOLD = 16 * 2**20
_CHUNK = 8 * 2**20
_IMAGE_SUFFIXES = frozenset(f".{ext}" for ext in PACK_IMAGE_EXTS)  # what an ImageFolder packs


def _sample_entry(name: str) -> str | None:
    """How a keyed folder's file sorts in its directory (the first dot made a NUL: by key,
    then name), or None if the name is no ``<key>.<field>``."""
    stem, dot, field = name.partition(".")
    if not dot or not stem or not field:
        return None
    return name.replace(".", "\0", 1)


def _image_entry(name: str) -> str | None:
    """An ImageFolder's image file sorts by its name; other files are left out."""
    return name if os.path.splitext(name)[1].lower() in _IMAGE_SUFFIXES else None


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


def check_image(path: str | os.PathLike[str], field: str, value: FieldValue) -> None:
    """Refuse an image field (by its last extension, as the reader decodes it) that is empty or
    whose header is no image format PIL knows.

    Only the header is parsed (``Image.open`` without ``load``): cheap at pack time, where a
    corrupt file packed as is would end the first training epoch instead.

    Args:
        path: the file the value came from (named in the error; a big file's header is read
            from it).
        field: the field name.
        value: the field's value.

    Raises:
        SourceError: naming ``path``, when the image is empty or unreadable.
    """
    if field.rpartition(".")[2] not in IMAGE_EXTS:
        return
    size = value.size if isinstance(value, StreamedField) else len(value)
    if size == 0:
        raise SourceError(f"{Path(path)} is not a readable image: it is empty (0 bytes)")
    try:
        # A big file streams: PIL reads the header from the file, not the whole of it.
        with Image.open(path if isinstance(value, StreamedField) else io.BytesIO(value)):
            pass
    except Image.DecompressionBombError:
        pass  # a very large image is still an image: PIL knew its format and its size
    except UnidentifiedImageError as exc:
        raise SourceError(f"{Path(path)} is not a readable image: its {size} bytes are in no image format "
                          "PIL recognises") from exc
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for corrupt headers
        raise SourceError(f"{Path(path)} is not a readable image: {type(exc).__name__}: {exc}") from exc


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
    seen: set[str] = set()  # keys only (a set of the items' own strs): 20 M of them
    for it in items:
        if it.key in seen:
            first = next(other.ref for other in items if other.key == it.key)
            raise SourceError(f"duplicate key {it.key!r} in {where}: {first} and {it.ref}")
        seen.add(it.key)


class FolderSource:
    """A directory whose files group into samples by key: ``a.jpg`` + ``a.cls`` + ``a.json``.

    As in WebDataset, the key is the path up to the first dot of the file name and the field
    is the rest (``dir/a.seg.png`` -> key ``dir/a``, field ``seg.png``); keys are made tar-safe
    with :func:`~shardkit.packing.sample.safe_key` and the original kept in the ``source`` column.

    Args:
        root: the folder (local path).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = str(root)
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
        # One streamed pass over the files in sample order (by key, then path, so that each
        # sample's files are next to each other), no per-file objects kept: a folder of tens
        # of millions of files must list in bounded memory on the driver.
        root = check_root(self.root)
        if not root.is_dir():
            raise SourceError(f"source {root} is not a directory")
        self.listing.skipped.clear()
        bad: list[str] = []  # names that are no <key>.<field>: reported once listed, in path order
        clash = None  # the first sample with two files of one field: raised after the bad names
        items: list[SourceItem] = []
        members: list[tuple[str, int]] = []
        raw = None
        for rel, size in chain(walk_in_order(str(root), _sample_entry, bad), ((None, 0),)):
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
                    items.append(SourceItem(ref=json.dumps([r for r, _ in members]),
                                            nbytes=item_bytes(key, zip(fields, (s for _, s in members))), key=key))
                members = []
            raw = key_of
            members.append((rel, size))  # type: ignore[arg-type]
        for rel in sorted(bad):
            self.listing.bad(str(root / rel), f"cannot group {root / rel} into a sample: name it <key>.<field> "
                                              "(e.g. 0001.jpg), or pack with --on-error skip to leave it out")
        if not items and clash is None:
            raise SourceError(f"source {root} holds no files")
        if clash is not None:
            raise clash
        ensure_unique(items, self.root)
        return items

    def load(self, item: SourceItem) -> PackSample:
        """Read one sample's files.

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample; meta ``source`` is its original key.

        Raises:
            SourceError: a file is unreadable, or an image field is no image.
        """
        root = Path(self.root)
        fields: dict[str, FieldValue] = {}
        first = None
        for rel in json.loads(item.ref):
            first = first or rel
            name = _field(rel)
            fields[name] = read_field(root / rel)
            check_image(root / rel, name, fields[name])
        return PackSample(item.key, fields, {"source": _text(_raw_key(first or item.key))})

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


def _text(name: str) -> str:
    """A file name as valid UTF-8 for the manifest: undecodable bytes (surrogate-escaped by
    ``os.scandir``) become U+FFFD; Arrow refuses lone surrogates."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _field(rel: str) -> str:
    """``dir/a.Seg.PNG`` -> ``seg.png``: the (lowercased) WebDataset field of a relative path."""
    return rel.rpartition("/")[2].partition(".")[2].lower()


def _raw_key(rel: str) -> str:
    """``dir/a.seg.png`` -> ``dir/a``: the WebDataset key of a relative path."""
    head, _, name = rel.rpartition("/")
    stem = name.partition(".")[0]
    return f"{head}/{stem}" if head else stem


class ImageFolderSource:
    """``root/<class>/**/<image>``: one sample per image, ``cls`` = class index.

    Classes are the sorted top-level directory names (as torchvision's ImageFolder does);
    dataset.json gets the ``labels`` map. Files that are not images are ignored.

    Args:
        root: the folder (local path).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = str(root)
        self._classes: list[str] | None = None

    def classes(self) -> list[str]:
        """The class names: the sorted folders directly under the root.

        Returns:
            The names; a class's index is its position here.

        Raises:
            SourceNotFoundError: the root does not exist.
            SourceError: it is no folder, or holds no class folders.
        """
        if self._classes is None:
            root = check_root(self.root)
            if not root.is_dir():
                raise SourceError(f"source {root} is not a directory")
            self._classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
            if not self._classes:
                raise SourceError(f"source {root} has no class directories (--labels-from-dirs expects root/<class>/<image>)")
        return self._classes

    def list_items(self) -> list[SourceItem]:
        """One item per image, class by class, each class's images in path order.

        Returns:
            The items; ``ref`` is ``<class>/<path>``.

        Raises:
            SourceError: no class folders, no images, or two images share a key.
        """
        root = Path(self.root)
        loose = [e.name for e in os.scandir(root) if e.is_file() and not e.name.startswith(".")
                 and Path(e.name).suffix.lower() in _IMAGE_SUFFIXES]
        if loose:  # as torchvision's ImageFolder, but said out loud: they are not packed
            log.warning("%d image(s) directly under %s (e.g. %s) are in no class directory and are left out "
                        "(--labels-from-dirs reads root/<class>/<image>)", len(loose), root, sorted(loose)[0])
        items: list[SourceItem] = []
        for index, cls in enumerate(self.classes()):
            cls_field = ("cls", len(str(index)))
            for rel, size in walk_in_order(str(root / cls), _image_entry):
                full = f"{cls}/{rel}"
                key = safe_key(full)
                items.append(SourceItem(ref=full, nbytes=item_bytes(key, ((_image_field(full), size), cls_field)),
                                        key=key))
        if not items:
            raise SourceError(f"source {root} holds no images")
        ensure_unique(items, self.root)
        return items

    def load(self, item: SourceItem) -> PackSample:
        """Read one image.

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample: the image (field ``jpg``, ``png``...) and ``cls``; meta ``label``,
            ``class_name`` and ``source``.

        Raises:
            SourceError: the file is unreadable or no image.
        """
        cls = item.ref.split("/", 1)[0]
        label = self.labels()[cls]  # type: ignore[index]
        ext = _image_field(item.ref)
        path = f"{self.root}/{item.ref}"  # a str path: no Path objects per image
        image = read_field(path)
        check_image(path, ext, image)
        return PackSample(item.key, {ext: image, "cls": str(label).encode()},
                          {"label": label, "class_name": _text(cls), "source": _text(item.ref)})

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json.

        Returns:
            ``{"type": "imagefolder", "path": <the root>}``.
        """
        return {"type": "imagefolder", "path": self.root}

    def labels(self) -> dict[str, int] | None:
        """The class map: the class folders, numbered in sorted order (see :meth:`classes`).

        Returns:
            Class name -> index.

        Raises:
            SourceNotFoundError: the root does not exist.
            SourceError: it is no folder, or holds no class folders.
        """
        return {c: i for i, c in enumerate(self.classes())}


def _image_field(path: str) -> str:
    """``a/b.JPEG`` -> ``jpg``: the field an image file is packed as."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return "jpg" if ext == "jpeg" else ext
