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

from shardkit.batch import worker_slots

__all__ = ["OFFSETS", "collate", "unpack"]

OFFSETS = ".offsets"  # the suffix of a packed field's boundaries: ``<field>.offsets``


def collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Build one batch from sample dicts.

    Raw bytes fields are packed (``<field>`` + ``<field>.offsets``); arrays of one shape are
    stacked, ints become an int64 array, anything else stays a list. A field that some
    samples lack stays a list, with ``None`` for those samples (as in a zero-copy batch).
    In a DataLoader worker of a shardkit stream, the packed and stacked arrays are written
    into the worker's shared slots (:mod:`shardkit.batch.worker_slots`) where one is free, so
    they reach the main process without being pickled.

    Args:
        samples: sample dicts, each with ``__key__`` and ``__index__``.

    Returns:
        The batch dict (``__shard__`` is dropped).
    """
    n = len(samples)
    batch: dict[str, Any] = {
        "__key__": [s["__key__"] for s in samples],
        "__index__": np.fromiter((s["__index__"] for s in samples), dtype=np.int64, count=n),
    }
    first_keys = samples[0].keys() if n else ()
    same = all(s.keys() == first_keys for s in samples)  # the usual case: one pass finds the names
    names = list(first_keys) if same else list(dict.fromkeys(k for s in samples for k in s))
    big: list[tuple[str, list[Any], tuple[int, ...], Any, bool]] = []  # packed / stacked: filled below
    for name in names:
        if name in ("__key__", "__index__", "__shard__"):
            continue
        if not same and any(name not in s for s in samples):
            batch[name] = [s.get(name) for s in samples]
            continue
        values = [s[name] for s in samples]
        first = values[0]
        if isinstance(first, (bytes, memoryview, bytearray)):
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(np.fromiter(map(len, values), dtype=np.int64, count=n), out=offsets[1:])
            batch[name] = None  # its place in the dict; the array comes below
            batch[name + OFFSETS] = offsets
            big.append((name, values, (int(offsets[-1]),), np.dtype(np.uint8), True))
        elif isinstance(first, np.ndarray) and all(isinstance(v, np.ndarray) and v.shape == first.shape
                                                   and v.dtype == first.dtype for v in values):
            batch[name] = None
            big.append((name, values, (n, *first.shape), first.dtype, False))
        elif isinstance(first, np.ndarray) and all(isinstance(v, np.ndarray) and v.shape == first.shape
                                                   for v in values):
            batch[name] = np.stack(values)  # mixed dtypes: numpy's promotion, in ordinary memory
        elif isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            batch[name] = np.asarray(values, dtype=np.int64)
        else:
            batch[name] = values
    if big:
        slots = worker_slots.current()
        outs = slots.take([(shape, dtype) for _, _, shape, dtype, _ in big]) if slots is not None else None
        for k, (name, values, shape, dtype, packed) in enumerate(big):
            out = outs[k] if outs is not None else np.empty(shape, dtype)
            if packed:  # each body at its offset
                bounds = batch[name + OFFSETS].tolist()
                for v, lo, hi in zip(values, bounds, bounds[1:]):
                    out[lo:hi] = np.frombuffer(v, dtype=np.uint8)
            else:
                np.stack(values, out=out)
            batch[name] = out
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
