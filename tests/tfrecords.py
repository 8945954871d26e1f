"""A small TFRecord writer of our own for the tests (the TFRecord source's tests and the docs'
inputs): tf.train.Example by hand (the protobuf wire format) and shardkit's own record framing.

tests/pack/test_sources_tfrecord.py checks it against facts from outside shardkit (RFC 3720's
CRC-32C values and the protobuf library's parser of the Example schema).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from shardkit.packing.sources.tfrecord_frame import frame

__all__ = ["encode_example", "len_field", "varint", "write_tfrecord"]


def varint(n: int) -> bytes:
    """A protobuf varint (negative int64s as their two's complement, ten bytes)."""
    n &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def len_field(number: int, body: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(len(body)) + body


def encode_example(features: dict[str, list[bytes] | list[int] | list[float] | np.ndarray], packed: bool = False) -> bytes:
    """A serialized tf.train.Example: bytes lists, int64 lists (ints) and float lists (floats)."""
    entries = b""
    for name, values in features.items():
        vals = list(values)
        if vals and isinstance(vals[0], bytes):
            feature = len_field(1, b"".join(len_field(1, v) for v in vals))
        elif isinstance(values, np.ndarray) and values.dtype.kind == "f" or (vals and isinstance(vals[0], float)):
            if packed:
                body = len_field(1, b"".join(struct.pack("<f", v) for v in vals))
            else:
                body = b"".join(varint(1 << 3 | 5) + struct.pack("<f", v) for v in vals)
            feature = len_field(2, body)
        else:
            if packed:
                body = len_field(1, b"".join(varint(int(v)) for v in vals))
            else:
                body = b"".join(varint(1 << 3 | 0) + varint(int(v)) for v in vals)
            feature = len_field(3, body)
        entries += len_field(1, len_field(1, name.encode()) + len_field(2, feature))
    return len_field(1, entries)


def write_tfrecord(path: Path, examples: list[bytes]) -> Path:
    """Frame ``examples`` as TFRecords into ``path`` (its folder made), and return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(frame(e) for e in examples))
    return path
