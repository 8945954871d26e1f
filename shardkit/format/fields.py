"""Field names by extension: which fields hold images or text, shared by the pack and read sides.

A field's kind is its last extension, as WebDataset reads it (``image.jpg`` -> ``jpg``). The
sets live here, below both sides, so the packer and the decoders never disagree on them.
"""

from __future__ import annotations

__all__ = ["IMAGE_EXTS", "PACK_IMAGE_EXTS", "TEXT_EXTS"]

# Fields the decoders open as images (with PIL), netpbm formats included.
IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm"})
# Image files the pack side recognises by name: what an ImageFolder source packs, and the
# fields pack-time transforms re-encode. The common formats only (no netpbm).
PACK_IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff"})
# Fields the decoders return as UTF-8 text.
TEXT_EXTS = frozenset({"txt", "text", "transcript"})
