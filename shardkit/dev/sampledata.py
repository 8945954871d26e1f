"""Realistic sample data made from real photos that an installed package ships.

scikit-image bundles a handful of real photographs (astronaut, coffee, chelsea, rocket...).
Random crops, scales, flips and colour jitter of them give as many distinct ~100 KB JPEGs as
needed, in an ImageFolder layout (one class per photo). Deterministic for a seed.
"""

from __future__ import annotations

import importlib.util
import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.errors import ConfigError

__all__ = ["make_image_folder"]

_PHOTOS = ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "motorcycle_left.png",
           "hubble_deep_field.jpg", "retina.jpg", "ihc.png", "brick.png", "gravel.png")


def _photo_dir() -> Path:
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("sample data needs scikit-image's bundled photos: pip install scikit-image")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _load_photos() -> dict[str, Any]:
    from PIL import Image

    base = _photo_dir()
    photos = {}
    for name in _PHOTOS:
        path = base / name
        if path.exists():
            photos[name.split(".")[0]] = Image.open(path).convert("RGB")
    if len(photos) < 2:
        raise ConfigError(f"too few bundled photos found in {base}")
    return photos


def _jpeg_variant(img: Any, rng: np.random.Generator, side: int, quality: int) -> bytes:
    """A random crop/scale/flip/jitter of ``img`` as a side x side JPEG."""
    from PIL import Image, ImageEnhance

    w, h = img.size
    crop = int(min(w, h) * rng.uniform(0.45, 1.0))
    x, y = int(rng.integers(0, w - crop + 1)), int(rng.integers(0, h - crop + 1))
    out = img.crop((x, y, x + crop, y + crop)).resize((side, side), Image.Resampling.BILINEAR)
    if rng.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    out = ImageEnhance.Color(out).enhance(rng.uniform(0.6, 1.4))
    out = ImageEnhance.Brightness(out).enhance(rng.uniform(0.8, 1.2))
    arr = np.asarray(out, dtype=np.int16) + rng.integers(-6, 7, size=(side, side, 3), dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def make_image_folder(dest: str | os.PathLike[str], count: int, *, side: int = 512, quality: int = 90,
                      seed: int = 0) -> Path:
    """Write ``count`` JPEGs as ``dest/<photo>/<i>.jpg``, an ImageFolder with one class per photo.

    Deterministic for the arguments; a folder already completed with the same arguments is
    left as it is.

    Args:
        dest: the folder to write.
        count: how many images.
        side: each image's width and height, in pixels.
        quality: the JPEG quality.
        seed: the seed of the random crops, flips and jitter.

    Returns:
        ``dest``, as a Path.

    Raises:
        ConfigError: scikit-image is not installed, or fewer than two of its photos are found.
    """
    root = Path(dest)
    marker = root / f".complete-{count}-{side}-{quality}-{seed}"
    if marker.exists():
        return root
    photos = _load_photos()
    names = sorted(photos)
    rng = np.random.default_rng(seed)
    for i in range(count):
        cls = names[i % len(names)]
        d = root / cls
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:07d}.jpg").write_bytes(_jpeg_variant(photos[cls], rng, side, quality))
    marker.write_text("ok\n")
    return root
