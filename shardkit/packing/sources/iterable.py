"""Any Python iterable of dicts as a pack source (streamed, local engine).

Each dict is a WebDataset-style sample: ``{"__key__": "0001", "jpg": b"...", "cls": 3}``;
field names are lowercased (``"JPG"`` is field ``jpg``), as the webdataset library reads them.
Values are encoded by type: bytes as is, str as UTF-8, int/float as text, numpy arrays as
``.npy``, dicts and lists as JSON. ``"__meta__": {...}`` holds manifest metadata columns.
"""

from __future__ import annotations

import io
import json
import logging
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from shardkit.errors import SourceError
from shardkit.packing.key_ledger import KeySet
from shardkit.packing.sample import (MANIFEST_COLUMNS, FieldValue, PackSample, StreamedField, case_clash,
                                     case_clash_reason, safe_key)

__all__ = ["samples_from_iterable"]

log = logging.getLogger(__name__)


def _encode_value(key: str, field: str, value: Any) -> FieldValue:
    """A sample dict's value as a member body, encoded by its type (see the module docstring).

    Args:
        key: the sample's key, for the error.
        field: the field, for the error.
        value: the value.

    Returns:
        The body: bytes, or a StreamedField passed through.

    Raises:
        SourceError: a type with no encoding.
    """
    if isinstance(value, (bytes, StreamedField)):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bool, np.bool_)):
        return str(int(value)).encode()
    if isinstance(value, (int, float, np.integer, np.floating)):
        return str(value).encode()
    if isinstance(value, np.ndarray):
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return buf.getvalue()
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True).encode()
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    raise SourceError(f"sample {key!r}: field {field!r} has unsupported type {name}")


def samples_from_iterable(items: Iterable[dict[str, Any]],
                          skipped: list[dict[str, str]] | None = None,
                          default_key: Callable[[int], str] | None = None) -> Iterator[PackSample]:
    """Validate and encode dict samples; keys default to the running index.

    Field names are lowercased, as the webdataset library reads them.

    Args:
        items: the sample dicts.
        skipped: with ``on_error="skip"``, gets each bad item (left out) as dataset.json's
            ``skipped`` lists bad samples; None raises on the first.
        default_key: the key of item ``i`` without a ``__key__`` (default: ``i`` in 9 digits).

    Yields:
        The samples, in order.

    Raises:
        SourceError: naming a bad item (not a dict, a repeated key, no fields, a reserved
            ``__meta__`` name, fields differing only in case, a value of no supported type).
    """
    seen = KeySet()  # 16 bytes a slot whatever the keys: an endless iterable holds no key strings
    for i, item in enumerate(items):
        key = ""
        try:
            if not isinstance(item, dict):
                raise SourceError(f"item {i} of the iterable is a {type(item).__name__}, expected a dict")
            raw = item.get("__key__", default_key(i) if default_key is not None else f"{i:09d}")
            key = safe_key(str(raw) if not isinstance(raw, bytes) else raw)
            sample = _sample(i, key, raw, item)
            if not seen.add(key):
                raise SourceError(f"duplicate key {key!r} in the iterable (item {i}); each sample needs a key of "
                                  "its own: give the items distinct '__key__'s")
        except SourceError as exc:
            if skipped is None:
                raise
            log.warning("skipped item %d: %s", i, exc)
            skipped.append({"ref": f"item {i}", "key": key, "reason": str(exc)})
            continue
        yield sample


def _sample(i: int, key: str, raw: Any, item: dict[str, Any]) -> PackSample:
    meta = dict(item.get("__meta__") or {})
    reserved = sorted(MANIFEST_COLUMNS.intersection(meta))
    if reserved:  # refused now: the manifest would refuse it only after the shards were written
        raise SourceError(f"sample {key!r} (item {i}): __meta__ name {reserved[0]!r} is reserved (the manifest "
                          f"has its own {reserved[0]!r} column); rename it")
    if key != raw:
        # The manifest needs valid UTF-8: undecodable bytes (or their surrogate escapes) -> U+FFFD.
        raw_bytes = raw if isinstance(raw, bytes) else str(raw).encode("utf-8", "surrogateescape")
        meta.setdefault("source", raw_bytes.decode("utf-8", "replace"))
    names = [f for f in item if not f.startswith("__")]
    if not names:
        raise SourceError(f"sample {key!r} (item {i}) has no fields")
    clash = case_clash(names)
    if clash is not None:
        raise SourceError(f"sample {key!r} (item {i}): {case_clash_reason(*clash)}")
    return PackSample(key, {f.lower(): _encode_value(key, f, item[f]) for f in names}, meta)
