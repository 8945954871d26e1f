"""Existing WebDataset tars as a source, to re-shard them to a new shard size.

Listing scans tar headers only (:func:`shardkit.format.tarscan.scan_tar`), groups consecutive members
by WebDataset key and makes one item per sample whose ``ref`` is ``"<url>#<start>:<end>"``, the
byte range of that sample's members. Loading is one ranged read of that range, parsed again
with the same checks (the tar may have changed since it was listed). Samples bigger than
``INLINE_LIMIT`` stream their large members with ranged reads instead.

Tar input is hostile until checked: see :mod:`shardkit.format.tarscan` for what is refused.
"""

from __future__ import annotations

import functools
import glob as _glob
import io
import os
from typing import Any, Iterator, Mapping, Sequence, Union

import fsspec
from braceexpand import braceexpand  # type: ignore[import-untyped]
from fsspec.implementations.local import LocalFileSystem

from shardkit.errors import SourceError, SourceNotFoundError, UnsafeTarError
from shardkit.format.streams import CHUNK_BYTES, iter_exact
from shardkit.format.tarscan import TarMember, group_members, scan_tar, split_name
from shardkit.packing.sample import (FieldValue, PackSample, StreamedField, case_clash, case_clash_reason,
                                     check_field_name, safe_key)
from shardkit.packing.sources.base import SourceItem
from shardkit.storage.urls import refuse_url_credentials

__all__ = ["INLINE_LIMIT", "WdsTarSource"]

#: Samples up to this many bytes are fetched with one ranged read; larger ones stream.
INLINE_LIMIT = 64 * 1024 * 1024
# Read-ahead for remote header scans: small enough that skipping a big member skips its bytes,
# large enough that a run of small members costs few requests.
_SCAN_BLOCK = 1 << 20

PathLike = Union[str, os.PathLike]


def _url_to_fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    try:
        return fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except (ValueError, ImportError) as exc:
        raise SourceError(f"{url}: cannot open: {exc}") from exc


def _range_chunks(url: str, storage_options: Mapping[str, Any] | None, offset: int, size: int) -> Iterator[bytes]:
    """``size`` bytes of ``url`` from ``offset`` in pieces of at most CHUNK_BYTES."""
    fs, path = _url_to_fs(url, storage_options)
    try:
        with fs.open(path, "rb") as f:
            f.seek(offset)
            yield from iter_exact(f, size, f"{url} at byte {offset}", CHUNK_BYTES)
    except FileNotFoundError as exc:
        raise SourceNotFoundError(f"{url}: no such file") from exc


