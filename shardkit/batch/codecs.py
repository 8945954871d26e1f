"""Field decoders by extension: images via PIL, ``.npy`` without copies, json, txt, cls.

The decoder looks at the last extension of a field name (``image.npy`` -> ``npy``), as
WebDataset does. Heavy imports (PIL) happen on first use.
"""

from __future__ import annotations

import io
import json
from typing import Any, Callable

import numpy as np

from shardkit.errors import ConfigError, DecodeError, IntegrityError, ShardkitError, first_line
from shardkit.format.fields import IMAGE_EXTS, TEXT_EXTS

META_KEYS = ("__key__", "__index__", "__shard__")

Decoder = Callable[[dict[str, Any]], Any]


def npy_view(buf: memoryview | bytes, writable: bool = False, native: bool = True) -> np.ndarray:
    """A numpy array over a ``.npy`` member's bytes, without copying the data.

    ``native``: a big-endian array comes back converted to native byte order (a copy), as
    decoders hand it to torch; ``False`` keeps the stored dtype, as ``np.load`` does."""
    view = memoryview(buf)
    head = bytes(view[:min(len(view), 65536 + 16)])
    bio = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(bio)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(bio, max_header_size=65536)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(bio, max_header_size=65536)
    except ValueError as exc:
        raise IntegrityError(f"not a valid .npy member: {exc}") from exc
    if dtype.hasobject:
        raise IntegrityError("refusing a .npy member with object dtype (would need pickle)")
    count = int(np.prod(shape)) if shape else 1
    arr = np.frombuffer(view, dtype=dtype, count=count, offset=bio.tell())
    arr = arr.reshape(shape, order="F" if fortran else "C")
    if native and not arr.dtype.isnative:  # big-endian (HDF5, FITS): torch takes only native byte order
        return arr.astype(arr.dtype.newbyteorder("="))
    if writable and not arr.flags.writeable:
        arr = arr.copy()
    return arr


def _ext(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()


def decode_field(name: str, value: memoryview | bytes, images: str) -> Any:
    ext = _ext(name)
    if ext in IMAGE_EXTS:
        from PIL import Image

        img: Image.Image = Image.open(io.BytesIO(value))
        img = img.convert("RGB") if img.mode not in ("RGB", "L") else img
        return np.asarray(img) if images == "numpy" else img
    if ext == "npy":
        return npy_view(value)
    if ext == "json":
        return json.loads(bytes(value))
    if ext in TEXT_EXTS:
        return bytes(value).decode("utf-8")
    if ext in ("cls", "cls2", "index", "label"):
        return int(bytes(value).decode("ascii").strip())
    return bytes(value)


def raw(sample: dict[str, Any]) -> dict[str, Any]:
    """Field values as ``bytes`` (what WebDataset yields without a decoder)."""
    return {k: (bytes(v) if isinstance(v, memoryview) else v) for k, v in sample.items()}


def make_decoder(decode: str | Decoder | None) -> Decoder:
    """``None`` -> raw bytes; ``"pil"`` / ``"numpy"`` -> decoded fields; a callable -> applied to raw."""
    if decode is None or decode == "raw":
        return raw
    if decode in ("pil", "numpy"):
        mode = str(decode)

        def decoder(sample: dict[str, Any]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for k, v in sample.items():
                try:
                    out[k] = v if k in META_KEYS else decode_field(k, v, mode)
                except ShardkitError:
                    raise
                except Exception as exc:
                    raise _failed(sample, f"field {k!r} does not decode ({mode})", exc) from exc
            return out

        return decoder
    if callable(decode):
        user = decode

        def call_user(sample: dict[str, Any]) -> Any:
            try:
                return user(raw(sample))
            except ShardkitError:
                raise
            except Exception as exc:
                raise _failed(sample, f"decode={getattr(user, '__name__', type(user).__name__)} failed", exc) from exc

        return call_user
    raise ConfigError(f"decode: expected None, 'pil', 'numpy' or a callable, got {decode!r}")


def _failed(sample: dict[str, Any], what: str, exc: Exception) -> DecodeError:
    """One line naming the sample and its shard: in 20 M samples, which one is bad."""
    detail = first_line(exc)
    if type(exc).__name__ == "UnidentifiedImageError":
        # PIL's own text names only "<_io.BytesIO object at 0x...>".
        detail = "the bytes are not a recognizable image (PIL knows no image format that starts like them)"
    return DecodeError(f"sample {sample.get('__key__')!r} in {sample.get('__shard__')}: {what}: "
                       f"{type(exc).__name__}: {detail}")


class CenterCrop:
    """Decode the image field to a ``size`` x ``size`` x 3 uint8 array: resize the shorter side
    to ``resize`` (default ``size * 256 / 224``, the usual evaluation transform), then crop the centre.

    JPEGs are decoded at reduced scale when they are at least twice the resize target (PIL's
    ``draft``: libjpeg scales during decode), which cuts decode time several-fold; when the
    scaled decode lands on the target exactly, no resize runs at all. Picklable, so it can be
    passed as ``decode=`` into DataLoader workers.

    ``field``: the image field to decode (default: the sample's first image field).
    ``as_field``: the name the pixels go under (default: the image field's own), so that a
    dataset mixing ``.jpg`` and ``.png`` batches into one ``[B, size, size, 3]`` array.
    """

    def __init__(self, size: int = 224, resize: int | None = None, field: str | None = None,
                 as_field: str | None = None) -> None:
        self.size = size
        self.resize = resize or round(size * 256 / 224)
        self.field = field
        self.as_field = as_field

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        from PIL import Image

        name = self.field or next((k for k in sample if _ext(k) in IMAGE_EXTS), None)
        if name is None:
            raise ConfigError(f"sample {sample.get('__key__')!r} has no image field")
        try:
            img: Image.Image = Image.open(io.BytesIO(sample[name]))
        except Exception as exc:  # noqa: BLE001 - PIL raises many types for bytes that are no image
            raise _failed(sample, f"field {name!r} does not decode (CenterCrop)", exc) from exc
        img.draft("RGB", (self.resize, self.resize))
        if img.mode != "RGB":
            img = img.convert("RGB")
        w, h = img.size
        if min(w, h) != self.resize:
            scale = self.resize / min(w, h)
            img = img.resize((max(self.resize, round(w * scale)), max(self.resize, round(h * scale))), Image.Resampling.BILINEAR)
            w, h = img.size
        left, top = (w - self.size) // 2, (h - self.size) // 2
        out = dict(sample)
        if self.as_field is not None:
            del out[name]
        out[self.as_field or name] = np.asarray(img.crop((left, top, left + self.size, top + self.size)))
        for k, v in sample.items():
            if _ext(k) in ("cls", "cls2", "index", "label") and isinstance(v, (bytes, memoryview)):
                out[k] = int(bytes(v))
        return out
