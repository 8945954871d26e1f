"""Any Python iterable of dicts as a pack source (streamed, local engine).

Each dict is a WebDataset-style sample: ``{"__key__": "0001", "jpg": b"...", "cls": 3}``.
Values are encoded by type: bytes as is, str as UTF-8, int/float as text, numpy arrays as
``.npy``, dicts and lists as JSON. ``"__meta__": {...}`` holds manifest metadata columns.
"""

from __future__ import annotations

import io
import json
from typing import Any, Iterable, Iterator

import numpy as np

from ..errors import SourceError
from ..sample import MANIFEST_COLUMNS, FieldValue, PackSample, StreamedField, case_clash, case_clash_reason, safe_key


def encode_value(key: str, field: str, value: Any) -> FieldValue:
    if isinstance(value, (bytes, StreamedField)):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bool):
        return str(int(value)).encode()
    if isinstance(value, (int, float, np.integer, np.floating)):
        return str(value).encode()
    if isinstance(value, np.ndarray):
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return buf.getvalue()
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True).encode()
    raise SourceError(f"sample {key!r}: field {field!r} has unsupported type {type(value).__name__}")


def samples_from_iterable(items: Iterable[dict[str, Any]]) -> Iterator[PackSample]:
    """Validate and encode dict samples; keys default to the running index."""
    seen: set[str] = set()
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise SourceError(f"item {i} of the iterable is a {type(item).__name__}, expected a dict")
        raw = item.get("__key__", f"{i:09d}")
        key = safe_key(str(raw) if not isinstance(raw, bytes) else raw)
        if key in seen:
            raise SourceError(f"duplicate key {key!r} in the iterable (item {i})")
        seen.add(key)
        meta = dict(item.get("__meta__") or {})
        reserved = sorted(MANIFEST_COLUMNS.intersection(meta))
        if reserved:  # refused now: the manifest would refuse it only after the shards were written
            raise SourceError(f"sample {key!r} (item {i}): __meta__ name {reserved[0]!r} is reserved (the manifest "
                              f"has its own {reserved[0]!r} column); rename it")
        if key != raw:
            # The manifest needs valid UTF-8: undecodable bytes (or their surrogate escapes) -> U+FFFD.
            raw_bytes = raw if isinstance(raw, bytes) else str(raw).encode("utf-8", "surrogateescape")
            meta.setdefault("source", raw_bytes.decode("utf-8", "replace"))
        fields = {f: encode_value(key, f, v) for f, v in item.items() if not f.startswith("__")}
        if not fields:
            raise SourceError(f"sample {key!r} (item {i}) has no fields")
        clash = case_clash(fields)
        if clash is not None:
            raise SourceError(f"sample {key!r} (item {i}): {case_clash_reason(*clash)}")
        yield PackSample(key, fields, meta)
