"""TFRecord files of ``tf.train.Example`` records as a source, read without TensorFlow.

Every record is a sample. Listing reads only the 12-byte record headers, seeking over the
payloads (ranged reads on fsspec URLs such as ``s3://``); a task reads each record with one
ranged read and checks both CRCs (:mod:`~shardkit.packing.sources.tfrecord_frame`) before
decoding the Example (:mod:`~shardkit.packing.sources.tf_example`).

Features become fields by this rule:

- a ``bytes_list`` of one value: the raw bytes, as the field named after the feature, each
  character outside ``A-Z a-z 0-9 _ - .`` (``/`` too) made ``_``; what follows the name's
  first dot is the field's extension, so ``image.jpg`` stays field ``image.jpg``. A
  ``<prefix>/encoded`` feature with a ``<prefix>/format`` beside it (the TensorFlow Object
  Detection convention, ``image/encoded`` + ``image/format = "jpeg"``) becomes
  ``<prefix>.<format>`` (``image.jpg``; ``jpeg`` is written ``jpg``). Several values: one field
  per value, ``<stem>_<i>[.<extension>]``; no value: no field.
- an ``int64_list`` of one value named ``label``, ``cls`` or ``image/class/label``: field ``cls``
  (the number as text, as an ImageFolder's ``cls``);
- any other ``int64_list`` / ``float_list``: ``<name>.npy``, a 1-D int64 / float32 array.

Keys are ``<file>-<record index, 9 digits>`` (the file's path relative to the folder given,
its ``.tfrecord`` suffix dropped); metadata ``source`` is that relative path, ``record`` the index.
Gzip-compressed TFRecords are refused (decompress them first).
"""

from __future__ import annotations

import glob as _glob
import os
import re
from typing import Any, Mapping, Sequence, Union

import numpy as np

from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.packing.sample import FieldValue, PackSample, case_clash, case_clash_reason, check_field_name, safe_key
from shardkit.packing.sources.base import ListingSkips, SourceItem, item_bytes
from shardkit.packing.sources.npy import npy_header
from shardkit.packing.sources.tf_example import Feature, parse_example
from shardkit.packing.sources.tfrecord_frame import FOOTER_BYTES, HEADER_BYTES, scan_records, unframe
from shardkit.storage.urls import refuse_url_credentials

__all__ = ["TfRecordSource", "example_fields", "is_tfrecord_name"]

PathLike = Union[str, os.PathLike]
_NAME = re.compile(r"\.tfrecords?(-\d+-of-\d+)?$|\.tfrecords?-|\.tfrec$", re.IGNORECASE)
_SUFFIX = re.compile(r"\.tfrec(ords?)?(?=-|$)", re.IGNORECASE)  # dropped from keys: a.tfrecord-00001 -> a-00001
_REF = re.compile(r"^(.*): record (\d+) at byte (\d+) \((\d+) bytes\)$", re.DOTALL)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_SCAN_BLOCK = 1 << 20
_LABELS = ("label", "cls", "image/class/label")


def is_tfrecord_name(name: str) -> bool:
    """Whether a file name is a TFRecord's: ``*.tfrecord``, ``*.tfrecords``, ``*.tfrec`` or a
    sharded ``*.tfrecord-00000-of-00010``.

    Args:
        name: the file name.

    Returns:
        True for a TFRecord name.
    """
    return bool(_NAME.search(os.path.basename(name)))


def _field_name(name: str) -> str:
    return _UNSAFE.sub("_", name)


def _ext(fmt: Feature) -> str | None:
    if fmt.kind != "bytes" or len(fmt.values) != 1:
        return None
    text = bytes(fmt.values[0]).decode("ascii", "replace").strip().lower()  # type: ignore[arg-type]
    return "jpg" if text == "jpeg" else (text if text and _UNSAFE.sub("", text) == text else None)


