"""A small decoder of ``tf.train.Example`` protocol buffers, without TensorFlow or protobuf.

Only what an Example holds is decoded (``tensorflow/core/example/example.proto`` and
``feature.proto``)::

    Example  { Features features = 1; }
    Features { map<string, Feature> feature = 1; }      // map entry: key = 1, value = 2
    Feature  { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }
    FloatList { repeated float value = 1 [packed = true]; }
    Int64List { repeated int64 value = 1 [packed = true]; }

The wire format rules followed (https://protobuf.dev/programming-guides/encoding/): varints of
at most 10 bytes; fields of wire types 0 (varint), 1 (64-bit), 2 (length-delimited) and 5
(32-bit), unknown fields skipped; repeated scalars accepted packed and unpacked; for a
repeated map key and a ``oneof`` set more than once the last one wins. Every read is bounds
checked: bad input raises :class:`~shardkit.errors.SourceError` and nothing else, and nothing is
read past the buffer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator, Union

import numpy as np

from shardkit.errors import SourceError

__all__ = ["Feature", "parse_example", "read_varint"]

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
Buffer = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True)
class Feature:
    """One feature of an Example.

    Attributes:
        kind: ``"bytes"``, ``"float"``, ``"int64"``, or ``""`` for a feature with no kind set.
        values: a list of bytes (``bytes``), a float32 array (``float``) or an int64 array (``int64``).
    """

    kind: str
    values: list[bytes] | np.ndarray


def read_varint(buf: Buffer, pos: int) -> tuple[int, int]:
    """A base-128 varint at ``buf[pos:]``.

    Args:
        buf: the message bytes.
        pos: where the varint starts.

    Returns:
        (its value as an unsigned 64-bit integer, the position after it).

    Raises:
        SourceError: it runs past the buffer or over 10 bytes.
    """
    result = shift = 0
    end = len(buf)
    for _ in range(10):
        if pos >= end:
            raise SourceError("protobuf: varint runs past the end of the message")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
    raise SourceError("protobuf: varint longer than 10 bytes")


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field of a message: an int for wire types
    0, 1 and 5, the bytes (a view) for wire type 2."""
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = read_varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise SourceError("protobuf: field number 0")
        if wire == _VARINT:
            value, pos = read_varint(buf, pos)
            yield number, wire, value
        elif wire == _LEN:
            size, pos = read_varint(buf, pos)
            if size > end - pos:
                raise SourceError(f"protobuf: a field of {size} bytes runs past the end of the message")
            yield number, wire, buf[pos:pos + size]
            pos += size
        elif wire in (_I64, _I32):
            width = 8 if wire == _I64 else 4
            if width > end - pos:
                raise SourceError("protobuf: a fixed-width field runs past the end of the message")
            yield number, wire, int.from_bytes(buf[pos:pos + width], "little")
            pos += width
        else:  # 3 and 4 are the deprecated groups, 6 and 7 do not exist: none is in an Example
            raise SourceError(f"protobuf: wire type {wire} (field {number}) is not valid in a tf.train.Example")


def _bytes_list(buf: memoryview) -> list[bytes]:
    return [bytes(v) for n, w, v in _fields(buf) if n == 1 and _is_len(w, "bytes_list")]  # type: ignore[arg-type]


def _is_len(wire: int, what: str) -> bool:
    if wire != _LEN:
        raise SourceError(f"protobuf: {what} value has wire type {wire}, expected length-delimited")
    return True


def _float_list(buf: memoryview) -> np.ndarray:
    parts: list[np.ndarray] = []
    for number, wire, value in _fields(buf):
        if number != 1:
            continue
        if wire == _LEN:  # packed: little-endian float32s
            assert isinstance(value, memoryview)
            if len(value) % 4:
                raise SourceError(f"protobuf: packed float_list of {len(value)} bytes, not a multiple of 4")
            parts.append(np.frombuffer(value, "<f4"))
        elif wire == _I32:
            assert isinstance(value, int)
            parts.append(np.array([struct.unpack("<f", value.to_bytes(4, "little"))[0]], "<f4"))
        else:
            raise SourceError(f"protobuf: float_list value has wire type {wire}")
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def _int64_list(buf: memoryview) -> np.ndarray:
    values: list[int] = []
    for number, wire, value in _fields(buf):
        if number != 1:
            continue
        if wire == _LEN:  # packed: varints back to back
            assert isinstance(value, memoryview)
            pos = 0
            while pos < len(value):
                v, pos = read_varint(value, pos)
                values.append(v)
        elif wire == _VARINT:
            assert isinstance(value, int)
            values.append(value)
        else:
            raise SourceError(f"protobuf: int64_list value has wire type {wire}")
    # Two's complement: an int64 of -1 is the varint of 2**64 - 1.
    return np.array(values, np.uint64).view(np.int64) if values else np.zeros(0, np.int64)


def _feature(buf: memoryview) -> Feature:
    found = Feature("", [])
    for number, wire, value in _fields(buf):
        if number not in (1, 2, 3):
            continue
        _is_len(wire, "Feature")
        assert isinstance(value, memoryview)
        if number == 1:
            found = Feature("bytes", _bytes_list(value))
        elif number == 2:
            found = Feature("float", _float_list(value))
        else:
            found = Feature("int64", _int64_list(value))
    return found


def _map_entry(buf: memoryview) -> tuple[str, Feature]:
    name, feature = b"", Feature("", [])
    for number, wire, value in _fields(buf):
        if number == 1 and _is_len(wire, "feature name"):
            name = bytes(value)  # type: ignore[arg-type]
        elif number == 2 and _is_len(wire, "Feature"):
            feature = _feature(value)  # type: ignore[arg-type]
    try:
        return name.decode("utf-8"), feature
    except UnicodeDecodeError:
        raise SourceError(f"protobuf: feature name {name[:40]!r} is not UTF-8") from None


def parse_example(data: Buffer) -> dict[str, Feature]:
    """Decode a serialized ``tf.train.Example``.

    Args:
        data: the message (a TFRecord's payload).

    Returns:
        Feature name -> :class:`Feature`, in the order the names first appear.

    Raises:
        SourceError: the bytes are no valid Example (one line saying what is wrong), or are a
            ``tf.train.SequenceExample``, whose ``feature_lists`` would otherwise be dropped silently.
    """
    buf = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    features: dict[str, Feature] = {}
    for number, wire, value in _fields(buf):
        if number == 2 and wire == _LEN:  # SequenceExample { Features context = 1; FeatureLists feature_lists = 2; }
            raise SourceError("a tf.train.SequenceExample (it has feature_lists), not a tf.train.Example: "
                              "SequenceExamples are not supported")
        if number != 1:
            continue
        _is_len(wire, "Example.features")
        assert isinstance(value, memoryview)
        for n, w, entry in _fields(value):
            if n == 1 and _is_len(w, "Features.feature"):
                name, feature = _map_entry(entry)  # type: ignore[arg-type]
                features[name] = feature
    return features
