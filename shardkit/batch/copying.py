"""Copying sample members into batch arrays, each byte once: from bytes in memory with a gather
or ``memcpy``, from a cached file with ``os.preadv`` straight into the batch's buffers.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from shardkit.errors import IntegrityError

__all__ = ["GATHER_BELOW", "copy_members", "read_members"]

#: Mean member bytes under which a field is gathered in one vectorised step, not copied member
#: by member (labels, metadata).
GATHER_BELOW = 512
# One preadv covers members whose gaps (tar headers, padding, members of samples not in the
# batch) are at most _GAP_MAX bytes; the gap bytes land in a scratch buffer. A gap shorter than
# what a system call's own cost would copy is not worth splitting a call for.
_GAP_MAX = 64 * 1024
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
_SCRATCH = memoryview(bytearray(_GAP_MAX))


def copy_members(out: np.ndarray, dst: np.ndarray, src: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> None:
    """``out[dst[k]:dst[k]+sizes[k]] = src[starts[k]:starts[k]+sizes[k]]`` for every k.

    Args:
        out: the batch field's uint8 array.
        dst: where each member goes in ``out``.
        src: the shard bytes (a uint8 array).
        starts: where each member starts in ``src``.
        sizes: each member's length.
    """
    total = int(sizes.sum())
    if total <= GATHER_BELOW * len(sizes):
        # Small members (labels, metadata): one vectorised gather instead of a Python loop.
        rel = np.arange(total) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        out[np.repeat(dst, sizes) + rel] = src[np.repeat(starts, sizes) + rel]
        return
    # Large members: memcpy each (memoryview slicing costs less per call than numpy's).
    mo, ms = memoryview(out.data), memoryview(src.data)  # type: ignore[arg-type]
    for d, a, ln in zip(dst.tolist(), starts.tolist(), sizes.tolist()):
        mo[d:d + ln] = ms[a:a + ln]


def read_members(fd: int, outs: Sequence[np.ndarray], dsts: np.ndarray, starts: np.ndarray, sizes: np.ndarray,
                 where: str) -> None:
    """``outs[j][dsts[k, j]:+sizes[k, j]] = file[starts[k, j]:+sizes[k, j]]`` for every member.

    Members are taken in file order; each ``os.preadv`` reads one stretch of the file whose
    members go straight to their place in ``outs`` and whose gaps go to a scratch buffer, so
    a batch of consecutive samples is a few calls and every byte is copied once, by the kernel.

    Args:
        fd: the open cached shard file.
        outs: one uint8 array per field.
        dsts: ``(members, fields)`` destinations in ``outs``.
        starts: ``(members, fields)`` file offsets.
        sizes: ``(members, fields)`` lengths (0: the member is skipped).
        where: the shard, for error messages.

    Raises:
        IntegrityError: the file ends before a member does (it changed under the reader).
    """
    order = np.argsort(starts, axis=None, kind="stable")
    nf = starts.shape[1]
    mvs = [memoryview(o.data) for o in outs]  # type: ignore[arg-type]
    iov: list[memoryview] = []
    call_at = pos = -1
    for a, n, j, d in zip(starts.reshape(-1)[order].tolist(), sizes.reshape(-1)[order].tolist(),
                          (order % nf).tolist(), dsts.reshape(-1)[order].tolist()):
        if n == 0:
            continue
        if pos >= 0 and (a < pos or a - pos > _GAP_MAX or len(iov) >= _IOV_MAX - 1):
            _preadv_all(fd, iov, call_at, pos - call_at, where)
            iov, pos = [], -1
        if pos < 0:
            call_at = pos = a
        elif a > pos:
            iov.append(_SCRATCH[:a - pos])
        iov.append(mvs[j][d:d + n])
        pos = a + n
    if iov:
        _preadv_all(fd, iov, call_at, pos - call_at, where)


def _preadv_all(fd: int, iov: list[memoryview], offset: int, want: int, where: str) -> None:
    # A regular file gives short reads only at its end (a cached file changed under us) or
    # past Linux's 2 GiB per call: carry on from where the kernel stopped.
    while True:
        got = os.preadv(fd, iov, offset)
        want -= got
        if want == 0:
            return
        if got == 0:
            raise IntegrityError(f"{where}: cached file ends early ({want} bytes missing at offset {offset})")
        offset += got
        while got >= len(iov[0]):
            got -= len(iov[0])
            iov = iov[1:]
        iov[0] = iov[0][got:]
