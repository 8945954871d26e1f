"""On-disk primitives of the node cache: flock locks that die with their holder, file names,
the "verified" stamp, and a sink that hashes a download while it is written."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, cast
from urllib.parse import quote

import xxhash

from shardkit.cache.progress import SampleTable
from shardkit.errors import IntegrityError
from shardkit.util.libc import libc_function

__all__ = ["ShardRef", "FileLock", "close_inherited_locks", "NO_SPACE", "preallocate", "allocate", "file_name",
           "write_replace",
           "unlink_quiet", "list_with_stat", "FileId", "HashingSink", "hash_fd", "verified_stamp_ns",
           "stamp_verified", "mark_used"]


@dataclass(frozen=True)
class ShardRef:
    """One shard as the manifest describes it.

    Attributes:
        name: shard path relative to the dataset root, e.g. ``shards/shard-000003.tar``.
        size: bytes.
        checksum: xxh3-128 hex digest of the whole file.
        samples: its samples' spans and xxh3-64s, if the reader knows them: a parallel download
            then verifies each sample as it lands, and readers may read it before the shard is
            whole (``ShardCache.open(stream=True)``). Not part of the shard's identity.
    """

    name: str
    size: int
    checksum: str
    samples: SampleTable | None = field(default=None, compare=False, repr=False)


class FileLock:
    """One flock on its own open file description, so threads exclude each other too.

    Args:
        fd: the locked file (made by :meth:`take` or :meth:`try_take`).
    """

    held: ClassVar[set[int]] = set()  # fds locked by this process; closed in forked children

    def __init__(self, fd: int) -> None:
        self.fd, self.pid = fd, os.getpid()

    @classmethod
    def take(cls, path: str, op: int = fcntl.LOCK_EX) -> FileLock:
        """Lock ``path`` (created if missing), waiting as long as it takes.

        Args:
            path: the lock file.
            op: ``LOCK_EX`` or ``LOCK_SH``.

        Returns:
            The lock.
        """
        return cast(FileLock, cls.try_take(path, op))

    @classmethod
    def try_take(cls, path: str, op: int) -> FileLock | None:
        """Lock ``path`` (created if missing).

        Args:
            path: the lock file.
            op: ``LOCK_EX`` or ``LOCK_SH``, with ``LOCK_NB`` to give up instead of waiting.

        Returns:
            The lock, or None when ``op`` has LOCK_NB and the lock is taken.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, op)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, BlockingIOError) and op & fcntl.LOCK_NB:
                return None
            raise
        cls.held.add(fd)
        return cls(fd)

    def release(self) -> None:
        """Unlock and close (only in the process that took it)."""
        # A forked child shares the parent's lock; only the process that took it unlocks.
        if self.fd >= 0 and self.pid == os.getpid():
            FileLock.held.discard(self.fd)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
        self.fd = -1


def close_inherited_locks() -> None:
    """Close, in a forked child, the lock files its parent held (run at every fork)."""
    # Else a DataLoader worker forked while the parent holds a lock would keep that lock
    # alive after the parent dies: "locks die with their holder" would no longer hold.
    for fd in list(FileLock.held):
        os.close(fd)
    FileLock.held.clear()


os.register_at_fork(after_in_child=close_inherited_locks)

# None where the C library has no fallocate: the reservation then stays logical only.
_fallocate = libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])
_FALLOC_FL_KEEP_SIZE = 1

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
"""The errnos of a disk (or a quota) with no room left."""


def preallocate(fd: int, size: int) -> bool:
    """Reserve disk blocks but keep st_size (FALLOC_FL_KEEP_SIZE).

    st_size then keeps meaning "bytes downloaded so far", the point a resume starts from.

    Args:
        fd: the file, open for writing.
        size: bytes to reserve from offset 0.

    Returns:
        True when the blocks are reserved; False where the file system (or C library) cannot
        reserve them so (EOPNOTSUPP...): a write may then still find the disk full.

    Raises:
        OSError: ENOSPC or EDQUOT: the disk (or quota) has no room for ``size`` bytes; the
            caller says so (its result was ignored once, and a map fill then died of SIGBUS).
    """
    if size <= 0:
        return True
    if _fallocate is None:
        return False
    while _fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err in NO_SPACE or err == errno.EFBIG:
            raise OSError(err, os.strerror(err))
        return False
    return True


def allocate(fd: int, size: int) -> None:
    """Make the file ``size`` bytes long with disk blocks behind every byte (``posix_fallocate``;
    the C library writes a byte per block where the file system cannot allocate).

    Call before writing the file through a map: a page of a map whose block cannot be
    allocated is SIGBUS, not an error.

    Args:
        fd: the file, open for writing (not O_APPEND).
        size: its bytes.

    Raises:
        OSError: the blocks could not be allocated (ENOSPC or EDQUOT when the disk or quota is full).
    """
    if size <= 0:
        os.ftruncate(fd, 0)
        return
    os.posix_fallocate(fd, 0, size)  # Python retries EINTR
    if os.fstat(fd).st_size != size:  # longer before (a failed fill): cut it
        os.ftruncate(fd, size)


