"""In-worker batching: many samples -> one object with few large arrays.

Moving one dict per sample from a DataLoader worker costs a pickle per ``bytes`` object;
moving a batch as a few contiguous arrays costs one shared-memory handoff each. A batch is a
dict: ``__key__`` (list of str), ``__index__`` (int64 array), and per field either a stacked
array (decoded arrays of one shape, ints) or, for raw bytes, a :class:`PackedBytes`-style
pair ``<field>`` = uint8 array of all bodies concatenated and ``<field>.offsets`` = int64
array of n+1 boundaries. :func:`unpack` gives the per-sample views back.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["OFFSETS", "collate", "unpack"]

OFFSETS = ".offsets"  # the suffix of a packed field's boundaries: ``<field>.offsets``


def collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Build one batch from sample dicts.

    Raw bytes fields are packed (``<field>`` + ``<field>.offsets``); arrays of one shape are
    stacked, ints become an int64 array, anything else stays a list. A field that some
    samples lack stays a list, with ``None`` for those samples (as in a zero-copy batch).

    Args:
        samples: sample dicts, each with ``__key__`` and ``__index__``.

    Returns:
        The batch dict (``__shard__`` is dropped).
    """
    batch: dict[str, Any] = {
        "__key__": [s["__key__"] for s in samples],
        "__index__": np.fromiter((s["__index__"] for s in samples), dtype=np.int64, count=len(samples)),
    }
    for name in dict.fromkeys(k for s in samples for k in s):
        if name in ("__key__", "__index__", "__shard__"):
            continue
        if any(name not in s for s in samples):
            batch[name] = [s.get(name) for s in samples]
            continue
        values = [s[name] for s in samples]
        first = values[0]
        if isinstance(first, (bytes, memoryview, bytearray)):
            sizes = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
            offsets = np.zeros(len(values) + 1, dtype=np.int64)
            np.cumsum(sizes, out=offsets[1:])
            data = np.empty(int(offsets[-1]), dtype=np.uint8)
            for v, lo, hi in zip(values, offsets[:-1], offsets[1:]):
                data[lo:hi] = np.frombuffer(v, dtype=np.uint8)
            batch[name] = data
            batch[name + OFFSETS] = offsets
        elif isinstance(first, np.ndarray) and all(isinstance(v, np.ndarray) and v.shape == first.shape for v in values):
            batch[name] = np.stack(values)
        elif isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            batch[name] = np.asarray(values, dtype=np.int64)
        else:
            batch[name] = values
    return batch


def unpack(batch: dict[str, Any], field: str) -> list[memoryview | None]:
    """The per-sample bodies of a raw bytes field of a batch (views, no copies).

    Args:
        batch: a batch dict (numpy arrays or tensors).
        field: a raw field, packed (``<field>`` + ``<field>.offsets``) or a list (a zero-copy
            batch, or a field some samples lack).

    Returns:
        One memoryview per sample, ``None`` for a sample that lacks the field.

    Raises:
        KeyError: the batch has no such field.
    """
    data = batch[field]
    if isinstance(data, list):
        return [None if v is None else memoryview(v).cast("B") for v in data]
    offsets = batch[field + OFFSETS]
    buf = memoryview(data.numpy() if hasattr(data, "numpy") else data).cast("B")
    bounds = offsets.tolist()
    return [buf[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
