"""Deterministic tar encoding of samples, and slicing samples back out of tar bytes.

Members are written with mtime 0, uid/gid 0, empty user/group names and mode 0644, fields
in sorted order, so packing the same input twice gives byte-identical shards. Headers are
ustar; Python's tarfile adds a pax header only when a name or size needs one.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from typing import Iterator

__all__ = ["BLOCK", "END_OF_ARCHIVE", "FieldSpan", "iter_tar_members", "member_bytes", "member_header", "padding",
           "sample_fields"]

BLOCK = 512
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)


def padding(size: int) -> int:
    """Zero bytes that follow a member body of ``size`` bytes.

    Args:
        size: the body's length.

    Returns:
        The padding to the next 512-byte block.
    """
    return -size % BLOCK


def _tarfile_header(name: str, size: int) -> bytes:
    """The header block(s) of one regular-file member, built by :mod:`tarfile` (the reference)."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


# tarfile builds each header field by field after checking whether it needs pax: a real part
# of framing small samples (see benchmarks/RESULTS.md). Only the name, size and checksum differ
# between our headers, so a header tarfile itself built is the template and those three fields
# are patched in. The fast path covers exactly the case where tarfile emits a bare ustar block
# (ASCII name of <= 100 bytes, size < 8 GiB); anything else still goes through tarfile.
_TEMPLATE = _tarfile_header("", 0)
_NAME_FIELD = 100
_SIZE_FIELD = slice(124, 136)
_MAX_USTAR_SIZE = 8**11
# Checksum of the template header minus its (zero) size field: the checksum field counts as
# eight spaces, and empty name bytes are zeros.
_BASE_SUM = 256 + sum(_TEMPLATE[:148]) + sum(_TEMPLATE[156:]) - sum(_TEMPLATE[_SIZE_FIELD])


def member_header(name: str, size: int) -> bytes:
    """The header block(s) of one regular-file member, deterministic (byte-identical to
    :mod:`tarfile`'s pax-format output, which tests check).

    Args:
        name: the member name (``<key>.<field>``).
        size: the body's length.

    Returns:
        One ustar block, or a pax header and the ustar block when the name or size needs it.
    """
    if 0 <= size < _MAX_USTAR_SIZE and len(name) <= _NAME_FIELD and name.isascii():
        raw = name.encode("ascii")
        size_field = b"%011o\0" % size
        checksum = _BASE_SUM + sum(raw) + sum(size_field)
        return b"".join((raw, bytes(_NAME_FIELD - len(raw)), _TEMPLATE[_NAME_FIELD:124], size_field,
                         _TEMPLATE[136:148], b"%06o\0" % checksum, _TEMPLATE[155:]))
    return _tarfile_header(name, size)


def member_bytes(name: str, size: int) -> int:
    """Bytes one member takes in a shard: its header block(s) (as :func:`member_header` writes
    them), its body and the padding after it.

    Args:
        name: the member name.
        size: the body's length.

    Returns:
        The member's bytes in the tar.
    """
    if 0 <= size < _MAX_USTAR_SIZE and len(name) <= _NAME_FIELD and name.isascii():
        header = BLOCK
    else:  # a pax header too: rare, so built to be counted
        header = len(_tarfile_header(name, size))
    return header + size + padding(size)


@dataclass(frozen=True)
class FieldSpan:
    """Where one member's body lives, relative to the start of the shard."""

    name: str
    offset: int
    size: int


def sample_fields(buf: memoryview | bytes, base: int, fields: list[FieldSpan]) -> dict[str, memoryview]:
    """Slice a sample's member bodies out of ``buf``, without copying.

    Args:
        buf: bytes of a shard, starting at shard byte ``base``.
        base: the shard offset of ``buf[0]``.
        fields: the sample's fields (offsets relative to the shard).

    Returns:
        Field name -> a view of its body.
    """
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    return {f.name: view[f.offset - base:f.offset - base + f.size] for f in fields}


def iter_tar_members(data: bytes) -> Iterator[tuple[str, bytes]]:
    """Each regular member of an in-memory tar.

    Args:
        data: a whole tar.

    Yields:
        ``(name, body)`` per regular member, in order.
    """
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        for info in tf:
            if info.isfile():
                f = tf.extractfile(info)
                yield info.name, f.read() if f else b""