def file_name(name: str) -> str:
    """An injective, flat, non-hidden file name for a shard name.

    Args:
        name: the shard's path relative to the dataset root.

    Returns:
        Its percent-quoted name (a digest ends a name that would be too long).
    """
    q = quote(name, safe="")
    q = "%2E" + q[1:] if q.startswith(".") else q
    if len(q) > 200:  # stay under NAME_MAX with suffixes; "%%" never occurs in quoted text
        q = q[:150] + "%%" + xxhash.xxh3_64_hexdigest(name.encode())
    return q


def write_replace(path: str, data: bytes) -> None:
    """Write a file through a temp name of this process and a rename, so a reader sees the old
    file or the whole new one, never a part.

    Args:
        path: the file.
        data: its new bytes.

    Raises:
        OSError: the write or the rename failed (the caller decides what that means).
    """
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def unlink_quiet(path: str) -> None:
    """Delete a file; one already gone is fine.

    Args:
        path: the file.
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # gone already is the state we want


def list_with_stat(path: str) -> list[tuple[os.DirEntry[str], os.stat_result]]:
    """A directory's entries with their lstat.

    Args:
        path: the directory (a missing one has no entries).

    Returns:
        (entry, lstat) pairs; entries removed meanwhile are left out.
    """
    out = []
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    out.append((e, e.stat(follow_symlinks=False)))
                except FileNotFoundError:
                    continue
    except FileNotFoundError:
        pass  # a namespace without a .tmp dir holds nothing in flight
    return out


class FileId(NamedTuple):
    """One version of one file: a replaced file (new inode) or a write (new mtime) differs."""

    dev: int
    ino: int
    mtime_ns: int  # a verified cache file's mtime is the cache's stamp: any write moves it
    size: int

    @staticmethod
    def of(st: os.stat_result) -> FileId:
        """The version of a file that ``st`` describes.

        Args:
            st: the file's stat.

        Returns:
            Its version.
        """
        return FileId(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class HashingSink:
    """Writes a download front to back into its temp file and hashes it as it goes.

    Args:
        fd: the temp file, open for writing.
        ref: the shard (its size bounds the file).
        start: bytes already in the file (a resumed download): they are hashed first.
    """

    def __init__(self, fd: int, ref: ShardRef, start: int) -> None:
        self._fd, self._ref, self.pos = fd, ref, start
        self._hash = xxhash.xxh3_128()
        if start:  # resuming: hash the bytes already there
            with mmap.mmap(fd, start, access=mmap.ACCESS_READ) as m:
                self._hash.update(m)
        os.lseek(fd, start, os.SEEK_SET)

    def write(self, data: memoryview) -> None:
        """Append bytes to the file and the hash.

        Args:
            data: the next bytes of the download.

        Raises:
            IntegrityError: the file would grow past the shard's size.
        """
        if self.pos + data.nbytes > self._ref.size:  # never write past the reservation
            raise IntegrityError(f"shard {self._ref.name}: fetch wrote more than its {self._ref.size} bytes")
        self._hash.update(data)
        left = data
        while left.nbytes:
            left = left[os.write(self._fd, left):]
        self.pos += data.nbytes

    def digest(self) -> str:
        """The xxh3-128 of the file's bytes so far.

        Returns:
            The hex digest.
        """
        return self._hash.hexdigest()


def hash_fd(fd: int, size: int) -> str:
    """The xxh3-128 of a file's first bytes, read through a map.

    Args:
        fd: the file, open for reading.
        size: bytes to hash.

    Returns:
        The hex digest.
    """
    if size == 0:
        return xxhash.xxh3_128_hexdigest(b"")
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:
        return xxhash.xxh3_128_hexdigest(m)


_STAMP_BASE_S = 1_000_000_000  # 2001-09-09: no real write to a cached file gets an mtime there


def verified_stamp_ns(checksum: str) -> int:
    """The mtime the cache gives a shard file once its bytes matched ``checksum``.

    Any later write to the file sets its mtime to the current time, so "mtime equals the
    stamp" means "unchanged since verified", for every process on the node: a warm epoch
    does not hash every shard again. Whole seconds, so coarse-timestamp file systems keep it.

    Args:
        checksum: the shard's xxh3-128 hex digest.

    Returns:
        The stamp, in nanoseconds since the epoch.
    """
    try:
        spread = int(checksum[:8], 16)
    except ValueError:
        spread = 0
    return (_STAMP_BASE_S + spread % 31_536_000) * 1_000_000_000


def stamp_verified(fd: int, checksum: str) -> None:
    """Mark a file as verified (mtime = stamp) and used now (atime: the LRU clock).

    Args:
        fd: the file.
        checksum: the xxh3-128 its bytes matched.
    """
    mark_used(fd, verified_stamp_ns(checksum))


def mark_used(fd: int, mtime_ns: int) -> None:
    """Set a file's atime (the LRU clock) to now, best effort.

    Args:
        fd: the file.
        mtime_ns: the mtime to set (its own, to leave it as it is).
    """
    try:
        os.utime(fd, ns=(time.time_ns(), mtime_ns))
    except OSError:  # not the file's owner: no stamp (verified again next time), no LRU touch
        pass
