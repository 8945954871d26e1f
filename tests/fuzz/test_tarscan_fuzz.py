"""Fuzzing the tar scanner (shardkit.format.tarscan) with hypothesis, for a bounded time.

Inputs are real tars (written by ``tarfile``: plain, pax and GNU long names) with mutations
applied: header fields rewritten with their checksum made right again (so the mutation reaches
the scanner's logic, not only the checksum test), random bytes flipped, truncations, and raw
random bytes. Whatever the input, the scanner either yields members or raises
:class:`~shardkit.errors.UnsafeTarError` (a ShardkitError); it never crashes otherwise, never
reads a byte past the end it was given (the file object holds more bytes after it, which it
must not see), and every member it yields lies inside the input with a safe name.
"""

from __future__ import annotations

import io
import tarfile
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.errors import ShardkitError, UnsafeTarError
from shardkit.format.tarscan import BLOCK, group_members, scan_tar, split_name, wds_split

# Bounded for CI: a few hundred examples per test, each well under a millisecond to scan.
FUZZ = settings(max_examples=400, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

BEYOND = b"\xffBEYOND-THE-INPUT" * 64  # what the file object holds past the end the scanner is given


class Fenced(io.RawIOBase):
    """A seekable file over ``data`` followed by :data:`BEYOND`; records the furthest byte read."""

    def __init__(self, data: bytes) -> None:
        self.data = data + BEYOND
        self.limit = len(data)
        self.pos = 0
        self.furthest = 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        assert whence == 0 and offset >= 0, f"seek({offset}, {whence})"
        self.pos = offset
        return offset

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:  # type: ignore[override]
        end = len(self.data) if n < 0 else self.pos + n
        out = self.data[self.pos:end]
        self.pos += len(out)
        self.furthest = max(self.furthest, self.pos)
        return out


def scan(data: bytes) -> list[Any]:
    """Scan ``data`` as the whole input; check the properties; the members, or [] if refused."""
    f = Fenced(data)
    try:
        members = list(scan_tar(f, name="fuzz.tar", file_size=len(data)))  # type: ignore[arg-type]
    except UnsafeTarError as exc:
        assert "fuzz.tar" in str(exc) and "\n" not in str(exc)
        members = []
    except ShardkitError:  # pragma: no cover - any shardkit error is fine, but name it
        raise AssertionError("scan_tar raised a ShardkitError that is not UnsafeTarError") from None
    assert f.furthest <= len(data), f"read {f.furthest - len(data)} bytes past the end of the input"
    prev_end = 0
    for m in members:
        assert 0 <= m.offset_header < m.offset_data <= m.offset_data + m.size <= len(data)
        assert m.offset_header >= prev_end and m.end <= len(data)
        assert m.name and "\x00" not in m.name and not m.name.startswith(("/", "\\"))
        assert ".." not in m.name.replace("\\", "/").split("/")
        prev_end = m.offset_data + m.size
        split_name(m.name)
        wds_split(m.name)
    list(group_members(members))
    return members


_names = st.text(alphabet=st.sampled_from("ab./_-\\:\x00é0"), min_size=0, max_size=12)


@st.composite
def tars(draw: st.DrawFn) -> bytes:
    """A tar from ``tarfile``: a few members, each plain, with a pax header, or a GNU long name."""
    fmt = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for i in range(draw(st.integers(0, 4))):
            long = fmt != tarfile.USTAR_FORMAT and draw(st.booleans())
            name = f"k{i}." + ("x" * draw(st.integers(100, 300)) if long else draw(st.sampled_from(["jpg", "cls", "a.b"])))
            info = tarfile.TarInfo(name)
            data = draw(st.binary(max_size=700))
            info.size = len(data)
            if fmt == tarfile.PAX_FORMAT and draw(st.booleans()):
                info.pax_headers = {"comment": draw(st.text(max_size=20))}
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _checksum(header: bytearray) -> None:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\x00 " % sum(header)


# Header fields: (offset, length) of name, mode, uid, gid, size, mtime, type, linkname, magic.
_FIELDS = [(0, 100), (100, 8), (108, 8), (116, 8), (124, 12), (136, 12), (156, 1), (157, 100), (257, 8)]
_FIELD_VALUES = st.one_of(
    st.binary(max_size=12),
    st.sampled_from([b"", b"0", b"-1", b"77777777777", b"\x80" + b"\xff" * 11, b"\xff" * 12, b"../x", b"/abs",
                     b"x\x00y", b"L", b"K", b"x", b"g", b"S", b"2", b"1", b"3", b"4", b"5", b"6", b"7", b"D",
                     b"00000001000", b"99999999999", b"ustar\x00", b"ustar  "]),
)
_PAX_BODIES = st.sampled_from([
    b"", b"0 \n", b"5 a=b\n", b"9 size=-1\n", b"13 size=99999\n", b"12 path=../x\n", b"11 path=/ab\n",
    b"99999999999999999999 a=b\n", b"3 =\n", b"6 a=\xff\n", b"x path=a\n", b"8 path=\n", b"1" * 5000 + b" a=b\n",
    b"10 size=1e3\n", b"11 size=1_0\n", b"15 path=a\x00b.c\n",
])


@st.composite
def mutated_tars(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(tars()))
    for _ in range(draw(st.integers(0, 4))):
        what = draw(st.sampled_from(["field", "flip", "truncate", "pax", "insert"]))
        headers = [o for o in range(0, max(len(data) - BLOCK + 1, 0), BLOCK) if data[o:o + BLOCK] != b"\0" * BLOCK]
        if what == "field" and headers:
            at = draw(st.sampled_from(headers))
            off, length = draw(st.sampled_from(_FIELDS))
            value = draw(_FIELD_VALUES)[:length].ljust(length, b"\x00")
            header = bytearray(data[at:at + BLOCK])
            header[off:off + length] = value
            if draw(st.booleans()):
                _checksum(header)
            data[at:at + BLOCK] = header
        elif what == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        elif what == "truncate":
            del data[draw(st.integers(0, len(data))):]
        elif what == "pax":
            # A pax header of a chosen body before a member (or at the end).
            body = draw(_PAX_BODIES)
            header = bytearray(tarfile.TarInfo("././@PaxHeader").tobuf(tarfile.USTAR_FORMAT))[:BLOCK]
            header[156:157] = draw(st.sampled_from([b"x", b"g", b"L", b"K"]))
            header[124:136] = b"%011o\x00" % len(body)
            _checksum(header)
            at = draw(st.sampled_from(headers or [0]))
            data[at:at] = bytes(header) + body + b"\0" * (-len(body) % BLOCK)
        elif what == "insert" and headers:
            at = draw(st.sampled_from(headers))
            data[at:at] = draw(st.binary(max_size=600))
    return bytes(data)


@FUZZ
@given(mutated_tars())
def test_mutated_tars_yield_safe_members_or_refuse(data: bytes) -> None:
    scan(data)


@FUZZ
@given(st.binary(max_size=3 * BLOCK))
def test_random_bytes_are_refused_or_empty(data: bytes) -> None:
    scan(data)


@FUZZ
@given(tars())
def test_untouched_tars_scan_as_tarfile_reads_them(data: bytes) -> None:
    members = scan(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        expect = [(m.name, m.offset_data, m.size) for m in tar.getmembers() if m.isfile()]
    assert [(m.name, m.offset_data, m.size) for m in members] == expect


@FUZZ
@given(_names)
def test_key_rules_take_any_name(name: str) -> None:
    key, field = split_name(name)
    assert isinstance(key, str) and isinstance(field, str)
    got = wds_split(name)
    assert got is None or all(isinstance(x, str) for x in got)


@pytest.mark.parametrize("cut", [1, 100, 511])
def test_a_header_that_crosses_the_end_reads_nothing_past_it(cut: int) -> None:
    """A tar that ends inside a header block: the scanner reads only the bytes it was given,
    though the file object holds more after them (as when a range of a larger object is
    scanned), and refuses the cut header."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("a.bin")
        info.size = 10
        tar.addfile(info, io.BytesIO(b"x" * 10))
    data = buf.getvalue()[:2 * BLOCK + cut]  # the member, then ``cut`` bytes of the next block
    f = Fenced(data)
    with pytest.raises(UnsafeTarError, match="truncated tar header at offset 1024"):
        list(scan_tar(f, name="cut.tar", file_size=len(data)))  # type: ignore[arg-type]
    assert f.furthest <= len(data)