def example_fields(features: dict[str, Feature], where: str) -> dict[str, bytes]:
    """The fields of one Example, by the rule in the module docstring.

    Args:
        features: the decoded Example.
        where: the record, for errors.

    Returns:
        Field name -> body.

    Raises:
        SourceError: the record has no feature with values, a feature name makes no valid
            field name, or two features make the same field (or fields differing only in case).
    """
    fields: dict[str, bytes] = {}
    names: dict[str, str] = {}

    def put(field: str, body: bytes, feature: str) -> None:
        try:
            check_field_name(field)
        except SourceError as exc:
            raise SourceError(f"{where}: feature {feature!r}: {exc}") from None
        if field in fields:
            raise SourceError(f"{where}: features {names[field]!r} and {feature!r} both make field {field!r}")
        fields[field], names[field] = body, feature

    for name, feat in features.items():
        if feat.kind == "bytes":
            field = _field_name(name)
            if name.endswith("/encoded"):
                ext = _ext(features.get(name[:-len("encoded")] + "format", Feature("", [])))
                if ext:
                    field = f"{_field_name(name[:-len('/encoded')])}.{ext}"
            values: list[bytes] = feat.values  # type: ignore[assignment]
            if len(values) == 1:
                put(field, values[0], name)
            else:
                stem, dot, rest = field.partition(".")
                for i, value in enumerate(values):
                    put(f"{stem}_{i}{dot}{rest}", value, name)
        elif feat.kind in ("int64", "float"):
            array = feat.values
            assert isinstance(array, np.ndarray)
            if feat.kind == "int64" and len(array) == 1 and name in _LABELS:
                put("cls", str(int(array[0])).encode(), name)
            else:
                put(f"{_field_name(name)}.npy", npy_header(array.dtype, array.shape) + array.tobytes(), name)
    if not fields:
        raise SourceError(f"{where}: the record holds no feature with a value")
    clash = case_clash(fields)
    if clash is not None:
        raise SourceError(f"{where}: {case_clash_reason(*clash)}")
    return fields


