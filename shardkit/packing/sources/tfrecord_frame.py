"""The TFRecord framing: records, their lengths and their masked CRC-32C checksums.

A TFRecord file is a run of records, each (``tensorflow/core/lib/io/record_writer.cc``,
https://www.tensorflow.org/tutorials/load_data/tfrecord)::

    uint64 length           little-endian
    uint32 masked_crc32c(length bytes)
    byte   data[length]
    uint32 masked_crc32c(data)

with ``masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8`` (mod 2**32), CRC-32C being the
Castagnoli CRC (RFC 3720). CRC-32C comes from ``google_crc32c`` when installed (the
``shardkit[tfrecord]`` extra), else from a table in pure Python (slow, but the same value).
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO, Callable, Iterator

from shardkit.errors import SourceError

__all__ = ["HEADER_BYTES", "FOOTER_BYTES", "GZIP_MAGIC", "crc32c", "frame", "masked_crc", "scan_records",
           "unframe"]

HEADER_BYTES = 12
FOOTER_BYTES = 4
GZIP_MAGIC = b"\x1f\x8b"
_MASK_DELTA = 0xA282EAD8


def _table() -> list[int]:
    poly, table = 0x82F63B78, []  # CRC-32C's polynomial, bit-reversed
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


def _crc32c_python(data: bytes | memoryview) -> int:
    table, crc = _TABLE, 0xFFFFFFFF
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


_TABLE = _table()
_crc: Callable[[Any], int]
try:
    import google_crc32c as _google

    def _crc(data: Any) -> int:
        return int(_google.value(bytes(data)))
except ImportError:  # pragma: no cover - exercised by a test that hides the package
    _crc = _crc32c_python


def crc32c(data: bytes | memoryview) -> int:
    """The CRC-32C (Castagnoli) of ``data``.

    Args:
        data: the bytes.

    Returns:
        The checksum, an unsigned 32-bit integer.
    """
    return _crc(data)


def masked_crc(data: bytes | memoryview) -> int:
    """The masked CRC-32C TFRecord stores for ``data``.

    Args:
        data: the bytes (a length field or a record's payload).

    Returns:
        ``((crc >> 15) | (crc << 17)) + 0xa282ead8``, modulo 2**32.
    """
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One TFRecord record holding ``data``.

    Args:
        data: the payload (a serialized Example).

    Returns:
        The framed record.
    """
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


def scan_records(f: BinaryIO, size: int, name: str,
                 bad: Callable[[int, int, str], None]) -> Iterator[tuple[int, int, int]]:
    """(index, offset, payload length) of each record, reading only the 12-byte headers and
    seeking over the payloads.

    A header whose length CRC is wrong, or a record running past the end of the file, ends
    the scan: the framing after it cannot be trusted. ``bad`` is told (and may raise).

    Args:
        f: the file, open for binary reading, seekable.
        size: its size in bytes.
        name: the file, for messages.
        bad: called with (record index, byte offset, reason) for the record that ends the scan.

    Yields:
        (record index, byte offset of its header, payload length).
    """
    offset = index = 0
    while offset < size:
        f.seek(offset)
        header = f.read(HEADER_BYTES)
        where = f"{name}: record {index} at byte {offset}"
        if len(header) < HEADER_BYTES:
            bad(index, offset, f"{where}: truncated record header ({len(header)} of {HEADER_BYTES} bytes)")
            return
        (length,) = struct.unpack_from("<Q", header)
        (stored,) = struct.unpack_from("<I", header, 8)
        if stored != masked_crc(header[:8]):
            # Checked only now: a valid record's length may start with the gzip magic bytes too.
            if index == 0 and header.startswith(GZIP_MAGIC):
                raise SourceError(f"{name}: a gzip-compressed TFRecord file; shardkit reads uncompressed TFRecords "
                                  "only: decompress it (gunzip) and pack that")
            what = "not a TFRecord file, a compressed (ZLIB) one, or corrupt" if index == 0 else "corrupt"
            bad(index, offset, f"{where}: length CRC mismatch (corrupt record header): {what}")
            return
        end = offset + HEADER_BYTES + length + FOOTER_BYTES
        if end > size:
            bad(index, offset, f"{where}: truncated record ({length} payload bytes declared, the file ends "
                               f"{size - offset} bytes after the record's start)")
            return
        yield index, offset, length
        offset, index = end, index + 1


def unframe(record: bytes, name: str) -> memoryview:
    """The payload of one framed record (header, payload, footer), both CRCs checked.

    Args:
        record: the record's bytes, exactly.
        name: the record (file, index, offset), for errors.

    Returns:
        The payload, a view into ``record``.

    Raises:
        SourceError: a CRC mismatch or a record of the wrong size, naming ``name``.
    """
    if len(record) < HEADER_BYTES + FOOTER_BYTES:
        raise SourceError(f"{name}: truncated record ({len(record)} bytes)")
    (length,) = struct.unpack_from("<Q", record)
    if len(record) != HEADER_BYTES + length + FOOTER_BYTES:
        raise SourceError(f"{name}: truncated record ({len(record)} bytes, its header declares "
                          f"{length} payload bytes): the file changed since it was listed?")
    if struct.unpack_from("<I", record, 8)[0] != masked_crc(record[:8]):
        raise SourceError(f"{name}: length CRC mismatch (corrupt record header)")
    view = memoryview(record)
    payload = view[HEADER_BYTES:HEADER_BYTES + length]
    if struct.unpack_from("<I", record, HEADER_BYTES + length)[0] != masked_crc(payload):
        raise SourceError(f"{name}: data CRC mismatch (corrupt record)")
    return payload
