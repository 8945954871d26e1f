"""Field decoders by extension for the samples readers yield: images via PIL, ``.npy`` without
copies, json, txt, cls; or the raw bytes, or a user's callable.

The decoder looks at the last extension of a field name (``image.npy`` -> ``npy``), as
WebDataset does. PIL is imported on first use, so reading raw samples never loads it.
"""

from __future__ import annotations

import io
import json
from typing import Any, Callable

import numpy as np

from shardkit.errors import ConfigError, DecodeError, IntegrityError, ShardkitError, first_line
from shardkit.format.fields import IMAGE_EXTS, TEXT_EXTS

__all__ = ["IMAGE_EXTS", "Decoder", "decode_error", "field_ext", "make_decoder", "npy_view"]

_LABEL_EXTS = ("cls", "cls2", "index", "label")  # an integer class label in ASCII
_META_KEYS = ("__key__", "__index__", "__shard__")

# What ``decode=`` becomes: a sample dict of raw views in, whatever the caller wants out.
Decoder = Callable[[dict[str, Any]], Any]

# numpy's own bound on a .npy header (max_header_size); the magic and length (16 bytes at most)
# come before it.
_NPY_HEADER_MAX = 65536


def npy_view(buf: memoryview | bytes, writable: bool = False, native: bool = True) -> np.ndarray:
    """A numpy array over a ``.npy`` member's bytes, without copying the data.

    Args:
        buf: the member's bytes.
        writable: copy a read-only array, so the caller may write it.
        native: a big-endian array comes back converted to native byte order (a copy), as
            decoders hand it to torch; ``False`` keeps the stored dtype, as ``np.load`` does.

    Returns:
        The array.

    Raises:
        IntegrityError: the bytes are no valid ``.npy``, or hold objects (which need pickle).
    """
    view = memoryview(buf)
    head = bytes(view[:min(len(view), _NPY_HEADER_MAX + 16)])
    bio = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(bio)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(bio, max_header_size=_NPY_HEADER_MAX)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(bio, max_header_size=_NPY_HEADER_MAX)
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


def field_ext(name: str) -> str:
    """The extension a field is decoded by: the last one of its name, lower case.

    Args:
        name: the field name, e.g. ``"image.JPG"`` or ``"jpg"``.

    Returns:
        The extension without its dot (``"jpg"``); a name without a dot is its own extension.
    """
    return name.rsplit(".", 1)[-1].lower()


# Image modes decoded as they are: RGB, 8-bit grayscale and the deeper single-channel modes (a
# 16-bit PNG: depth maps, medical scans), whose values an RGB conversion would clip to 255.
_KEPT_MODES = ("RGB", "L", "I;16", "I;16L", "I;16B", "I", "F")


def _decode_field(name: str, value: memoryview | bytes, images: str) -> Any:
    """One field decoded by its extension; unknown extensions come back as ``bytes``.

    Args:
        name: the field name.
        value: its bytes.
        images: ``"numpy"`` (an HxWx3 uint8 array; HxW for a grayscale image, of uint16,
            int32 or float32 for a 16-bit, 32-bit or float one) or ``"pil"`` (a PIL image:
            RGB, or as stored for those).

    Returns:
        The decoded value.

    Raises:
        IntegrityError: a ``.npy`` field is no valid array.
        Exception: whatever PIL, json or the int/str conversions raise for bytes they cannot
            read (:func:`make_decoder` turns it into a DecodeError naming the sample).
    """
    ext = field_ext(name)
    if ext in IMAGE_EXTS:
        from PIL import Image

        img: Image.Image = Image.open(io.BytesIO(value))
        img = img.convert("RGB") if img.mode not in _KEPT_MODES else img
        return np.asarray(img) if images == "numpy" else img
    if ext == "npy":
        return npy_view(value)
    if ext == "json":
        return json.loads(bytes(value))
    if ext in TEXT_EXTS:
        return bytes(value).decode("utf-8")
    if ext in _LABEL_EXTS:
        return int(bytes(value).decode("ascii").strip())
    return bytes(value)


def _raw(sample: dict[str, Any]) -> dict[str, Any]:
    """Field values as ``bytes`` (what WebDataset yields without a decoder)."""
    return {k: (bytes(v) if isinstance(v, memoryview) else v) for k, v in sample.items()}


def make_decoder(decode: str | Decoder | None) -> Decoder:
    """The decoder a reader applies to each sample.

    Args:
        decode: ``None`` or ``"raw"`` (field values as bytes), ``"pil"`` / ``"numpy"`` (each
            field decoded by its extension: images, ``npy``, ``json``, text and label fields;
            any other as bytes), or a callable applied to the raw sample.

    Returns:
        The decoder. It raises DecodeError, naming the sample and its shard, where a field
        (or the callable) fails; shardkit's own errors pass through.

    Raises:
        ConfigError: ``decode`` is none of those.
    """
    if decode is None or decode == "raw":
        return _raw
    if decode in ("pil", "numpy"):
        mode = str(decode)

        def decoder(sample: dict[str, Any]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for k, v in sample.items():
                try:
                    out[k] = v if k in _META_KEYS else _decode_field(k, v, mode)
                except ShardkitError:
                    raise
                except Exception as exc:
                    raise decode_error(sample, f"field {k!r} does not decode ({mode})", exc) from exc
            return out

        return decoder
    if callable(decode):
        user = decode

        def call_user(sample: dict[str, Any]) -> Any:
            try:
                return user(_raw(sample))
            except ShardkitError:
                raise
            except Exception as exc:
                raise decode_error(sample, f"decode={getattr(user, '__name__', type(user).__name__)} failed", exc) from exc

        return call_user
    raise ConfigError(f"decode: expected None, 'pil', 'numpy' or a callable, got {decode!r}")


def decode_error(sample: dict[str, Any], what: str, exc: Exception) -> DecodeError:
    """One line naming the sample and its shard: in 20 M samples, which one is bad.

    Args:
        sample: the sample that failed (its ``__key__`` and ``__shard__`` name it).
        what: what failed, e.g. ``"field 'jpg' does not decode (numpy)"``.
        exc: the decoder's error (raise the result ``from`` it).

    Returns:
        The error to raise.
    """
    detail = first_line(exc)
    if type(exc).__name__ == "UnidentifiedImageError":
        # PIL's own text names only "<_io.BytesIO object at 0x...>".
        detail = "the bytes are not a recognizable image (PIL knows no image format that starts like them)"
    return DecodeError(f"sample {sample.get('__key__')!r} in {sample.get('__shard__')}: {what}: "
                       f"{type(exc).__name__}: {detail}")
