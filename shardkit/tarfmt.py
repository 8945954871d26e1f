"""Deterministic tar encoding of samples, and slicing samples back out of tar bytes.

Members are written with mtime 0, uid/gid 0, empty user/group names and mode 0644, fields
in sorted order, so packing the same input twice gives byte-identical shards. Headers are
ustar; Python's tarfile adds a pax header only when a name or size needs one.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from typing import Iterator

BLOCK = 512
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)


def padding(size: int) -> int:
    """Zero bytes that follow a member body of ``size`` bytes."""
    return -size % BLOCK


def member_header(name: str, size: int) -> bytes:
    """The header block(s) of one regular-file member, deterministic."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


@dataclass(frozen=True)
class FieldSpan:
    """Where one member's body lives, relative to the start of the shard."""

    name: str
    offset: int
    size: int


def sample_fields(buf: memoryview | bytes, base: int, fields: list[FieldSpan]) -> dict[str, memoryview]:
    """Slice a sample's member bodies out of ``buf`` (which starts at shard byte ``base``)."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    return {f.name: view[f.offset - base:f.offset - base + f.size] for f in fields}


def iter_tar_members(data: bytes) -> Iterator[tuple[str, bytes]]:
    """(name, body) of each regular member of an in-memory tar (used by tests and checks)."""
    import io

    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        for info in tf:
            if info.isfile():
                f = tf.extractfile(info)
                yield info.name, f.read() if f else b""
