"""What a node cache holds on disk at one moment, for tests that watch it while readers run."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["cache_files", "limited"]


def cache_files(cache_dir: str | os.PathLike[str]) -> list[tuple[str, os.stat_result]]:
    """Every file under ``cache_dir`` with its ``lstat``, read under the cache's global lock
    (shared), as the cache's own accounting does: reserving, evicting and renaming a download
    into place all hold it exclusively, so the walk sees one moment, never a file evicted
    mid-walk and the download that took its room. Without a lock file yet (no cache opened
    there), the walk takes no lock.

    Args:
        cache_dir: the cache directory.

    Returns:
        (path relative to ``cache_dir``, stat) of each file, files removed mid-walk left out.
    """
    lock = Path(cache_dir) / ".global.lock"
    fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC) if lock.exists() else -1
    try:
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_SH)
        files = []
        for root, _dirs, names in os.walk(cache_dir):
            for name in names:
                path = os.path.join(root, name)
                try:
                    files.append((os.path.relpath(path, cache_dir), os.lstat(path)))
                except OSError:
                    continue
        return files
    finally:
        if fd >= 0:
            os.close(fd)  # releases the lock


LOCK_SUFFIXES = (".pin", ".dl", ".global.lock")  # a lock file holds its owner's pid at most


def limited(files: list[tuple[str, os.stat_result]]) -> list[tuple[str, os.stat_result]]:
    """Of :func:`cache_files`' list, what ``cache_limit`` bounds: shards, downloads in flight and
    their progress files, not the lock files (docs/guide/cache.md, "Layout").

    Args:
        files: :func:`cache_files`' answer.

    Returns:
        Those entries.
    """
    return [(rel, st) for rel, st in files if not rel.endswith(LOCK_SUFFIXES)]
