"""Walk the headers of a tar from outside without reading member data, refusing what is unsafe.

Used to re-shard existing WebDataset tars (keys by :func:`split_name`) and by ``shardkit index``
(keys by :func:`wds_split`, webdataset's own rule, as it keeps the tars). Only headers are
read: each 512-byte header is parsed, the data is skipped with a seek, so scanning a remote
tar costs sequential small reads. pax (``x``) and GNU long-name (``L``) headers are applied
to the member that follows them; that member's ``offset_header`` is the offset of its first
extension header, so ``[offset_header, end)`` is a self-contained tar stream of the member.

Every name is untrusted: absolute names, ``..`` components, NUL bytes, links, devices and
fifos, sizes beyond the end of the file, truncated headers and more than
:data:`MAX_EXTENDED_HEADER` bytes of extension headers before one member (or of global pax
headers in one tar) raise :class:`~shardkit.errors.UnsafeTarError` naming the tar and the
member. Headers past that bound are skipped unread, so memory stays bounded whatever the tar.
"""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from typing import BinaryIO, Iterable, Iterator

from shardkit.errors import UnsafeTarError
from shardkit.format.streams import read_exact

__all__ = ["MAX_EXTENDED_HEADER", "TarMember", "group_members", "scan_tar", "split_name", "wds_split"]

BLOCK = 512
# Extension headers (pax records, GNU long names) larger than this are not real-world names:
# the bound of one header, of all the headers before one member together, and of all global
# pax headers of a tar together (what the scanner holds in memory at most).
MAX_EXTENDED_HEADER = 1 << 20

_REGULAR = {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE}
_REFUSED = {
    tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hardlink",
    tarfile.CHRTYPE: "character device",
    tarfile.BLKTYPE: "block device",
    tarfile.FIFOTYPE: "fifo",
}


@dataclass(frozen=True)
class TarMember:
    """A regular file in a tar.

    Attributes:
        name: the member name (pax ``path`` / GNU long name applied), checked safe.
        offset_header: offset of its first header block (extension headers included).
        offset_data: offset of its data.
        size: data length in bytes.
        end: ``offset_data + size`` rounded up to 512 (capped at the file size).
    """

    name: str
    offset_header: int
    offset_data: int
    size: int
    end: int


def _round_up(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def _read_at(fileobj: BinaryIO, offset: int, n: int) -> bytes:
    fileobj.seek(offset)
    return read_exact(fileobj, n)


def _check_member_name(name: str, *, tar: str) -> None:
    """Refuse a member name that could escape a directory or confuse a reader.

    Args:
        name: the member name (pax and GNU long names applied).
        tar: the tar, for the error.

    Raises:
        UnsafeTarError: an empty name, a NUL byte, an absolute name or a ``..`` component.
    """
    if not name:
        raise UnsafeTarError(f"{tar}: member with an empty name")
    if "\x00" in name:
        raise UnsafeTarError(f"{tar}: member {name!r} has a NUL byte in its name")
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":" and name[0].isalpha()):
        raise UnsafeTarError(f"{tar}: member {name!r} has an absolute name")
    if any(part == ".." for part in name.replace("\\", "/").split("/")):
        raise UnsafeTarError(f"{tar}: member {name!r} has a '..' component")


