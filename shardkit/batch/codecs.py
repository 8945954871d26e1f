"""The ``CenterCrop`` image decoder (the field decoders by extension are
:mod:`shardkit.read.decode`'s: readers apply them).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from shardkit.errors import ConfigError
from shardkit.read.decode import IMAGE_EXTS
from shardkit.read.decode import decode_error as _failed
from shardkit.read.decode import field_ext as _ext

__all__ = ["CenterCrop"]


class CenterCrop:
    """Decode the image field to a ``size`` x ``size`` x 3 uint8 array: resize the shorter side
    to ``resize`` (default ``size * 256 / 224``, the usual evaluation transform), then crop the centre.

    JPEGs are decoded at reduced scale when they are at least twice the resize target (PIL's
    ``draft``: libjpeg scales during decode), which costs far less than a full-size decode;
    when the scaled decode lands on the target exactly, no resize runs at all. Picklable, so
    it can be passed as ``decode=`` into DataLoader workers. Class label fields (``cls``,
    ``cls2``, ``index``, ``label``) come back as ints.

    Args:
        size: the side of the square crop.
        resize: the shorter side after resizing (default ``size * 256 / 224``).
        field: the image field to decode (default: the sample's first image field).
        as_field: the name the pixels go under (default: the image field's own), so that a
            dataset mixing ``.jpg`` and ``.png`` batches into one ``[B, size, size, 3]`` array.
    """

    def __init__(self, size: int = 224, resize: int | None = None, field: str | None = None,
                 as_field: str | None = None) -> None:
        self.size = size
        self.resize = resize or round(size * 256 / 224)
        self.field = field
        self.as_field = as_field

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        """Decode and crop the image field of ``sample``.

        Args:
            sample: a raw sample dict.

        Returns:
            A new dict: the pixels as a ``(size, size, 3)`` uint8 array, labels as ints.

        Raises:
            ConfigError: the sample has no image field.
            DecodeError: the image field is not a decodable image.
        """
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
