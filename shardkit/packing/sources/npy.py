"""``.npy`` / ``.npz`` files as a source, and the ``.npy`` header helper the array sources share.

A ``.npy`` file becomes one sample with field ``npy`` whose bytes are the file, copied
verbatim (so Fortran order, big-endian data and any header version survive). A ``.npz``
becomes one sample with a field ``<array>.npy`` per member: npz members are ``.npy`` files in
a zip, so their (decompressed) bytes are exactly what ``np.save`` would write.

Files may be objects (``s3://...``): headers and zip directories are read with ranged GETs
through seekable file objects, and big arrays stream chunk by chunk as local ones do.
"""

from __future__ import annotations

import functools
import io
import os
import posixpath
import warnings
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Sequence, Union

import numpy as np

from shardkit.format.npy import parse_npy_header
from shardkit.format.streams import CHUNK_BYTES, iter_exact
from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.packing.sample import FieldValue, PackSample, StreamedField, check_field_name, safe_key
from shardkit.packing.sources.base import SourceItem, item_bytes
from shardkit.packing.sources.objects import Objects, is_url

try:  # numpy >= 2 keeps the implementation private; np.save's exact header writer lives there
    from numpy.lib import _format_impl as _npformat
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.lib import format as _npformat  # type: ignore[no-redef]

PathLike = Union[str, os.PathLike]

__all__ = ["NpySource", "npy_header"]


def npy_header(dtype: np.dtype | str, shape: Sequence[int]) -> bytes:
    """The exact bytes ``np.save`` writes before the data of a C-ordered array.

    Args:
        dtype: the array dtype (byte order kept; dtype metadata is dropped as np.save does).
        shape: the array shape.

    Returns:
        The magic, version, header dict and padding, as ``np.save`` writes them.

    Raises:
        SourceError: for dtypes holding Python objects, which ``.npy`` can only pickle.
    """
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise SourceError(f"dtype {dt} holds Python objects and cannot be stored as .npy")
    with warnings.catch_warnings():
        # np.save warns about dropped dtype metadata and about format 2.0/3.0; so would we.
        warnings.simplefilter("ignore", UserWarning)
        header = {
            "descr": np.lib.format.dtype_to_descr(dt),
            "fortran_order": False,
            "shape": tuple(int(n) for n in shape),
        }
        buf = io.BytesIO()
        write = getattr(_npformat, "_write_array_header", None)
        if write is not None:
            write(buf, header, None)  # version None: the oldest that fits, as np.save chooses
        else:  # pragma: no cover - a numpy without the private helper
            try:
                np.lib.format.write_array_header_1_0(buf, header)
            except ValueError:
                buf = io.BytesIO()
                np.lib.format.write_array_header_2_0(buf, header)
    return buf.getvalue()


def _data_nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _open(path: str, objects: Objects | None) -> BinaryIO:
    """``path`` (a local file or an object URL) opened for reading."""
    if objects is not None and is_url(path):
        return objects.open(path, block_size=CHUNK_BYTES)
    return open(path, "rb")


def _file_chunks(path: str, size: int, name: str, objects: Objects | None = None) -> Iterator[bytes]:
    """The first ``size`` bytes of ``path`` in pieces of at most CHUNK_BYTES."""
    with _open(path, objects) as f:
        yield from iter_exact(f, size, name, CHUNK_BYTES)


def _zip_member_chunks(path: str, member: str, size: int, name: str, objects: Objects | None = None) -> Iterator[bytes]:
    """The decompressed bytes of one zip member in pieces of at most CHUNK_BYTES."""
    try:
        with _open(path, objects) as raw, zipfile.ZipFile(raw) as zf, zf.open(member) as f:
            yield from iter_exact(f, size, name, CHUNK_BYTES)
    except (zipfile.BadZipFile, OSError) as exc:
        raise SourceError(f"{name}: cannot read npz member: {exc}") from exc


