"""Exception hierarchy.

Every error shardkit raises derives from :class:`ShardkitError` and also from the built-in
exception users already catch (``FileNotFoundError``, ``ValueError``, ...). Backend errors are
translated and kept as ``__cause__``. Messages are one line and name the object at fault.
"""

from __future__ import annotations

import errno

__all__ = [
    "ShardkitError", "ConfigError", "SourceError", "SourceNotFoundError", "DatasetNotFoundError",
    "DatasetExistsError", "ManifestError", "IntegrityError", "DecodeError", "UnsafeTarError",
    "StorageError", "StorageStalledError", "StoragePermissionError", "CacheFullError", "NoRoomError",
    "CacheLockedError", "CacheGoneError", "CacheDiskFullError", "SampleNotFoundError", "DevServerError",
    "first_line",
]


class ShardkitError(Exception):
    """Base class of every shardkit error."""


class ConfigError(ShardkitError, ValueError):
    """A bad option or argument (names the option)."""


class SourceError(ShardkitError, ValueError):
    """The pack source is missing, empty or holds unreadable/bad input (names the file)."""


class SourceNotFoundError(SourceError, FileNotFoundError):
    """The pack source does not exist."""


class DatasetNotFoundError(ShardkitError, FileNotFoundError):
    """No committed dataset (no dataset.json) at a URL."""


class DatasetExistsError(ShardkitError, FileExistsError):
    """The destination already holds a dataset, or another pack committed first."""


class ManifestError(ShardkitError, ValueError):
    """The manifest is malformed or disagrees with itself."""


class IntegrityError(ShardkitError, ValueError):
    """Bytes on storage or in the cache disagree with the manifest (names shard/sample)."""


class DecodeError(ShardkitError, ValueError):
    """A sample's field does not decode (names the sample, its shard and the field); the
    decoder's own error is its ``__cause__``."""


class UnsafeTarError(ShardkitError, ValueError):
    """A tar from outside holds a member we refuse (traversal, link, device, bad size)."""


class StorageError(ShardkitError, OSError):
    """Storage could not be reached or refused the request (no secrets in the message)."""


class StorageStalledError(StorageError, TimeoutError):
    """The store took requests and did not answer them, through every retry."""


class StoragePermissionError(StorageError, PermissionError):
    """Storage refused the credentials."""


class CacheFullError(ShardkitError, TimeoutError):
    """Readers pin so much of the node cache that the next shard cannot fit within its limit."""


class NoRoomError(CacheFullError):
    """An open waited ``room_wait`` seconds while shards pinned by readers left no room for
    its shard: the caller reads the shard around the cache."""


class CacheLockedError(NoRoomError):
    """An open waited ``SHARDKIT_LOCK_WAIT`` seconds for a lock of the node cache that another
    process holds without making progress (stopped, or stuck): the message names the lock and
    its holder's pid. A :class:`NoRoomError`, so every caller that reads a shard around a cache
    without room reads this one around the cache too."""


class CacheGoneError(ShardkitError, FileNotFoundError):
    """The cache's directory was removed while readers used it."""


class CacheDiskFullError(ShardkitError, OSError):
    """The disk under the node cache has no room (ENOSPC, or a quota) for a download that
    ``cache_limit`` allows; the message names the cache directory and the room needed.
    ``errno`` is the system's (``ENOSPC`` or ``EDQUOT``).

    Args:
        message: the one-line message.
        err: the errno.
    """

    def __init__(self, message: str, err: int = errno.ENOSPC) -> None:
        super().__init__(err, message)

    def __str__(self) -> str:
        return str(self.args[1])

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        return type(self), (str(self.args[1]), int(self.args[0]))


class SampleNotFoundError(ShardkitError, KeyError):
    """``ShardDataset.by_key`` found no sample with that key."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DevServerError(ShardkitError, RuntimeError):
    """The local S3 server (``python -m shardkit.dev.devserver``) could not be found or started."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, for one-line errors that quote it.

    A first line that only announces the next (ends with ``:``, as botocore's ``Parameter
    validation failed:`` before ``Invalid bucket name ...``) is joined with it: alone it says
    nothing of what is wrong.

    Args:
        exc: the exception.

    Returns:
        The first line of ``str(exc)`` (and the next when the first ends with ``:``), or ``""``
        if it has none.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]
