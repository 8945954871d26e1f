"""Reading exact byte counts from file objects, whole or in bounded pieces."""

from __future__ import annotations

from typing import IO, Iterator

from shardkit.errors import SourceError

__all__ = ["CHUNK_BYTES", "iter_exact", "read_exact"]

CHUNK_BYTES = 8 * 1024 * 1024  # the largest piece a streamed member yields at once


def read_exact(fp: IO[bytes], n: int) -> bytes:
    """Read ``n`` bytes, retrying short reads.

    Args:
        fp: a binary file.
        n: bytes wanted.

    Returns:
        ``n`` bytes, fewer only at end of file.
    """
    parts = []
    while n > 0:
        b = fp.read(n)
        if not b:
            break
        parts.append(b)
        n -= len(b)
    return b"".join(parts)


def iter_exact(fp: IO[bytes], size: int, what: str, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Exactly ``size`` bytes of ``fp``, in pieces.

    Args:
        fp: a binary file, positioned where the bytes start.
        size: bytes to read.
        what: the data, for the error.
        chunk: the largest piece.

    Yields:
        Pieces of at most ``chunk`` bytes, ``size`` bytes in all.

    Raises:
        SourceError: naming ``what``, when the data ends early (it changed while packing).
    """
    left = size
    while left > 0:
        b = fp.read(min(chunk, left))
        if not b:
            raise SourceError(f"{what}: shrank while reading ({left} of {size} bytes missing)")
        left -= len(b)
        yield b