class NpySource:
    """``.npy`` and ``.npz`` files: a directory (searched recursively) or a list of files.

    Args:
        paths_or_dir: a directory, one file, or a list of files (local paths; files may also be
            object URLs, ``s3://...``).
        storage_options: fsspec options for URLs (credentials, endpoint); never shown.

    Keys are :func:`safe_key` of the path relative to the directory (or to the files' common
    parent) without extension; meta ``source`` is that relative path.

    Raises:
        SourceError: no paths given.
    """

    def __init__(self, paths_or_dir: PathLike | Sequence[PathLike], storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options) if storage_options else None
        self._objects: Objects | None = None
        if isinstance(paths_or_dir, (str, os.PathLike)):
            self.paths: list[str] = [os.fspath(paths_or_dir)]
        else:
            self.paths = [os.fspath(p) for p in paths_or_dir]
        if not self.paths:
            raise SourceError("NpySource: no paths given")

    def __repr__(self) -> str:
        return f"NpySource({self.paths if len(self.paths) != 1 else self.paths[0]!r})"

    def __getstate__(self) -> dict[str, Any]:
        """Paths and options: a copy (a Ray task) opens its own stores."""
        return {**self.__dict__, "_objects": None}

    @property
    def objects(self) -> Objects | None:
        """The reader of object URLs, when any path is one (made on first use)."""
        if self._objects is None and any(is_url(p) for p in self.paths):
            self._objects = Objects(self.storage_options)
        return self._objects

    def _is_dir(self, path: str) -> bool:
        return not is_url(path) and os.path.isdir(path)

    # -- listing ---------------------------------------------------------------------------

    def _root(self) -> str:
        """The directory relative paths (keys, meta ``source``) are taken from."""
        if len(self.paths) == 1 and self._is_dir(self.paths[0]):
            return self.paths[0]
        if all(is_url(p) for p in self.paths):  # scheme://bucket/...: the common folder, scheme kept
            scheme = self.paths[0].partition("://")[0]
            common = posixpath.commonpath([posixpath.dirname(p.partition("://")[2]) for p in self.paths])
            return f"{scheme}://{common}"
        return os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in self.paths])

    def _files(self) -> list[tuple[str, str]]:
        """(path, relative path) of every input file, sorted by relative path."""
        if len(self.paths) == 1 and self._is_dir(self.paths[0]):
            root = Path(self.paths[0])
            files = [f for f in root.rglob("*") if f.suffix in (".npy", ".npz") and f.is_file()]
            out = [(str(f), f.relative_to(root).as_posix()) for f in files]
            if not out:
                raise SourceError(f"{root}: no .npy or .npz files found")
        else:
            for p in self.paths:
                if is_url(p):
                    if not p.endswith((".npy", ".npz")):
                        raise SourceError(f"{p}: not a .npy or .npz file")
                    continue  # a missing object is named by the first read of its header
                if not os.path.exists(p):
                    raise SourceNotFoundError(f"{p}: no such file")
                if not p.endswith((".npy", ".npz")) or not os.path.isfile(p):
                    raise SourceError(f"{p}: not a .npy or .npz file")
            out = [(p, self._rel(p)) for p in (p if is_url(p) else os.path.abspath(p) for p in self.paths)]
        return sorted(out, key=lambda t: t[1])

    def list_items(self) -> list[SourceItem]:
        """One item per file; reads only the .npy headers (and the npz directory).

        Returns:
            The items, sorted by relative path; ``ref`` is the file's path.

        Raises:
            SourceNotFoundError: a path does not exist.
            SourceError: a file is no .npy/.npz, a header is bad or disagrees with the file's
                size, an npz member is no array, or two files share a key.
        """
        if len(self.paths) == 1 and not is_url(self.paths[0]) and not os.path.exists(self.paths[0]):
            raise SourceNotFoundError(f"{self.paths[0]}: no such file or directory")
        items: list[SourceItem] = []
        seen: dict[str, str] = {}
        for path, rel in self._files():
            key = safe_key(rel.rsplit(".", 1)[0])
            if path.endswith(".npy"):
                nbytes = item_bytes(key, [("npy", self._check_npy(path, rel))])
            else:
                nbytes = item_bytes(key, ((field, size) for _, field, size in self._npz_members(path, rel)))
            if key in seen:
                raise SourceError(f"{rel}: key {key!r} collides with {seen[key]}")
            seen[key] = rel
            items.append(SourceItem(ref=path, nbytes=nbytes, key=key))
        return items

    def _check_npy(self, path: str, rel: str) -> int:
        objects = self.objects if is_url(path) else None
        size = objects.size(path) if objects is not None else os.path.getsize(path)
        with _open(path, objects) as f:
            dtype, shape, _, header_len = parse_npy_header(f, name=rel)
        expected = header_len + _data_nbytes(dtype, shape)
        if size != expected:
            raise SourceError(f"{rel}: file is {size} bytes but its .npy header implies {expected}")
        return size

    def _npz_members(self, path: str, rel: str) -> list[tuple[str, str, int]]:
        """(zip member, field name, size) per array, validated (headers only)."""
        out = []
        try:
            with _open(path, self.objects if is_url(path) else None) as raw, zipfile.ZipFile(raw) as zf:
                for info in sorted(zf.infolist(), key=lambda i: i.filename):
                    if info.is_dir():
                        continue
                    mname = f"{rel}:{info.filename}"
                    if not info.filename.endswith(".npy"):
                        raise SourceError(f"{mname}: npz member is not a .npy array")
                    field = info.filename
                    try:
                        check_field_name(field)
                    except SourceError as exc:
                        raise SourceError(f"{mname}: {exc}") from None
                    with zf.open(info) as f:
                        dtype, shape, _, header_len = parse_npy_header(f, name=mname)
                    expected = header_len + _data_nbytes(dtype, shape)
                    if info.file_size != expected:
                        raise SourceError(
                            f"{mname}: member is {info.file_size} bytes but its header implies {expected}"
                        )
                    out.append((info.filename, field, info.file_size))
        except (zipfile.BadZipFile, OSError) as exc:
            raise SourceError(f"{rel}: not a readable .npz (zip) file: {exc}") from exc
        if not out:
            raise SourceError(f"{rel}: .npz holds no arrays")
        return out

    # -- loading ---------------------------------------------------------------------------

    def load(self, item: SourceItem) -> PackSample:
        """Read one file.

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample (field ``npy``, or ``<array>.npy`` per npz member); members larger than
            CHUNK_BYTES become StreamedFields.

        Raises:
            SourceNotFoundError: the file is gone.
            SourceError: the file changed or is unreadable.
        """
        path = item.ref
        rel = self._rel(path)
        fields: dict[str, FieldValue] = {}
        if not is_url(path) and not os.path.exists(path):
            raise SourceNotFoundError(f"{rel}: no such file")
        objects = self.objects if is_url(path) else None
        if path.endswith(".npy"):
            size = self._check_npy(path, rel)
            fields["npy"] = _small_or_streamed(functools.partial(_file_chunks, path, size, rel, objects), size)
        else:
            for member, field, size in self._npz_members(path, rel):
                name = f"{rel}:{member}"
                fields[field] = _small_or_streamed(
                    functools.partial(_zip_member_chunks, path, member, size, name, objects), size
                )
        return PackSample(key=item.key, fields=fields, meta={"source": rel})

    def _rel(self, path: str) -> str:
        if is_url(path):
            return posixpath.relpath(path.partition("://")[2], self._root().partition("://")[2])
        return Path(os.path.relpath(path, self._root())).as_posix()

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json.

        Returns:
            ``{"type": "npy", "paths": <the paths given>}``.
        """
        return {"type": "npy", "paths": list(self.paths)}

    def labels(self) -> dict[str, int] | None:
        """Arrays have no classes.

        Returns:
            None.
        """
        return None


def _small_or_streamed(chunks: functools.partial[Iterator[bytes]], size: int) -> FieldValue:
    """Small bodies are read now (one open instead of two); big ones stream later."""
    if size <= CHUNK_BYTES:
        data = b"".join(chunks())
        return data
    return StreamedField(size=size, chunks=chunks)
