"""The fast image header check never accepts what PIL refuses, and takes the common files itself."""

from __future__ import annotations

import io
import random

import pytest
from PIL import Image

from shardkit.packing.sources.image_header import header_ok


def _image(fmt: str, mode: str, **save: object) -> bytes:
    img = Image.new(mode, (37, 23), 0 if mode in ("L", "1", "P") else (10, 200, 30, 0)[:len(mode)])
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def _pil_accepts(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)):
            return True
    except Exception:  # noqa: BLE001 - PIL raises many types for corrupt headers
        return False


COMMON = {
    "jpeg RGB": _image("JPEG", "RGB"),
    "jpeg L": _image("JPEG", "L"),
    "jpeg CMYK": _image("JPEG", "CMYK"),
    "jpeg progressive": _image("JPEG", "RGB", progressive=True),
    "jpeg with ICC profile": _image("JPEG", "RGB", icc_profile=b"\0" * 300),
    "jpeg with DPI": _image("JPEG", "RGB", dpi=(300, 300)),
    "png RGB": _image("PNG", "RGB"),
    "png RGBA": _image("PNG", "RGBA"),
    "png L": _image("PNG", "L"),
    "png 1-bit": _image("PNG", "1"),
    "png with DPI": _image("PNG", "RGB", dpi=(96, 96)),
}


@pytest.mark.parametrize("name", sorted(COMMON))
def test_common_images_are_accepted_without_pil(name: str) -> None:
    assert header_ok(COMMON[name]), name


@pytest.mark.parametrize("name", ["jpeg with EXIF", "gif", "bmp", "webp", "tiff"])
def test_other_headers_are_left_to_pil(name: str) -> None:
    exif = Image.Exif()
    exif[0x010F] = "camera"
    data = {"jpeg with EXIF": lambda: _image("JPEG", "RGB", exif=exif.tobytes()),
            "gif": lambda: _image("GIF", "P"), "bmp": lambda: _image("BMP", "RGB"),
            "webp": lambda: _image("WEBP", "RGB"), "tiff": lambda: _image("TIFF", "RGB")}[name]()
    assert _pil_accepts(data)
    assert not header_ok(data)


def _mutations(data: bytes, rng: random.Random, n: int) -> list[bytes]:
    """Headers with a byte changed, cut short or a segment length bent: what disks and bad copies do."""
    out = []
    header = min(len(data), 700)
    for _ in range(n):
        b = bytearray(data)
        kind = rng.randrange(3)
        if kind == 0:
            b[rng.randrange(header)] = rng.randrange(256)
        elif kind == 1:
            b = b[:rng.randrange(header)]
        else:
            i = rng.randrange(header - 1)
            b[i:i + 2] = rng.randrange(65536).to_bytes(2, "big")
        out.append(bytes(b))
    return out


@pytest.mark.parametrize("name", sorted(COMMON))
def test_no_broken_header_is_accepted_that_pil_refuses(name: str) -> None:
    rng = random.Random(name)
    accepted = refused_by_both = 0
    for data in _mutations(COMMON[name], rng, 400):
        if header_ok(data):
            accepted += 1
            assert _pil_accepts(data), f"{name}: accepted a header PIL refuses: {data[:64]!r}"
        elif not _pil_accepts(data):
            refused_by_both += 1
    # Both branches were exercised: some damage is harmless (pixel bytes), some is fatal.
    assert accepted > 0 and refused_by_both > 0, (accepted, refused_by_both)
