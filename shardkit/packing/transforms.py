"""Opt-in pack-time image transforms: re-encode, resize, BGR->RGB, pre-decode to ``.npy``.

Applied inside pack tasks to every image field of a sample. Pre-decoding stores uint8
HxWxC arrays so training skips JPEG decode entirely (more bytes, no decode CPU).
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image

from shardkit.errors import ConfigError, SourceError
from shardkit.format.fields import PACK_IMAGE_EXTS
from shardkit.packing.sample import PackSample, StreamedField

__all__ = ["ImageTransform", "transform_from_options"]

_IMAGE_FIELDS = PACK_IMAGE_EXTS  # the fields a transform re-encodes
_FORMATS = {"jpeg": ("JPEG", "jpg"), "jpg": ("JPEG", "jpg"), "webp": ("WEBP", "webp"), "png": ("PNG", "png")}


@dataclass(frozen=True)
class ImageTransform:
    """Re-encode (``reencode="jpeg:90"``), resize (shorter side), swap BGR->RGB, or pre-decode.

    Attributes:
        reencode: ``jpeg[:Q]``, ``webp[:Q]`` or ``png``.
        resize: the shorter side to resize to, in pixels.
        bgr_to_rgb: swap the channels of 3-channel images.
        predecode: store images decoded, as uint8 HxWxC ``.npy``.

    Raises:
        ConfigError: a bad format or size, or ``predecode`` with ``reencode``.
    """

    reencode: str | None = None
    resize: int | None = None
    bgr_to_rgb: bool = False
    predecode: bool = False

    def __post_init__(self) -> None:
        if self.reencode is not None:
            fmt, _, q = self.reencode.partition(":")
            if fmt.lower() not in _FORMATS or (q and not q.isdigit()):
                raise ConfigError(f"--reencode: expected jpeg[:Q], webp[:Q] or png, got {self.reencode!r}")
        if self.resize is not None and self.resize < 1:
            raise ConfigError(f"--resize: expected a positive shorter side, got {self.resize}")
        if self.predecode and self.reencode:
            raise ConfigError("--predecode and --reencode exclude each other")

    def describe(self) -> dict[str, Any]:
        """Describe the transform for dataset.json.

        Returns:
            The options that are set (falsy ones left out), by name.
        """
        return {k: v for k, v in asdict(self).items() if v}

    def __call__(self, sample: PackSample) -> PackSample:
        """Apply the transform to every image field of ``sample``.

        Args:
            sample: the sample as its source loaded it.

        Returns:
            A new sample (an image field may change its name: ``x.png`` -> ``x.npy``).

        Raises:
            SourceError: an image field is no readable image.
        """
        fields = dict(sample.fields)
        for name in [n for n in fields if n.rsplit(".", 1)[-1].lower() in _IMAGE_FIELDS]:
            value = fields.pop(name)
            if isinstance(value, StreamedField):
                value = b"".join(value.chunks())
            new_name, data = self._apply(name, value, sample.key)
            fields[new_name] = data
        return PackSample(sample.key, fields, sample.meta)

    def _apply(self, name: str, data: bytes, key: str) -> tuple[str, bytes]:
        try:
            img: Image.Image = Image.open(io.BytesIO(data))
            img.load()
        except Exception as exc:  # noqa: BLE001 - PIL raises many types for corrupt images
            raise SourceError(f"sample {key!r}: field {name!r} is not a readable image: {exc}") from exc
        if img.mode not in ("RGB", "L"):
            img = img.convert("RGB")
        if self.resize:
            w, h = img.size
            scale = self.resize / min(w, h)
            img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BILINEAR)
        if self.bgr_to_rgb and img.mode == "RGB":
            r, g, b = img.split()
            img = Image.merge("RGB", (b, g, r))
        stem = name.rsplit(".", 1)[0] if "." in name else ""
        prefix = f"{stem}." if stem else ""
        if self.predecode:
            buf = io.BytesIO()
            np.save(buf, np.asarray(img), allow_pickle=False)
            return f"{prefix}npy", buf.getvalue()
        if self.reencode or self.resize or self.bgr_to_rgb:
            fmt, _, q = (self.reencode or "").partition(":")
            pil_fmt, ext = _FORMATS.get(fmt.lower(), _FORMATS["png" if name.endswith("png") else "jpeg"])
            buf = io.BytesIO()
            img.save(buf, pil_fmt, **({"quality": int(q)} if q else {}))
            return f"{prefix}{ext}", buf.getvalue()
        return name, data


def transform_from_options(*, reencode: str | None = None, resize: int | None = None, bgr_to_rgb: bool = False,
                           predecode: bool = False) -> ImageTransform | None:
    """The transform the CLI's options ask for, or None when they ask for none.

    Args:
        reencode: ``--reencode``.
        resize: ``--resize``.
        bgr_to_rgb: ``--bgr-to-rgb``.
        predecode: ``--predecode``.

    Returns:
        The transform, or None.

    Raises:
        ConfigError: as :class:`ImageTransform`.
    """
    if not (reencode or resize or bgr_to_rgb or predecode):
        return None
    return ImageTransform(reencode, resize, bgr_to_rgb, predecode)
