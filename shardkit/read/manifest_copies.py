"""Node-local copies of a dataset's samples fragments, so that fresh DataLoader workers and later
epochs read the sample manifest from local disk instead of storage.

Copies live in a private directory of this user under the temp dir (not in the shard cache, so
``cache_limit`` keeps bounding the cache exactly), one subdirectory per pack (its cache
namespace, shared by the versions appended to it: an append never rewrites an earlier version's
fragment, so a copy serves every version that lists it; a copy is checked to describe the
reader's shards before use, and a stored ``where=`` result is named by its version). A reader
opening a copy marks its directory in use; any reader sweeps directories no reader opened for
:data:`COPIES_KEPT_SECONDS`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

from shardkit.cache.files import file_name, write_replace

__all__ = ["COPIES_KEPT_SECONDS", "copy_path", "keep_copy", "manifest_copies_dir", "open_copy"]

log = logging.getLogger(__name__)

# Node-local manifest copies of a dataset no reader opened for this long are removed.
COPIES_KEPT_SECONDS = 3 * 24 * 3600.0


def manifest_copies_dir(namespace: str) -> str | None:
    """This user's node-local directory for copies of one dataset's sample manifests, and
    mark it in use (sweeping directories of other datasets unused for too long).

    A copy decides where every sample starts, so the directory must belong to this user and
    be writable by nobody else.

    Args:
        namespace: the pack's cache namespace (:func:`shardkit.read.cache_refs.cache_namespace`).

    Returns:
        The directory (not necessarily made yet), or None if its root is not safely ours.
    """
    root = os.path.join(tempfile.gettempdir(), f"shardkit-manifests-{os.getuid()}")
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.stat(root, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        log.warning("not keeping manifest copies in %s: not a private directory of this user", root)
        return None
    mine = os.path.join(root, namespace)
    with contextlib.suppress(OSError):
        os.utime(mine)  # in use: the sweep below (by any reader) keeps it
    _sweep_old_copies(root)
    return mine


def _sweep_old_copies(root: str) -> None:
    """Remove copies of datasets no reader opened for :data:`COPIES_KEPT_SECONDS` (every
    re-pack gets a new namespace; nothing else would ever delete the old ones). A reader that
    still had such a copy open keeps its map; one that looks for it reads storage again."""
    cutoff = time.time() - COPIES_KEPT_SECONDS
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                shutil.rmtree(entry.path, ignore_errors=True)


def copy_path(copies: str, name: str) -> str:
    """Where the copy of fragment ``name`` lives in ``copies``: a flat file name, never hidden
    or ``..``.

    Args:
        copies: the dataset's copies directory (see :func:`manifest_copies_dir`).
        name: the fragment's path in the dataset.

    Returns:
        The copy's path (whether or not the copy exists).
    """
    return os.path.join(copies, file_name(name))


def open_copy(path: str, name: str) -> tuple[pq.ParquetFile, int] | None:
    """The copy at ``path`` of fragment ``name``, opened as a memory map (its pages the page
    cache's, shared by every process on the node), and marked in use.

    Args:
        path: the copy (see :func:`copy_path`).
        name: the fragment's path in the dataset (for the warning).

    Returns:
        (the open fragment, its size), or None when there is no copy or it is damaged (then
        removed, to be fetched and kept again). Read it with ``use_threads=False``, as
        :func:`shardkit.format.manifest.parquet_file` explains.
    """
    try:
        src = pa.memory_map(path)
        with contextlib.suppress(OSError):
            os.utime(os.path.dirname(path))  # in use: a sweep of copies unopened for days keeps them
        return pq.ParquetFile(src), src.size()
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a damaged copy is dropped and fetched again
        log.warning("manifest copy %s is unreadable (%s); reading %s from storage", path, exc, name)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None


def keep_copy(copies: str, name: str, data: bytes) -> None:
    """Keep ``data``, fragment ``name`` as read from storage, in ``copies``. Best effort (a
    failure is logged at debug level); renamed into place, so readers never see half a copy.

    Args:
        copies: the dataset's copies directory (made if missing).
        name: the fragment's path in the dataset.
        data: the fragment's bytes.
    """
    path = copy_path(copies, name)
    try:
        os.makedirs(copies, exist_ok=True)
        write_replace(path, data)
    except OSError as exc:
        log.debug("could not keep a copy of %s in %s: %s", name, copies, exc)
