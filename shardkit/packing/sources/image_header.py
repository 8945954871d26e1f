"""A quick yes for the image headers packs see most (JPEG, PNG), before PIL is asked.

PIL's ``Image.open`` walks a JPEG's markers in Python: at pack time it was the largest CPU
cost of an ImageFolder pack, more than reading and framing the file (benchmarks/RESULTS.md,
"Packing"). :func:`header_ok` walks the same header, up to where ``Image.open`` stops, with
the checks PIL makes on the way, and only for the segments whose checks it knows: anything
else answers False, so PIL still decides (and words the error for) every unusual or broken file.
"""

from __future__ import annotations

import zlib

__all__ = ["header_ok"]

# Start-of-frame markers: 0xC0-0xCF except DHT (C4), JPG (C8) and DAC (CC), which are not frames.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Segments PIL skips or stores without a check: DHT, DAC, DRI, COM.
_SKIPPED = frozenset({0xC4, 0xCC, 0xDD, 0xFE})
_SOS, _DQT = 0xDA, 0xDB
_MAX_SEGMENTS = 64  # a JPEG header with more segments before its scan goes to PIL
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# PNG colour type -> the bit depths PIL maps to a mode.
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
# Chunks PIL stores without a check beyond their length, between IHDR and IDAT.
_PNG_PLAIN = {b"sRGB": 1, b"gAMA": 4, b"pHYs": 9, b"cHRM": 32}


def header_ok(data: bytes | memoryview) -> bool:
    """Whether ``data`` starts with a JPEG or PNG header that ``PIL.Image.open`` would accept.

    True is certain; False means only "not sure": the caller asks PIL.

    Args:
        data: a whole image file's bytes.

    Returns:
        True for a JPEG whose segments up to its first scan are well formed (one 8-bit frame of
        non-zero size with 1, 3 or 4 components; quantization tables whole; application segments
        of the kinds PIL parses without risk) or a PNG whose chunks from IHDR up to IDAT are
        well formed with good CRCs; False otherwise.
    """
    view = memoryview(data)
    if view[:3] == b"\xff\xd8\xff":
        return _jpeg_ok(view)
    if view[:8] == _PNG_SIGNATURE:
        return _png_ok(view)
    return False


def _jpeg_ok(data: memoryview) -> bool:
    pos, end, frame = 2, len(data), False
    for _ in range(_MAX_SEGMENTS):
        if pos + 4 > end or data[pos] != 0xFF:
            return False
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte before the marker
            pos += 1
            continue
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        body = data[pos + 4:pos + 2 + length]
        if length < 2 or pos + 2 + length > end:
            return False
        if marker == _SOS:
            return frame
        if marker in _SOF:
            if frame or not _frame_ok(body):
                return False
            frame = True
        elif marker == _DQT:
            if not _tables_ok(body):
                return False
        elif 0xE0 <= marker <= 0xEF:
            if not _app_ok(marker, body):
                return False
        elif marker not in _SKIPPED:
            return False  # a standalone marker, an end or an extension before the scan
        pos += 2 + length
    return False


def _frame_ok(body: memoryview) -> bool:
    """A start of frame as PIL's SOF handler accepts it."""
    if len(body) < 6:
        return False
    height = int.from_bytes(body[1:3], "big")
    width = int.from_bytes(body[3:5], "big")
    components = body[5]
    return body[0] == 8 and height > 0 and width > 0 and components in (1, 3, 4) and len(body) == 6 + 3 * components


def _tables_ok(body: memoryview) -> bool:
    """Quantization tables that fill the segment exactly (PIL refuses one cut short)."""
    pos = 0
    while pos < len(body):
        pos += 1 + (64 if body[pos] >> 4 == 0 else 128)
    return pos == len(body)


def _app_ok(marker: int, body: memoryview) -> bool:
    """An application segment PIL reads without an error of its own."""
    head = bytes(body[:14])
    if marker == 0xE0 and head.startswith(b"JFIF"):
        return len(body) >= 12  # version, unit and densities
    if marker == 0xE1 and head.startswith(b"Exif"):
        return False  # PIL parses the EXIF for a resolution: its own business
    if marker == 0xE2 and head.startswith(b"ICC_PROFILE"):
        return len(body) >= 14  # sequence number and count
    if marker == 0xE2 and head.startswith(b"MPF"):
        return False  # a multi-picture file: PIL opens it as MPO and parses more
    if marker == 0xEE and head.startswith(b"Adobe"):
        return len(body) >= 7  # the version PIL reads
    if marker == 0xED and head.startswith(b"Photoshop"):
        return False  # resource blocks PIL parses
    return True


def _png_ok(data: memoryview) -> bool:
    pos, end, first = 8, len(data), True
    while pos + 12 <= end:
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind = bytes(data[pos + 4:pos + 8])
        if kind == b"IDAT":
            return not first
        body_end = pos + 8 + length
        if body_end + 4 > end or zlib.crc32(data[pos + 4:body_end]) != int.from_bytes(data[body_end:body_end + 4], "big"):
            return False
        if first:
            if kind != b"IHDR" or length != 13 or not _ihdr_ok(data[pos + 8:body_end]):
                return False
            first = False
        elif _PNG_PLAIN.get(kind) != length:
            return False
        pos = body_end + 4
    return False


def _ihdr_ok(body: memoryview) -> bool:
    """An image header of non-zero size, a depth and colour type PIL maps to a mode, filter 0."""
    width = int.from_bytes(body[0:4], "big")
    height = int.from_bytes(body[4:8], "big")
    depth, colour, filtering = body[8], body[9], body[11]
    return width > 0 and height > 0 and depth in _PNG_DEPTHS.get(colour, ()) and filtering == 0
