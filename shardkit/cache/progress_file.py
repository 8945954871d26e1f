"""The progress file of a shard download in flight: how readers in other processes on the node
follow it (:mod:`.progress` keeps the same flags in memory for this process's readers).

``<ns>/.locks/<file>.landed``, beside the shard's download lock: a header (magic, the
downloader's pid, its attempt number, the temp file's device and inode, the shard's sample
count, bytes landed, the state, and an xxh3-64 of all that) at byte 0; at byte 120 a byte a
reader sets to ask for samples to be verified as they land (the downloader hashes them only for
readers that follow it); then one byte per sample from byte 128: 1 once the sample's bytes are
in the temp file and matched their xxh3-64. The
downloader empties the file when the attempt ends (and a new attempt empties it before it
writes its header), so a reader that reads the flags between two equal headers reads them for
that attempt's inode.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import xxhash

__all__ = ["ProgressFile", "RemoteState", "LANDING", "DONE", "FAILED", "PROGRESS_SUFFIX", "progress_file_size"]

LANDING, DONE, FAILED = 1, 2, 3  # states of a download in flight
_MAGIC = b"SKLAND01"
_HEAD = struct.Struct("<8s7Q")  # magic, pid, attempt, dev, ino, samples, bytes landed, state
_SUM = struct.Struct("<Q")
_FOLLOWED_AT = 120  # a reader in another process sets this byte: verify samples as they land
_FLAGS_AT = 128  # flags start here, one byte per sample (1: verified)
PROGRESS_SUFFIX = ".landed"  # <ns>/.locks/<file>.landed


def progress_file_size(samples: int) -> int:
    """The bytes the progress file of a download of a ``samples``-sample shard takes while it
    is in flight (the node cache reserves them with the shard's).

    Args:
        samples: the shard's sample count.

    Returns:
        Header and flags.
    """
    return _FLAGS_AT + samples


class ProgressFile:
    """The flags of one download in flight, as a file other processes on the node read.

    Args:
        path: the file (made if missing; never deleted: emptied when no download is in flight).
        writable: opened by the downloader (else by a reader, who writes only the follow byte).

    Raises:
        OSError: the file cannot be opened (a reader: there is none).
    """

    def __init__(self, path: str, writable: bool) -> None:
        self.path = path
        if writable:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            return
        try:  # a reader writes one byte too (see follow)
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except PermissionError:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def start(self, attempt: int, st: os.stat_result, samples: int) -> None:
        """A new attempt: no sample verified yet (writer).

        Args:
            attempt: the attempt's number in this process.
            st: the stat of the temp file the attempt fills.
            samples: the shard's samples.
        """
        os.ftruncate(self.fd, 0)  # a reader then sees no header until the new one is whole
        os.ftruncate(self.fd, progress_file_size(samples))
        self._head = (os.getpid(), attempt, st.st_dev, st.st_ino, samples)
        self.state(0, LANDING)

    def state(self, landed: int, state: int) -> None:
        """Write the header (writer).

        Args:
            landed: bytes landed so far.
            state: :data:`LANDING`, :data:`DONE` or :data:`FAILED`.
        """
        head = _HEAD.pack(_MAGIC, *self._head, landed, state)
        os.pwrite(self.fd, head + _SUM.pack(xxhash.xxh3_64_intdigest(head)), 0)

    def mark(self, runs: Iterator[tuple[int, int]]) -> None:
        """Flag positions ``[lo, hi)`` of each run verified (writer).

        Args:
            runs: position ranges.
        """
        for lo, hi in runs:
            os.pwrite(self.fd, b"\x01" * (hi - lo), _FLAGS_AT + lo)

    def follow(self) -> None:
        """Ask the downloader to verify samples as they land (reader; best effort)."""
        try:
            os.pwrite(self.fd, b"\x01", _FOLLOWED_AT)
        except OSError:
            pass  # a file this reader may not write: it waits for the whole shard instead

    def followed(self) -> bool:
        """Whether a reader elsewhere asked for samples to be verified as they land (writer).

        Returns:
            True once one did, in this attempt.
        """
        return os.pread(self.fd, 1, _FOLLOWED_AT) == b"\x01"

    def clear(self) -> None:
        """No download in flight any more (writer)."""
        os.ftruncate(self.fd, 0)

    def head(self) -> RemoteState | None:
        """The header now (reader).

        Returns:
            It, or None when there is none whole (no download in flight, or one starting).
        """
        for _ in range(3):  # a header read while it is rewritten fails its checksum: read again
            raw = os.pread(self.fd, _HEAD.size + _SUM.size, 0)
            if len(raw) < _HEAD.size + _SUM.size:
                return None
            head = raw[:_HEAD.size]
            if _SUM.unpack(raw[_HEAD.size:])[0] == xxhash.xxh3_64_intdigest(head) and head[:8] == _MAGIC:
                return RemoteState(*_HEAD.unpack(head)[1:])
        return None

    def verified(self, lo: int, hi: int) -> np.ndarray:
        """The flags of positions ``[lo, hi)`` (reader).

        Args:
            lo: the first position.
            hi: the position after the last.

        Returns:
            One uint8 per position (0 where the file is shorter).
        """
        raw = os.pread(self.fd, hi - lo, _FLAGS_AT + lo)
        out = np.zeros(hi - lo, np.uint8)
        out[:len(raw)] = np.frombuffer(raw, np.uint8)
        return out

    def close(self) -> None:
        """Close the file."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(frozen=True)
class RemoteState:
    """A :class:`ProgressFile` header: whose download, which attempt and temp inode, how far."""

    pid: int
    attempt: int
    dev: int
    ino: int
    samples: int
    landed: int
    state: int
