"""The sample types that flow from sources to the shard writer.

A source yields :class:`PackSample` objects. Field values are ``bytes`` for small members and
:class:`StreamedField` for large ones (e.g. a 300 MB HDF5 dataset), which the writer copies
into the tar chunk by chunk so memory stays bounded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Union

import xxhash

from shardkit.errors import SourceError

__all__ = ["MANIFEST_COLUMNS", "MAX_KEY", "FieldValue", "PackSample", "StreamedField", "case_clash",
           "case_clash_reason", "check_field_name", "safe_key"]


@dataclass(frozen=True)
class StreamedField:
    """A member body produced in chunks.

    Attributes:
        size: the body's length; ``chunks()`` must yield exactly this many bytes.
        chunks: makes a fresh iterator over the body's pieces (called once per write).
    """

    size: int
    chunks: Callable[[], Iterator[bytes]]


FieldValue = Union[bytes, StreamedField]


@dataclass
class PackSample:
    """One sample to pack.

    Attributes:
        key: tar-safe key (see :func:`safe_key`), unique within the dataset.
        fields: field name (``jpg``, ``cls``, ``npy``...) -> member body.
        meta: user metadata columns for the manifest (``label``, ``source``, ...); values must
            be scalars (str, int, float, bool, None).
    """

    key: str
    fields: dict[str, FieldValue]
    meta: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        """The sample's size in the shard, without tar headers and padding.

        Returns:
            The total length of its member bodies (a :class:`StreamedField` counts its ``size``).
        """
        return sum(v.size if isinstance(v, StreamedField) else len(v) for v in self.fields.values())


# The manifest's own sample columns (manifest.SAMPLE_COLUMNS, which a test keeps equal to
# this): user metadata may not take their names. Sources check at listing, before any write.
MANIFEST_COLUMNS = frozenset({"key", "shard", "offset", "size", "fields", "checksum", "block_checksums"})

MAX_KEY = 160
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]")
_FIELD_OK = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")


def safe_key(raw: str | bytes) -> str:
    """Turn any identifier (a relative path, a name with dots, non-UTF-8 bytes) into a key.

    WebDataset groups members by the text before the first dot of the basename, so keys may
    hold no dot and no slash. Unsafe characters become ``_`` and, when anything changed, an
    8-hex xxh64 of the original is appended so two different originals never collide; keys
    longer than ``MAX_KEY`` are cut and get the same suffix, so extracted members stay valid
    file names. Deterministic: the same input always gives the same key.

    Args:
        raw: the identifier (text, or bytes that may not be UTF-8).

    Returns:
        The key: letters, digits, ``_`` and ``-`` only, at most ``MAX_KEY`` characters.
    """
    raw_bytes = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogateescape")
    text = raw_bytes.decode("utf-8", "replace")
    cleaned = _UNSAFE.sub("_", text)
    if cleaned == text and 0 < len(cleaned) <= MAX_KEY:
        return cleaned
    # Shortened too: with the field suffix, a member name must fit a file name (255 bytes).
    return f"{cleaned[:MAX_KEY - 9]}-{xxhash.xxh64_hexdigest(raw_bytes)[:8]}"


def case_clash(fields: Iterable[str]) -> tuple[str, str] | None:
    """Two of ``fields`` that differ only in case (``("JPG", "jpg")``), or None.

    The webdataset library lowercases every field name (``group_by_keys(lcase=True)``, with
    ``str.lower``) and refuses a sample where two come out the same ("duplicate file name in
    tar file"), so such a sample is unreadable to it.

    Args:
        fields: a sample's field names.

    Returns:
        The first such pair, in sorted order, or None.
    """
    seen: dict[str, str] = {}
    for name in sorted(fields):
        other = seen.setdefault(name.lower(), name)
        if other != name:
            return other, name
    return None


def case_clash_reason(first: str, second: str) -> str:
    """Why a sample with fields ``first`` and ``second`` (differing only in case) is refused.

    Args:
        first: one field name.
        second: the other.

    Returns:
        The reason, for an error message.
    """
    return (f"fields {first!r} and {second!r} differ only in case; the webdataset library lowercases field "
            "names and refuses such a sample: rename one")


def check_field_name(name: str) -> None:
    """Refuse a field name that would break WebDataset grouping or tar paths.

    Args:
        name: the field name.

    Raises:
        SourceError: it holds characters other than letters, digits, ``_``, ``-`` and ``.``
            separators.
    """
    if not _FIELD_OK.match(name):
        raise SourceError(f"invalid field name {name!r}: use letters, digits, '_', '-' and '.' separators")