def _parse_pax(data: bytes, *, tar: str, offset: int) -> dict[str, str]:
    """Parse pax extended-header records (``"<len> <key>=<value>\\n"``).

    Args:
        data: the extended header's body.
        tar: the tar, for the error.
        offset: the header's offset, for the error.

    Returns:
        Key -> value (undecodable bytes surrogate-escaped).

    Raises:
        UnsafeTarError: a malformed record.
    """
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        if data[pos] == 0:  # NUL padding after the last record
            break
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space]) if space > pos else -1
        except ValueError:
            length = -1
        record = data[pos : pos + length] if length > 0 else b""
        if length <= space - pos or not record.endswith(b"\n") or b"=" not in record:
            raise UnsafeTarError(f"{tar}: malformed pax header at offset {offset}")
        key, _, value = record[space - pos + 1 : -1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def scan_tar(
    fileobj: BinaryIO, *, name: str, file_size: int, start: int = 0
) -> Iterator[TarMember]:
    """Yield the regular-file members of a tar, reading headers only.

    Args:
        fileobj: a seekable binary file (local or fsspec) holding the tar.
        name: the tar's URL or path, for error messages.
        file_size: the size of the file (or the end of the range to scan).
        start: offset to start at (a member's ``offset_header``); scanning stops at
            ``file_size`` or at an end-of-archive (all-zero) block.

    Yields:
        Each regular-file member, in file order (directory members are skipped).

    Raises:
        UnsafeTarError: anything refused (see the module's docstring), a truncated or bad
            header (naming the compression when the file is a compressed tar).
    """
    pos = start
    pax: dict[str, str] = {}
    global_pax: dict[str, str] = {}
    long_name: str | None = None
    long_link = False  # a GNU long link target (``././@LongLink``, type K) precedes the member
    member_start: int | None = None
    ext_bytes = 0  # bytes of the extension headers before the member being read
    global_bytes = 0  # bytes of the tar's global pax headers so far
    while True:
        if pos >= file_size:
            if member_start is not None:
                raise UnsafeTarError(f"{name}: extension header at offset {member_start} has no member after it")
            return
        # Never past file_size: it may be the end of a range of a larger object, whose next
        # bytes are not this tar's (a header cut by the end is refused as truncated).
        buf = _read_at(fileobj, pos, min(BLOCK, file_size - pos))
        if len(buf) < BLOCK:
            _refuse_compressed(buf, pos, name)
            raise UnsafeTarError(f"{name}: truncated tar header at offset {pos} ({len(buf)} of 512 bytes)")
        if buf == b"\x00" * BLOCK:
            if member_start is not None:
                raise UnsafeTarError(f"{name}: extension header at offset {member_start} has no member after it")
            return  # end-of-archive marker
        try:
            info = tarfile.TarInfo.frombuf(buf, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            _refuse_compressed(buf, pos, name)
            raise UnsafeTarError(f"{name}: bad tar header at offset {pos}: {exc}") from exc
        if member_start is None:
            member_start = pos
        data_off = pos + BLOCK
        size = info.size
        if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                         tarfile.GNUTYPE_LONGLINK):
            if size < 0 or size > MAX_EXTENDED_HEADER:
                raise UnsafeTarError(f"{name}: extension header at offset {pos} of {size} bytes refused")
            if data_off + size > file_size:
                raise UnsafeTarError(
                    f"{name}: extension header at offset {pos} size {size} beyond end of file"
                )
            if info.type == tarfile.XGLTYPE:
                global_bytes += size
                if global_bytes > MAX_EXTENDED_HEADER:
                    raise UnsafeTarError(f"{name}: global pax headers of more than {MAX_EXTENDED_HEADER} bytes in all "
                                         f"(at offset {pos}); refused")
            else:
                ext_bytes += size
                if ext_bytes > MAX_EXTENDED_HEADER:  # skipped unread: refused at the member they precede
                    pos = data_off + _round_up(size)
                    continue
            data = _read_at(fileobj, data_off, size)
            if len(data) < size:
                raise UnsafeTarError(f"{name}: truncated extension header at offset {pos}")
            if info.type == tarfile.GNUTYPE_LONGNAME:
                long_name = data.rstrip(b"\x00").decode("utf-8", "surrogateescape")
            elif info.type == tarfile.GNUTYPE_LONGLINK:
                # Applies to the next member, which errors must name (not "././@LongLink").
                long_link = True
            elif info.type == tarfile.XGLTYPE:
                global_pax.update(_parse_pax(data, tar=name, offset=pos))
                member_start = None  # a global header belongs to no member
            else:
                pax.update(_parse_pax(data, tar=name, offset=pos))
            pos = data_off + _round_up(size)
            continue

        records = {**global_pax, **pax}
        member = records.get("path", long_name if long_name is not None else info.name)
        if "size" in records:
            try:
                size = int(records["size"])
            except ValueError as exc:
                raise UnsafeTarError(f"{name}: member {member!r} has a bad pax size") from exc
        first = member_start
        had_long_link = long_link
        extended = ext_bytes
        pax, long_name, long_link, member_start, ext_bytes = {}, None, False, None, 0

        if extended > MAX_EXTENDED_HEADER:
            raise UnsafeTarError(f"{name}: member {member[:200]!r} has {extended} bytes of extension headers (pax records, "
                                 f"GNU long names) before it, more than {MAX_EXTENDED_HEADER}; refused")
        _check_member_name(member, tar=name)
        if info.type in _REFUSED:
            raise UnsafeTarError(f"{name}: member {member!r} is a {_REFUSED[info.type]}; refused")
        if had_long_link:  # a link target on a member that claims not to be a link: refused as links are
            raise UnsafeTarError(f"{name}: member {member!r} has a GNU long link target; refused")
        if size < 0:
            raise UnsafeTarError(f"{name}: member {member!r} has a negative size")
        if data_off + size > file_size:
            raise UnsafeTarError(f"{name}: member {member!r} size {size} beyond end of file")
        end = min(data_off + _round_up(size), file_size)
        if info.type == tarfile.DIRTYPE:
            pos = data_off + _round_up(max(size, 0))
            continue
        if info.type not in _REGULAR:
            raise UnsafeTarError(f"{name}: member {member!r} has unsupported type {info.type!r}; refused")
        yield TarMember(name=member, offset_header=first, offset_data=data_off, size=size, end=end)
        pos = data_off + _round_up(size)


# Magic bytes at the start of compressed files: a .tar.gz renamed .tar fails as a tar, and the
# error should say why.
_COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz"}


def _refuse_compressed(buf: bytes, pos: int, name: str) -> None:
    """UnsafeTarError naming the compression when the file's first bytes (``pos`` 0), which do
    not parse as a tar header, are a compressed file's magic bytes."""
    kind = next((k for magic, k in _COMPRESSED.items() if buf.startswith(magic)), None) if pos == 0 else None
    if kind is not None:
        raise UnsafeTarError(f"{name}: looks {kind}-compressed (starts with {kind}'s magic bytes); compressed tars "
                             "are not read: decompress it to a plain .tar")


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's key rule: ``"dir/a.b.jpg"`` -> ``("dir/a", "b.jpg")``.

    The key is the directory prefix plus the basename up to its first dot; the field is the
    rest (empty when the basename has no dot). A leading ``./`` is dropped.

    Args:
        name: a member name.

    Returns:
        ``(key, field)``.
    """
    while name.startswith("./"):
        name = name[2:]
    prefix, slash, base = name.rpartition("/")
    stem, _, field = base.partition(".")
    return prefix + slash + stem, field


# The webdataset library's ``base_plus_ext`` (tariterators.py): the key is everything up to the
# first dot of the basename, the field the rest; and ``tar_file_iterator``'s default
# ``skip_meta``, which drops ``__*__`` metadata members.
_WDS_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_WDS_META = re.compile(r"__[^/]*__($|/)")


def wds_split(name: str) -> tuple[str, str] | None:
    """The webdataset library's ``(key, field)`` of a member name, the name kept as it is
    (``"./a/b.c.jpg"`` -> ``("./a/b", "c.jpg")``), or None for a member it skips.

    ``shardkit index`` keeps the tars as they are, so its keys must be the ones webdataset
    yields for them (:func:`split_name`, which drops ``./``, is pack's rule for its own keys).
    webdataset skips ``__*__`` metadata (``__meta__``), names with no dot in the basename
    (``README``) and, at the top level, basenames starting with a dot (macOS ``._0001.jpg``).
    Below a folder it makes such a member a sample keyed by the folder (``dir/._x.jpg`` is
    key ``dir/``, field ``_x.jpg``), which is never a real sample: skipped here too.

    Args:
        name: a member name.

    Returns:
        ``(key, field)``, or None for a member webdataset skips.
    """
    if ("/" not in name and name.startswith("__") and name.endswith("__")) or _WDS_META.match(name):
        return None
    if name.rpartition("/")[2].startswith("."):
        return None
    match = _WDS_NAME.match(name)
    return (match.group(1), match.group(2)) if match else None


def group_members(members: Iterable[TarMember]) -> Iterator[tuple[str, list[TarMember]]]:
    """Group consecutive members that share a WebDataset key (:func:`split_name`).

    Args:
        members: members in tar order.

    Yields:
        ``(key, members)`` per run of members with one key.
    """
    key: str | None = None
    group: list[TarMember] = []
    for m in members:
        k, _ = split_name(m.name)
        if group and k != key:
            yield key, group  # type: ignore[misc]
            group = []
        key = k
        group.append(m)
    if group:
        yield key, group  # type: ignore[misc]
