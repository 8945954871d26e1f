"""An ImageFolder as a source: ``root/<class>/**/<image>``, one sample per image, on disk or at a URL."""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator

from shardkit.errors import SourceError
from shardkit.format.fields import PACK_IMAGE_EXTS
from shardkit.packing.sample import FieldValue, PackSample, safe_key
from shardkit.packing.sources.base import SourceItem, item_bytes
from shardkit.packing.sources.files import FolderRoot, check_root, text_name
from shardkit.packing.sources.keys import unique_keys
from shardkit.packing.sources.listing import list_dir, walk_objects
from shardkit.packing.sources.walk import walk_in_order

__all__ = ["ImageFolderSource"]

log = logging.getLogger(__name__)

_IMAGE_SUFFIXES = frozenset(f".{ext}" for ext in PACK_IMAGE_EXTS)  # what an ImageFolder packs


def _image_entry(name: str) -> str | None:
    """An ImageFolder's image file sorts by its name; other files are left out."""
    return name if os.path.splitext(name)[1].lower() in _IMAGE_SUFFIXES else None


class ImageFolderSource(FolderRoot):
    """``root/<class>/**/<image>``: one sample per image, ``cls`` = class index.

    Classes are the sorted top-level directory names (as torchvision's ImageFolder does);
    dataset.json gets the ``labels`` map. Files that are not images are ignored.

    Args:
        root: the folder: a local path, or a URL prefix of objects (``s3://bucket/train``),
            whose class folders are listed in parallel.
        storage_options: fsspec options for a URL (credentials, endpoint); never shown.
    """

    def __init__(self, root: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(root, storage_options)
        self._classes: list[str] | None = None
        self._loose: list[str] = []

    def classes(self) -> list[str]:
        """The class names: the sorted folders directly under the root.

        Returns:
            The names; a class's index is its position here.

        Raises:
            SourceNotFoundError: the root does not exist.
            SourceError: it is no folder, or holds no class folders.
        """
        if self._classes is None:
            if self.remote:
                files, dirs = list_dir(self.objects, self.root)
                self._classes = sorted(dirs)
                self._loose = [name for name, _ in files]
            else:
                root = check_root(self.root)
                if not root.is_dir():
                    raise SourceError(f"source {root} is not a directory")
                self._classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
                self._loose = [e.name for e in os.scandir(root) if e.is_file() and not e.name.startswith(".")]
            if not self._classes:
                raise SourceError(f"source {self.root} has no class directories (--labels-from-dirs expects root/<class>/<image>)")
        return self._classes

    def list_items(self) -> list[SourceItem]:
        """One item per image, class by class, each class's images in path order.

        Returns:
            The items; ``ref`` is ``<class>/<path>``.

        Raises:
            SourceError: no class folders, no images, or two images share a key.
        """
        return list(self.iter_items())

    def iter_items(self) -> Iterator[SourceItem]:
        """:meth:`list_items`, streamed as the class folders are listed (the packer plans tasks
        as they come).

        Returns:
            An iterator of the items, in order.

        Raises:
            SourceError: as :meth:`list_items`.
        """
        return unique_keys(self._items(), self.root, self._items)

    def _items(self) -> Iterator[SourceItem]:
        classes = self.classes()
        root = self.root
        loose = [name for name in self._loose if os.path.splitext(name)[1].lower() in _IMAGE_SUFFIXES]
        if loose:  # as torchvision's ImageFolder, but said out loud: they are not packed
            log.warning("%d image(s) directly under %s (e.g. %s) are in no class directory and are left out "
                        "(--labels-from-dirs reads root/<class>/<image>)", len(loose), root, sorted(loose)[0])
        # Every class's images, class by class: the class folders of a URL are listed in parallel.
        if self.remote:
            found = walk_objects(self.objects, self.root, _image_entry, tops=classes)
        else:
            found = ((f"{cls}/{rel}", size) for cls in classes for rel, size in walk_in_order(f"{root}/{cls}", _image_entry))
        index = {cls: i for i, cls in enumerate(classes)}
        listed = 0
        try:
            for full, size in found:
                cls_field = ("cls", len(str(index[full.partition("/")[0]])))
                key = safe_key(full)
                listed += 1
                yield SourceItem(ref=full, nbytes=item_bytes(key, ((_image_field(full), size), cls_field)), key=key)
        finally:
            close = getattr(found, "close", None)
            if close is not None:
                close()  # a walk of objects stops its listing threads
        if not listed:
            raise SourceError(f"source {root} holds no images")

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
        image = self._fetched(item)
        self._check_image(item.ref, ext, image)
        return PackSample(item.key, {ext: image, "cls": str(label).encode()},
                          {"label": label, "class_name": text_name(cls), "source": text_name(item.ref)})

    def _fetch(self, item: SourceItem) -> FieldValue:
        return self._read(item.ref, item.nbytes)

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