class WdsTarSource:
    """WebDataset tars (local paths, a directory of ``*.tar``, fsspec URLs or globs).

    Args:
        urls_or_dir: one URL/path/glob/directory or a list of them. Directories are searched
            recursively for ``*.tar``; globs are expanded; results are sorted.
        storage_options: fsspec options (credentials, endpoint); never shown in reprs,
            errors or :meth:`describe`.

    Keys are :func:`safe_key` of the original WebDataset key (directory prefix included);
    meta ``orig_key`` is the original key and ``source`` the tar URL.

    Raises:
        SourceError: no URLs given.
        ConfigError: credentials in a URL.
    """

    def __init__(self, urls_or_dir: PathLike | Sequence[PathLike], storage_options: Mapping[str, Any] | None = None) -> None:
        given = [urls_or_dir] if isinstance(urls_or_dir, (str, os.PathLike)) else list(urls_or_dir)
        # WebDataset's brace notation: shards-{000000..000099}.tar, {train,val}/*.tar
        self.urls: list[str] = [u for url in given for u in braceexpand(os.fspath(url))]
        if not self.urls:
            raise SourceError("WdsTarSource: no tar URLs given")
        for url in self.urls:
            refuse_url_credentials(url, "source")
        self.storage_options = dict(storage_options) if storage_options else None

    def __repr__(self) -> str:
        return f"WdsTarSource({self.urls!r})"

    # -- listing ---------------------------------------------------------------------------

    def tars(self) -> list[tuple[str, int]]:
        """(url, size) of every tar, expanded and sorted.

        Returns:
            The tars, in order.

        Raises:
            SourceNotFoundError: a URL, path or glob finds nothing.
            SourceError: a folder holds no tars, or listing fails.
        """
        out: list[tuple[str, int]] = []
        for url in self.urls:
            fs, path = _url_to_fs(url, self.storage_options)
            try:
                if _glob.has_magic(path):
                    paths = sorted(p for p in fs.glob(path) if fs.isfile(p))
                elif fs.isdir(path):
                    # Not what an unfinished pack left in _pack/ (as `shardkit index` leaves it out).
                    claim = f"{path.rstrip('/')}/_pack/"
                    paths = sorted(p for p in fs.find(path) if p.endswith(".tar") and not p.startswith(claim))
                    if not paths:
                        raise SourceError(f"{url}: no .tar files found")
                elif fs.exists(path):
                    paths = [path]
                else:
                    paths = []
                if not paths:
                    what = "no files match this pattern" if _glob.has_magic(path) else "no such file or directory"
                    raise SourceNotFoundError(f"{url}: {what}")
                for p in paths:
                    out.append((self._url(fs, p), int(fs.size(p))))
            except (SourceError, UnsafeTarError):
                raise
            except FileNotFoundError as exc:
                raise SourceNotFoundError(f"{url}: no such file or directory") from exc
            except OSError as exc:
                raise SourceError(f"{url}: cannot list: {exc}") from exc
        return out

    @staticmethod
    def _url(fs: Any, path: str) -> str:
        return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)

    def list_items(self) -> list[SourceItem]:
        """One item per sample, reading only tar headers.

        Returns:
            The items; ``ref`` is ``<url>#<start>:<end>``, the byte range of the sample's members.

        Raises:
            SourceNotFoundError: a tar is missing.
            UnsafeTarError: a hostile or malformed member.
            SourceError: a bad field name, a repeated key, no samples, or a read failure.
        """
        items: list[SourceItem] = []
        seen: dict[str, str] = {}
        for url, size in self.tars():
            fs, path = _url_to_fs(url, self.storage_options)
            kwargs = {} if isinstance(fs, LocalFileSystem) else {"block_size": _SCAN_BLOCK, "cache_type": "readahead"}
            try:
                with fs.open(path, "rb", **kwargs) as f:
                    groups = list(group_members(scan_tar(f, name=url, file_size=size)))
            except FileNotFoundError as exc:
                raise SourceNotFoundError(f"{url}: no such file") from exc
            except OSError as exc:
                raise SourceError(f"{url}: cannot read: {exc}") from exc
            for orig, members in groups:
                # Validate names now, not deep inside a pack task. A case clash is a bad sample,
                # not a bad tar: load refuses it, where on_error="skip" can leave it out.
                _fields(url, members, check_case=False)
                key = safe_key(orig)
                ref = f"{url}#{members[0].offset_header}:{members[-1].end}"
                if key in seen:
                    raise SourceError(
                        f"{url}: sample key {orig!r} (as {key!r}) repeats {seen[key]}; keys must be unique"
                    )
                seen[key] = ref
                items.append(SourceItem(ref=ref, nbytes=members[-1].end - members[0].offset_header, key=key))
        if not items:
            raise SourceError(f"{', '.join(self.urls)}: no samples in the tars")
        return items

    # -- loading ---------------------------------------------------------------------------

    def load(self, item: SourceItem) -> PackSample:
        """One ranged read of the sample's bytes, parsed and checked again.

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample; members over CHUNK_BYTES of a sample over INLINE_LIMIT stream.

        Raises:
            SourceNotFoundError: the tar is gone.
            UnsafeTarError: a hostile or malformed member.
            SourceError: the bytes no longer hold the sample, a bad field, or a read failure.
        """
        url, _, rng = item.ref.rpartition("#")
        try:
            start, end = (int(x) for x in rng.split(":"))
        except ValueError as exc:
            raise SourceError(f"{item.ref}: not a WdsTarSource item") from exc
        fs, path = _url_to_fs(url, self.storage_options)
        fields: dict[str, FieldValue] = {}
        try:
            if end - start <= INLINE_LIMIT:
                data = fs.cat_file(path, start=start, end=end)
                if len(data) != end - start:
                    raise SourceError(f"{url}: short read of bytes {start}:{end} ({len(data)} bytes)")
                groups = list(group_members(scan_tar(io.BytesIO(data), name=url, file_size=len(data))))
                orig, members = _one_group(groups, item)
                for m, field in zip(members, _fields(item.ref, members)):
                    fields[field] = data[m.offset_data : m.offset_data + m.size]
            else:
                with fs.open(path, "rb") as f:
                    groups = list(group_members(scan_tar(f, name=url, file_size=end, start=start)))
                orig, members = _one_group(groups, item)
                for m, field in zip(members, _fields(item.ref, members)):
                    if m.size <= CHUNK_BYTES:
                        fields[field] = fs.cat_file(path, start=m.offset_data, end=m.offset_data + m.size)
                    else:
                        chunks = functools.partial(_range_chunks, url, self.storage_options, m.offset_data, m.size)
                        fields[field] = StreamedField(size=m.size, chunks=chunks)
        except FileNotFoundError as exc:
            raise SourceNotFoundError(f"{url}: no such file") from exc
        except (SourceError, UnsafeTarError):
            raise
        except OSError as exc:
            raise SourceError(f"{url}: cannot read bytes {start}:{end}: {exc}") from exc
        return PackSample(key=item.key, fields=fields, meta={"orig_key": orig, "source": url})

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json.

        Returns:
            ``{"type": "wds", "urls": <the expanded URLs>}``; never the storage options.
        """
        return {"type": "wds", "urls": list(self.urls)}

    def labels(self) -> dict[str, int] | None:
        """WebDataset tars carry no class map.

        Returns:
            None.
        """
        return None


def _fields(url: str, members: list[TarMember], *, check_case: bool = True) -> list[str]:
    """Field names of one sample's members, lowercased; refuses missing, bad or repeated fields,
    and (``check_case``) fields that differ only in case, which the webdataset library cannot read."""
    out: list[str] = []
    for m in members:
        _, field = split_name(m.name)
        if not field:
            raise SourceError(f"{url}: member {m.name!r} has no extension, so no WebDataset field")
        try:
            check_field_name(field)
        except SourceError as exc:
            raise SourceError(f"{url}: member {m.name!r}: {exc}") from None
        if field in out:
            raise SourceError(f"{url}: member {m.name!r} repeats field {field!r} in its sample")
        out.append(field)
    clash = case_clash(out) if check_case else None
    if clash is not None:
        raise SourceError(f"{url}: sample {split_name(members[0].name)[0]!r}: {case_clash_reason(*clash)}")
    # Lowercased as the webdataset library does (and as folder sources are): `0001.JPG` is
    # field `jpg` to every reader, shardkit's included.
    return [field.lower() for field in out]


def _one_group(groups: list[tuple[str, list[TarMember]]], item: SourceItem) -> tuple[str, list[TarMember]]:
    if len(groups) != 1 or safe_key(groups[0][0]) != item.key:
        raise SourceError(f"{item.ref}: bytes no longer hold sample {item.key!r}; did the tar change since listing?")
    return groups[0]
