"""Sources over plain files: a keyed folder, an ImageFolder, a CSV/Parquet file list.

Files are listed with their sizes (one ``stat`` each, no data read) so the planner can split
work by bytes; data is read inside pack tasks. Large files stream into the tar in chunks.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Iterator

from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.format.fields import IMAGE_EXTS, PACK_IMAGE_EXTS
from shardkit.packing.sample import MANIFEST_COLUMNS, FieldValue, PackSample, StreamedField, safe_key
from shardkit.packing.sources.base import ListingSkips, SourceItem, item_bytes

log = logging.getLogger(__name__)

STREAM_THRESHOLD = 16 * 2**20
_CHUNK = 8 * 2**20
IMAGE_SUFFIXES = frozenset(f".{ext}" for ext in PACK_IMAGE_EXTS)  # what an ImageFolder packs


def _walk_in_order(root: str, entry: Callable[[str], str | None],
                   rejected: list[str] | None = None) -> Iterator[tuple[str, int]]:
    """(relative posix path, size) of the files under ``root`` that ``entry`` keeps, in the
    order of their relative paths as ``entry`` spells the names, streamed.

    ``entry(name)`` is the text a kept file name sorts by within its directory (the name, or
    for sample order the name with its first dot made a NUL, so that ``a.jpg`` comes before
    ``a-b.jpg`` as the key ``a`` before ``a-b``), or None for a file that is left out (its
    relative path is appended to ``rejected`` if given). A directory sorts as its name and a
    ``/``: sorting each directory's entries so and descending into each subdirectory in its
    place gives the order of a sort of all the relative paths (a name holds no ``/`` or NUL).

    Hidden files are left out. Symlinks to files are followed (users lay out datasets with
    them); symlinked directories are not, so a link loop cannot hang the listing. Dangling
    symlinks are listed (size 0) so that loading them fails with an error naming them.

    Only the names of the directories on the current path are held (each list shrinking as
    it is walked), and each file's ``stat`` happens as it is yielded: a folder of 20 M files
    must list within a few hundred bytes a file, where collecting and sorting (path, size)
    tuples first peaked at ~1 KB a file (trial D F2b).
    """
    stack = [_scan_dir(root, "", entry, rejected)]
    while stack:
        path, prefix, names, dangling = stack[-1]
        if not names:
            stack.pop()
            continue
        name = names.pop()  # sorted descending: popping from the end frees the list as it goes
        if name[-1] == "/":
            stack.append(_scan_dir(path + name[:-1], prefix + name, entry, rejected))
            continue
        name = name.replace("\0", ".", 1)
        if dangling is not None and name in dangling:
            yield prefix + name, 0
            continue
        try:
            size = os.stat(path + name).st_size
        except OSError as exc:
            raise SourceError(f"cannot stat {path + name}: {exc.strerror}") from exc
        yield prefix + name, size


def _scan_dir(d: str, prefix: str, entry: Callable[[str], str | None],
              rejected: list[str] | None) -> tuple[str, str, list[str], set[str] | None]:
    """One directory of :func:`_walk_in_order`: (its path ending in a separator, its relative
    path ditto, its kept entries sorted descending, its dangling symlinks' names or None)."""
    try:
        scan = os.scandir(d)
    except PermissionError as exc:
        raise SourceError(f"cannot list {d}: permission denied") from exc
    path = os.path.join(d, "")
    names: list[str] = []
    dangling: set[str] | None = None
    with scan:
        for e in scan:
            name = e.name
            if name.startswith("."):
                continue
            if e.is_dir(follow_symlinks=False):
                names.append(name + "/")
                continue
            if e.is_file():
                lost = False
            elif e.is_symlink() and not os.path.exists(e.path):
                # A dangling link is a file the user meant to pack whose data is gone: list it,
                # so loading it fails naming it (or on_error="skip" records it), never drop it silently.
                lost = True
            else:
                continue
            kept = entry(name)
            if kept is None:
                if not lost:  # stat as the files that are kept: an unreadable one is an error all the same
                    try:
                        e.stat()
                    except OSError as exc:
                        raise SourceError(f"cannot stat {e.path}: {exc.strerror}") from exc
                if rejected is not None:
                    rejected.append(prefix + name)
                continue
            names.append(kept)
            if lost:
                dangling = dangling or set()
                dangling.add(name)
    names.sort(reverse=True)
    return path, prefix, names, dangling


def _sample_entry(name: str) -> str | None:
    """How a keyed folder's file sorts in its directory (the first dot made a NUL: by key,
    then name), or None if the name is no ``<key>.<field>``."""
    stem, dot, field = name.partition(".")
    if not dot or not stem or not field:
        return None
    return name.replace(".", "\0", 1)


def _image_entry(name: str) -> str | None:
    """An ImageFolder's image file sorts by its name; other files are left out."""
    return name if os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES else None


def read_field(path: str | os.PathLike[str]) -> FieldValue:
    """The file's bytes, or a StreamedField for big files; SourceError naming an unreadable file.

    One open and an fstat of it, unbuffered: packing small images spent about a third of its
    read time on a separate stat and the buffered reader's setup.
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
    """SourceError naming ``path`` if an image field (by its last extension, as the reader
    decodes it) is empty or its header is no image format PIL knows.

    Only the header is parsed (``Image.open`` without ``load``): about 20-30 microseconds an
    image, where a corrupt file packed as is would end the first training epoch instead.
    """
    if field.rpartition(".")[2] not in IMAGE_EXTS:
        return
    size = value.size if isinstance(value, StreamedField) else len(value)
    if size == 0:
        raise SourceError(f"{Path(path)} is not a readable image: it is empty (0 bytes)")
    from PIL import Image, UnidentifiedImageError

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
    root = Path(path)
    if not root.exists():
        raise SourceNotFoundError(f"source {root} does not exist")
    return root


def ensure_unique(items: list[SourceItem], where: str) -> None:
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
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = str(root)
        self.listing = ListingSkips()

    def list_items(self) -> list[SourceItem]:
        # One streamed pass over the files in sample order (by key, then path, so that each
        # sample's files are next to each other), no per-file objects kept: a folder of 20 M
        # files must list within a few GB on the driver.
        root = check_root(self.root)
        if not root.is_dir():
            raise SourceError(f"source {root} is not a directory")
        self.listing.skipped.clear()
        bad: list[str] = []  # names that are no <key>.<field>: reported once listed, in path order
        clash = None  # the first sample with two files of one field: raised after the bad names
        items: list[SourceItem] = []
        members: list[tuple[str, int]] = []
        raw = None
        for rel, size in chain(_walk_in_order(str(root), _sample_entry, bad), ((None, 0),)):
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
        return {"type": "folder", "path": self.root}

    def labels(self) -> dict[str, int] | None:
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
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = str(root)
        self._classes: list[str] | None = None

    def classes(self) -> list[str]:
        if self._classes is None:
            root = check_root(self.root)
            if not root.is_dir():
                raise SourceError(f"source {root} is not a directory")
            self._classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
            if not self._classes:
                raise SourceError(f"source {root} has no class directories (--labels-from-dirs expects root/<class>/<image>)")
        return self._classes

    def list_items(self) -> list[SourceItem]:
        root = Path(self.root)
        loose = [e.name for e in os.scandir(root) if e.is_file() and not e.name.startswith(".")
                 and Path(e.name).suffix.lower() in IMAGE_SUFFIXES]
        if loose:  # as torchvision's ImageFolder, but said out loud: they are not packed
            log.warning("%d image(s) directly under %s (e.g. %s) are in no class directory and are left out "
                        "(--labels-from-dirs reads root/<class>/<image>)", len(loose), root, sorted(loose)[0])
        items: list[SourceItem] = []
        for index, cls in enumerate(self.classes()):
            cls_field = ("cls", len(str(index)))
            for rel, size in _walk_in_order(str(root / cls), _image_entry):
                full = f"{cls}/{rel}"
                key = safe_key(full)
                items.append(SourceItem(ref=full, nbytes=item_bytes(key, ((_image_field(full), size), cls_field)),
                                        key=key))
        if not items:
            raise SourceError(f"source {root} holds no images")
        ensure_unique(items, self.root)
        return items

    def load(self, item: SourceItem) -> PackSample:
        cls = item.ref.split("/", 1)[0]
        label = self.labels()[cls]  # type: ignore[index]
        ext = _image_field(item.ref)
        path = f"{self.root}/{item.ref}"  # a str path: no Path objects per image
        image = read_field(path)
        check_image(path, ext, image)
        return PackSample(item.key, {ext: image, "cls": str(label).encode()},
                          {"label": label, "class_name": _text(cls), "source": _text(item.ref)})

    def describe(self) -> dict[str, Any]:
        return {"type": "imagefolder", "path": self.root}

    def labels(self) -> dict[str, int] | None:
        return {c: i for i, c in enumerate(self.classes())}


def _image_field(path: str) -> str:
    """``a/b.JPEG`` -> ``jpg``: the field an image file is packed as."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return "jpg" if ext == "jpeg" else ext


class FileListSource:
    """A CSV or Parquet table with a path column; every other column becomes metadata.

    Relative paths are resolved against the list file's directory. An optional ``key``
    column names the samples; otherwise the key is the path without its extension.
    """

    def __init__(self, list_path: str | os.PathLike[str], path_column: str = "path") -> None:
        self.list_path = str(list_path)
        self.path_column = path_column
        self.listing = ListingSkips()

    def _table(self) -> list[dict[str, Any]]:
        import pyarrow as pa
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq

        p = check_root(self.list_path)
        try:
            if p.suffix.lower() in (".parquet", ".pq"):
                table = pq.read_table(p)  # typed by its writer: taken as is
            else:
                # Every column as text first: pyarrow's type inference would read a zip code
                # "00123" or an id "0001" as the integers 123 and 1.
                with pacsv.open_csv(p) as head:
                    names = head.schema.names
                table = pacsv.read_csv(p, convert_options=pacsv.ConvertOptions(
                    column_types={n: pa.string() for n in names}, strings_can_be_null=False))
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad files
            raise SourceError(f"cannot read file list {p}: {exc}") from exc
        if self.path_column not in table.column_names:
            raise SourceError(f"file list {p} has no {self.path_column!r} column (columns: {table.column_names})")
        if table.num_rows == 0:
            raise SourceError(f"file list {p} is empty")
        for name in table.column_names:
            if name in (self.path_column, "key"):
                continue  # the path and the key are not metadata: they make the sample
            if name == "source":  # kept for every source: the input each sample came from
                raise SourceError(f"file list {p}: column 'source' is reserved (shardkit records each sample's "
                                  "path there); rename the column")
            if name in MANIFEST_COLUMNS:
                raise SourceError(f"file list {p}: column {name!r} is reserved (the manifest has its own "
                                  f"{name!r} column); rename the column")
        if p.suffix.lower() not in (".parquet", ".pq"):
            for i, name in enumerate(table.column_names):
                if name not in (self.path_column, "key"):
                    table = table.set_column(i, name, csv_values(table.column(i)))
        return table.to_pylist()

    def list_items(self) -> list[SourceItem]:
        base = Path(self.list_path).parent
        items = []
        self.listing.skipped.clear()
        self._rows = self._table()  # fresh: the local engine's tasks and labels() reuse it
        self.__dict__.pop("_class_map", None)
        for i, row in enumerate(self._rows):
            rel = row[self.path_column]
            if not rel:
                self.listing.bad(f"{self.list_path}: row {i}",
                                 f"file list {self.list_path}: row {i} has an empty {self.path_column!r}")
                continue
            if "label" in row:
                try:
                    label_class(row["label"], f"file list {self.list_path}: row {i}")
                except SourceError as exc:
                    self.listing.bad(f"{self.list_path}: row {i}", str(exc))
                    continue
            path = Path(rel) if os.path.isabs(rel) else base / rel
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                self.listing.bad(f"{self.list_path}: row {i}", f"file list {self.list_path}: row {i}: {path} does not exist")
                continue
            key = row.get("key")  # 0 and "00" are keys too: only a missing one falls back to the path
            key = safe_key(str(key) if key is not None and key != "" else Path(rel).with_suffix("").as_posix())
            members = [(_list_field(path), size)]
            if "label" in row:
                members.append(("cls", 1))  # any class index fits the one block a 1-byte body takes
            items.append(SourceItem(ref=f"{i}:{path}", nbytes=item_bytes(key, members), key=key))
        ensure_unique(items, self.list_path)
        return items

    def load(self, item: SourceItem) -> PackSample:
        index, _, p = item.ref.partition(":")
        path = Path(p)
        row = self._row(int(index))
        ext = _list_field(path)
        meta = {k: v for k, v in row.items() if k not in (self.path_column, "key")}
        meta["source"] = row[self.path_column]
        fields: dict[str, FieldValue] = {ext: read_field(path)}
        check_image(path, ext, fields[ext])
        if "label" in row:
            cls = label_class(row["label"], f"file list {self.list_path}: row {index}")
            # A class name is numbered; the column keeps the name (and an integral float as written).
            fields["cls"] = str(self._classes()[cls] if isinstance(cls, str) else cls).encode()
        return PackSample(item.key, fields, meta)

    def _classes(self) -> dict[str, int]:
        """Class name -> index of a text ``label`` column ("cat", "dog"): the sorted distinct
        names, as --labels-from-dirs numbers its folders; empty for numeric labels."""
        classes: dict[str, int] | None = getattr(self, "_class_map", None)
        if classes is None:
            names = {r.get("label") for r in self._all_rows()}
            classes = {c: i for i, c in enumerate(sorted(n for n in names if isinstance(n, str) and n))}
            self._class_map = classes
        return classes

    def _row(self, index: int) -> dict[str, Any]:
        return self._all_rows()[index]

    def _all_rows(self) -> list[dict[str, Any]]:
        # Tasks reload the (small) list once per process rather than pickling all rows.
        rows: list[dict[str, Any]] | None = getattr(self, "_rows", None)
        if rows is None:
            rows = self._table()
            self._rows = rows
        return rows

    def __getstate__(self) -> dict[str, Any]:
        return {"list_path": self.list_path, "path_column": self.path_column}

    def describe(self) -> dict[str, Any]:
        return {"type": "filelist", "path": self.list_path}

    def labels(self) -> dict[str, int] | None:
        return self._classes() or None


def label_class(label: Any, where: str) -> int | str:
    """The class a file list's ``label`` value names: an index, or a class name to number.

    Integral floats are indices: pandas writes integer labels with one missing value as
    float64. A missing label (null, NaN, empty) or any other value is a SourceError naming
    ``where``: a sample without ``cls`` among samples with it breaks batching downstream.
    """
    if label is None or label == "" or (isinstance(label, float) and math.isnan(label)):
        raise SourceError(f"{where}: the label is missing (every row of a list with a 'label' column needs one)")
    if isinstance(label, float) and label.is_integer():
        return int(label)
    if isinstance(label, str) or (isinstance(label, int) and not isinstance(label, bool)):
        return label
    raise SourceError(f"{where}: label {label!r} is neither a class index (a whole number) nor a class name")


def _list_field(path: Path) -> str:
    """The field a file list's file is packed as: its lowercased extension, ``bin`` if none."""
    ext = path.suffix.lower().lstrip(".") or "bin"
    return "jpg" if ext == "jpeg" else ext


# pyarrow's default CSV null spellings: in a numeric or boolean column they are missing values.
_CSV_NULLS = frozenset({"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                        "N/A", "NA", "NULL", "NaN", "n/a", "nan", "null"})
_CSV_INT = re.compile(r"^(0|-?[1-9][0-9]{0,17})$")  # exactly str(int(v)) == v, and fits int64
_CSV_FLOAT = re.compile(r"^-?[0-9]+\.[0-9]+$")
_CSV_BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}


def csv_values(column: Any) -> Any:
    """A CSV column read as text, typed only where nothing is lost.

    Integers if every value reads back as written (``str(int(v)) == v``: ``"0012"`` keeps the
    column text), floats likewise (``repr(float(v)) == v``, integers allowed), booleans if
    every value is true/false; otherwise the text as given. In a typed column the usual null
    spellings (empty, ``NA``, ...) are missing values; in a text column they stay text.
    """
    import pyarrow as pa

    values: list[str] = column.to_pylist()
    present = [v for v in values if v not in _CSV_NULLS]
    if not present:
        return pa.array([None] * len(values), pa.null())
    if all(_CSV_INT.match(v) for v in present):
        return pa.array([None if v in _CSV_NULLS else int(v) for v in values], pa.int64())
    if all(_CSV_INT.match(v) or (_CSV_FLOAT.match(v) and repr(float(v)) == v) for v in present):
        return pa.array([None if v in _CSV_NULLS else float(v) for v in values], pa.float64())
    if all(v in _CSV_BOOL for v in present):
        return pa.array([None if v in _CSV_NULLS else _CSV_BOOL[v] for v in values], pa.bool_())
    return column