class TfRecordSource:
    """TFRecord files of ``tf.train.Example`` records: a file, a folder of them (searched
    recursively), a list, or fsspec URLs of either.

    Args:
        paths_or_dir: a path or URL (a file, a folder or a glob), or a list of them.
        storage_options: fsspec options for URLs (never shown in errors or :meth:`describe`).

    Raises:
        SourceError: no paths given.
        ConfigError: credentials in a URL.
    """

    def __init__(self, paths_or_dir: PathLike | Sequence[PathLike],
                 storage_options: Mapping[str, Any] | None = None) -> None:
        given = [paths_or_dir] if isinstance(paths_or_dir, (str, os.PathLike)) else list(paths_or_dir)
        # Local paths made absolute: Ray tasks on a cluster run in another working directory.
        self.paths = [p if "://" in p else os.path.abspath(p) for p in (str(os.fspath(g)) for g in given)]
        if not self.paths:
            raise SourceError("TfRecordSource: no paths given")
        for p in self.paths:
            refuse_url_credentials(p, "source")
        self.storage_options = dict(storage_options) if storage_options else None
        self.listing = ListingSkips()
        self._open: dict[Any, Any] = {}  # in a task: url -> (fs, path), and a local file kept open

    def __repr__(self) -> str:
        return f"TfRecordSource({self.paths if len(self.paths) != 1 else self.paths[0]!r})"

    def __getstate__(self) -> dict[str, Any]:
        """Only the options: the filesystem is made again in each task's process."""
        return {"paths": self.paths, "storage_options": self.storage_options, "listing": ListingSkips(), "_open": {}}

    def _fs(self, url: str) -> tuple[Any, str]:
        found = self._open.get(url)
        if found is None:
            import fsspec

            try:
                found = self._open[url] = fsspec.core.url_to_fs(url, **dict(self.storage_options or {}))
            except (ValueError, ImportError) as exc:
                raise SourceError(f"{url}: cannot open: {exc}") from exc
        return found

    def _read(self, url: str, start: int, size: int) -> bytes:
        """``size`` bytes of ``url`` from ``start``: one ranged read; a local file stays open
        between the records of a task (closed by :meth:`task_done`)."""
        if "://" in url:
            fs, path = self._fs(url)
            return bytes(fs.cat_file(path, start=start, end=start + size))
        held = self._open.get(("file", url))
        if held is None:
            self.task_done()  # one local file open at a time
            held = self._open[("file", url)] = open(url, "rb")  # noqa: SIM115 - closed by task_done
        held.seek(start)
        return bytes(held.read(size))

    def task_done(self) -> None:
        """Close the local file a task kept open (called after each task's last load)."""
        for k in [k for k in self._open if isinstance(k, tuple)]:
            self._open.pop(k).close()

    def files(self) -> list[tuple[str, str, int]]:
        """(url, path relative to what was given, size) of every TFRecord file, sorted.

        Returns:
            The files.

        Raises:
            SourceNotFoundError: a path does not exist.
            SourceError: a folder holds no TFRecord files.
        """
        out: list[tuple[str, str, int]] = []
        for url in self.paths:
            fs, path = self._fs(url)
            proto = url.split("://", 1)[0] + "://" if "://" in url and not url.startswith("file://") else ""
            try:
                if _glob.has_magic(path):
                    found = sorted(p for p in fs.glob(path) if fs.isfile(p))
                    if not found:
                        raise SourceNotFoundError(f"{url}: no files match this pattern")
                    out += [(proto + p, os.path.basename(p), int(fs.size(p))) for p in found]
                elif fs.isdir(path):
                    root = path.rstrip("/")
                    listed = fs.find(root, detail=True)  # sizes come with the listing: no request per file
                    found = sorted(p for p in listed if is_tfrecord_name(p))
                    if not found:
                        raise SourceError(f"{url}: no TFRecord files (*.tfrecord, *.tfrecords) found")
                    out += [(proto + p, p[len(root) + 1:], int(listed[p]["size"])) for p in found]
                elif fs.exists(path):
                    out.append((proto + path if proto else path, os.path.basename(path.rstrip("/")), int(fs.size(path))))
                else:
                    raise SourceNotFoundError(f"{url}: no such file or directory")
            except FileNotFoundError as exc:
                raise SourceNotFoundError(f"{url}: no such file or directory") from exc
        return out

    def list_items(self) -> list[SourceItem]:
        """One item per record: one pass over each file's record headers.

        Returns:
            The items, by file then record; ``ref`` is ``<url>: record <index> at byte <offset>
            (<length> bytes)``.

        Raises:
            SourceNotFoundError: a path does not exist.
            SourceError: a file is gzip-compressed or unreadable; a record header is corrupt or
                a record truncated (unless skipped); two records share a key.
        """
        items: list[SourceItem] = []
        seen: dict[str, str] = {}
        self.listing.skipped.clear()
        for url, rel, size in self.files():
            stem = _SUFFIX.sub("", rel).replace("/", "_").replace(".", "_")
            fs, path = self._fs(url)

            def bad(index: int, offset: int, reason: str) -> None:
                later = " (the file's later records are left out too)" if self.listing.skip else ""
                self.listing.bad(f"{url}: record {index} at byte {offset}", reason + later)

            try:
                # Remote: small read-ahead blocks, so seeking over a big record skips its bytes
                # while a run of small records costs few requests.
                remote = {} if "://" not in url else {"block_size": _SCAN_BLOCK}
                with fs.open(path, "rb", **remote) as f:
                    records = list(scan_records(f, size, url, bad))
                    shape = self._shape(f, records[0], rel) if records else []
            except OSError as exc:
                raise SourceError(f"{url}: cannot read: {exc}") from exc
            for index, offset, length in records:
                key = safe_key(f"{stem}-{index:09d}")
                if key in seen:
                    raise SourceError(f"{rel}: record {index}: key {key!r} is also record {seen[key]}")
                seen[key] = f"{index} of {rel}"
                share = length // max(1, len(shape))
                items.append(SourceItem(ref=f"{url}: record {index} at byte {offset} ({length} bytes)", key=key,
                                        nbytes=item_bytes(key, ((f, share) for f in shape) if shape else [("bin", length)])))
        return items

    @staticmethod
    def _shape(f: Any, first: tuple[int, int, int], rel: str) -> list[str]:
        """The fields of a file's first record, for estimating every record's shard bytes
        (tar headers count per field); nothing if it does not decode (its task will say why)."""
        _, offset, length = first
        f.seek(offset + HEADER_BYTES)
        try:
            return list(example_fields(parse_example(f.read(length)), rel))
        except SourceError:
            return []

    def load(self, item: SourceItem) -> PackSample:
        """Read one record (one ranged read), check its CRCs and decode its Example.

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample, its fields by the rule in the module docstring.

        Raises:
            SourceNotFoundError: the file is gone.
            SourceError: a CRC mismatch, a truncated record or a bad Example, naming the file,
                record index and byte offset.
        """
        found = _REF.match(item.ref)
        if found is None:
            raise SourceError(f"{item.ref}: not an item of a TfRecordSource")
        url, index, start, size = found[1], int(found[2]), int(found[3]), int(found[4])
        where = item.ref
        try:
            record = self._read(url, start, HEADER_BYTES + size + FOOTER_BYTES)
        except FileNotFoundError as exc:
            raise SourceNotFoundError(f"{url}: no such file") from exc
        except OSError as exc:
            raise SourceError(f"{where}: cannot read: {exc}") from exc
        payload = unframe(record, where)
        fields: dict[str, FieldValue] = dict(example_fields(parse_example(payload), where))
        rel = self._rel(url)
        return PackSample(item.key, fields, {"source": rel, "record": index})

    def _rel(self, url: str) -> str:
        """The file's path relative to the folder given (its name if given as a file)."""
        for given in self.paths:
            root = given.rstrip("/")
            if url.startswith(root + "/"):
                return url[len(root) + 1:]
        return os.path.basename(url)

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json.

        Returns:
            ``{"type": "tfrecord", "paths": <the paths given>}``.
        """
        return {"type": "tfrecord", "paths": list(self.paths)}

    def labels(self) -> dict[str, int] | None:
        """TFRecords name no classes.

        Returns:
            None.
        """
        return None

