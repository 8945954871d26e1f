"""Opening fsspec filesystems with shardkit's option rules, and opening them again in a forked child."""

from __future__ import annotations

import errno
import os
import uuid
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from shardkit.errors import StorageError
from shardkit.storage.options import s3_options

__all__ = ["create_local", "open_fs", "replace_local", "reopen_fs", "S3FS_RETRIES"]

# s3fs's own tries per call, under ours: its default 5 made every stalled call of a frozen store
# wait 5 read timeouts before shardkit's retry loop (and its warning) saw it.
S3FS_RETRIES = 2


def open_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a URL to (filesystem, path) with shardkit's option rules.

    Its one caller, :class:`~shardkit.storage.store.Store`, has refused credentials in the URL
    already.

    Args:
        url: any fsspec URL.
        storage_options: options for the filesystem (for ``s3://``, merged by
            :func:`~shardkit.storage.options.s3_options`).

    Returns:
        The filesystem and the path of ``url`` on it.

    Raises:
        StorageError: fsspec cannot open the URL (unknown protocol, missing package).
    """
    opts = s3_options(storage_options) if url.startswith(("s3://", "s3a://")) else dict(storage_options or {})
    try:
        fs, path = url_to_fs(url, **opts)
    except (ImportError, ValueError) as exc:
        raise StorageError(f"cannot open {url}: {exc}") from exc
    if hasattr(fs, "retries"):  # s3fs: its own retries of each call (a class attribute, 5)
        fs.retries = S3FS_RETRIES
    return fs, path


_PARENTS_FILESYSTEMS: list[fsspec.AbstractFileSystem] = []  # a forked child's inherited ones (Store.fs)


def reopen_fs(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """A fresh instance of ``fs`` (same class and arguments) for a forked process.

    fsspec clears its instance cache when the pid changes, so this never hands back the
    parent's instance; a filesystem passed in by the caller keeps its own configuration.

    Args:
        fs: the filesystem the parent process opened.

    Returns:
        A new instance, or ``fs`` itself when it does not record its arguments.
    """
    args = getattr(fs, "storage_args", None)
    kwargs = getattr(fs, "storage_options", None)
    if args is None or kwargs is None:
        return fs
    # The parent's instance is kept, never collected here: collecting it would close its
    # aiobotocore session on the parent's loop, which prints "Task exception was never
    # retrieved ... attached to a different loop" tracebacks in every worker.
    _PARENTS_FILESYSTEMS.append(fs)
    return type(fs)(*args, **kwargs)


def create_local(path: str, data: bytes) -> None:
    """Create the local (or NFS) file ``path`` holding ``data``, exclusively and atomically.

    fsspec's ``pipe_file(mode="create")`` checks that the file does not exist and then writes
    it: two writers may both pass the check (both "commit"), and a reader may see the file half
    written. Here the bytes go to a temp file of a unique name beside ``path`` (created with
    ``O_CREAT|O_EXCL``, written, fsynced) that is then hard-linked to ``path``: ``link`` fails
    if ``path`` exists (on NFS too) and makes it appear complete. Where the file system has no
    hard links, ``path`` itself is created with ``O_EXCL`` (exclusive, not atomic to readers).

    Args:
        path: the file to create (its folder exists).
        data: its bytes.

    Raises:
        FileExistsError: ``path`` exists already.
        OSError: the file system failed.
    """
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.create.{os.getpid()}.{uuid.uuid4().hex[:12]}")
    _write_new(tmp, data)
    try:
        os.link(tmp, path)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise  # EEXIST (FileExistsError) included
        _write_new(path, data)  # no hard links here: exclusive at least
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def replace_local(path: str, data: bytes) -> None:
    """Write the local (or NFS) file ``path`` holding ``data``, replacing it atomically.

    fsspec's ``pipe_file`` writes ``path`` in place: a process killed mid-write leaves a
    truncated file under the final name, which a rerun or a reader then has to tell from a
    whole one. Here the bytes go to a temp file of a unique name beside ``path`` that is then
    renamed over it, so ``path`` is either the old file or the whole new one.

    Args:
        path: the file to write (its folder exists).
        data: its bytes.

    Raises:
        OSError: the file system failed.
    """
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.put.{os.getpid()}.{uuid.uuid4().hex[:12]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _write_new(path: str, data: bytes) -> None:
    """Write a new file (``O_EXCL``: FileExistsError if it exists), fsynced; removed if the write fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
