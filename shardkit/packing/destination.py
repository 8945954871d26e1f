"""Keeping a pack's destination safe: refusing destinations a pack must not write to, clearing
what an earlier pack left before writing, and sweeping strays before the commit.

A pack writes only under ``shards/``, ``manifest/``, ``versions/`` (an append) and ``_pack/`` of
its destination, and only deletes there what shardkit wrote: objects that no shardkit pack left
(someone's own tars, an index of existing tars) are refused, not deleted, unless the user passes
``overwrite``.
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
from pathlib import Path
from typing import Any

from shardkit.util.procs import pid_alive
from shardkit.errors import ConfigError, DatasetExistsError, ShardkitError
from shardkit.format.manifest import DATASET_JSON, SHARDS_PARQUET
from shardkit.read.manifest import read_info
from shardkit.read.versions import VERSIONS
from shardkit.packing.claim import CLAIM, Claim
from shardkit.storage.store import Store

__all__ = ["abort_uploads", "prepare_destination", "refuse_committed", "refuse_file_dest", "refuse_nested",
           "say_replaced", "sweep_strays", "sweep_temp"]

log = logging.getLogger(__name__)


def _local_path(text: str) -> Path | None:
    """The resolved local path a source or destination string names, None if it is remote."""
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        return None
    path = Path(text).expanduser()
    if not path.exists() and glob.has_magic(text):  # a glob of tars: the folder it starts from
        path = Path(*itertools.takewhile(lambda part: not glob.has_magic(part), path.parts))
    return path.resolve()


def _object_path(text: str) -> tuple[str, tuple[str, ...]] | None:
    """(scheme, path parts) of an object-store source or destination URL, up to its first glob
    or brace pattern (the prefix it lists); None for a local path or a chained URL."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() == "file" or "::" in text:
        return None
    parts: list[str] = []
    for part in rest.split("/"):
        if glob.has_magic(part) or "{" in part:
            break
        if part:
            parts.append(part)
    return {"s3a": "s3", "gcs": "gs"}.get(scheme.lower(), scheme.lower()), tuple(parts)


def refuse_nested(source: Any, store: Store) -> None:
    """Refuse a destination inside the source folder (or bucket prefix), or a source inside the
    destination.

    A destination inside the source makes a rerun pack the earlier output as input (its files
    become samples, its folder a class); a source inside the destination is deleted by an
    ``overwrite``.

    Args:
        source: the pack's source (only a path or a path string is checked).
        store: the destination.

    Raises:
        ConfigError: one lies inside the other.
    """
    if not isinstance(source, (str, os.PathLike)):
        return
    remote_src, remote_dst = _object_path(os.fspath(source)), _object_path(store.url)
    if remote_src is not None and remote_dst is not None and remote_src[0] == remote_dst[0]:
        shown = os.fspath(source).rstrip("/")
        if remote_dst[1][:len(remote_src[1])] == remote_src[1]:
            raise ConfigError(f"destination {store.url} is inside the source {shown}: a rerun would pack this "
                              "pack's output as input; choose a destination outside the source")
        if remote_src[1][:len(remote_dst[1])] == remote_dst[1]:
            raise ConfigError(f"source {shown} is inside the destination {store.url}: packing there would write "
                              "over (and --overwrite delete) the input; choose a destination outside the source")
        return
    src, dst = _local_path(os.fspath(source)), _local_path(store.url)
    if src is None or dst is None:
        return
    if dst == src or src in dst.parents:
        raise ConfigError(f"destination {dst} is inside the source {src}: a rerun would pack this pack's output as "
                          "input; choose a destination outside the source")
    if dst in src.parents:
        raise ConfigError(f"source {src} is inside the destination {dst}: packing there would write over (and "
                          "--overwrite delete) the input; choose a destination outside the source")


def refuse_file_dest(store: Store) -> None:
    """Refuse a local destination that is, or lies under, an existing regular file (the first
    directory the pack made would fail with a bare NotADirectoryError).

    Args:
        store: the destination.

    Raises:
        ConfigError: naming the file in the way.
    """
    dst = _local_path(store.url)
    if dst is None:
        return
    for path in (dst, *dst.parents):
        if path.exists():
            if not path.is_dir():
                where = "is a file" if path == dst else f"lies under {path}, which is a file"
                raise ConfigError(f"destination {dst} {where}, not a directory: choose a directory (a new one, "
                                  "or one holding a dataset)")
            return


def refuse_committed(store: Store, overwrite: bool) -> None:
    """Refuse a committed dataset at the destination unless ``overwrite``; refuse an index of
    existing tars always: its tars are the user's own (``shardkit index`` wrote only the manifest
    beside them), and a pack there would delete those under shards/ and mix its own with the rest.

    Args:
        store: the destination.
        overwrite: the user asked to replace a dataset there.

    Raises:
        DatasetExistsError: a dataset is committed there (and not ``overwrite``), or an index is.
    """
    if not store.exists(DATASET_JSON):
        return
    try:
        made_by = (read_info(store).get("source") or {}).get("type")
    except ShardkitError:  # an unreadable dataset.json is no index to protect: --overwrite replaces it
        made_by = None
    if made_by == "index":
        raise DatasetExistsError(
            f"{store.url} is an index of existing WebDataset tars (shardkit index), not a packed dataset: a pack "
            "there would delete or mix with those tars, which shardkit did not write (--overwrite too); pack to "
            f"another prefix (to drop only the index, delete {store.url_of(DATASET_JSON)} and "
            f"{store.url_of('manifest')}/)")
    if not overwrite:
        raise DatasetExistsError(f"{store.url} already holds a dataset; pass --append (append=True) to add this "
                                 "one as a new version, or --overwrite (overwrite=True) to replace it")


def say_replaced(exc: BaseException, store: Store) -> None:
    """Add to the error of a pack that failed after its ``overwrite`` removed the old dataset that
    it did so: the user must not believe the old dataset is still there to fall back on.

    Args:
        exc: the pack's error (its first line gets the note; otherwise it is logged).
        store: the destination.
    """
    note = (f"; the old dataset at {store.url} was removed when this --overwrite pack started "
            "(fix the cause and rerun to pack there again)")
    if exc.args and isinstance(exc.args[0], str):
        first, nl, rest = exc.args[0].partition("\n")
        exc.args = (first + note + nl + rest, *exc.args[1:])
    if note not in str(exc):  # an interrupt, or an error that formats its message itself
        log.warning("%s", note[2:])


def prepare_destination(store: Store, claim: Claim, overwrite: bool, resumable: bool = True) -> bool:
    """Make the claimed destination ready to write, keeping what a resumed pack may reuse.

    Refuses a committed dataset, or objects under shards/ and manifest/ that no earlier shardkit
    pack wrote (unless ``overwrite``), and removes what shardkit wrote there before unless this
    pack resumes it (the same plan, ``resumable``). With ``overwrite`` that is everything,
    committed or not: shards an unfinished pack of more shards left would otherwise stay beside
    the new ones, where ``shardkit index`` and outside WebDataset readers find them.

    Args:
        store: the destination.
        claim: this pack's claim, held (dropped here when the pack is refused).
        overwrite: the user asked to replace what is there.
        resumable: an unfinished pack of the same plan may be resumed (False for an iterable,
            which cannot be planned).

    Returns:
        Whether a committed dataset was removed (``overwrite``).

    Raises:
        DatasetExistsError: the destination holds a dataset, an index or foreign objects.
        StorageError: removing the old objects failed (the error says the old dataset is gone
            if it was committed).
    """
    committed = store.exists(DATASET_JSON)
    if committed:
        try:
            refuse_committed(store, overwrite)
        except DatasetExistsError:
            claim.drop()
            raise
    if claim.fresh and not committed and not overwrite:
        _refuse_foreign(store, claim)
    if committed or (overwrite and not claim.resumed) or not resumable:
        try:
            # Uncommit first, so nobody reads a half-replaced dataset: the version markers (what
            # version-aware readers open), then dataset.json.
            store.remove(VERSIONS, recursive=True)
            store.remove(DATASET_JSON)
            for prefix in ("shards", "manifest"):
                store.remove(prefix, recursive=True)
            for rel in store.listing("_pack"):
                if rel != CLAIM and not rel.startswith("_pack/takeover-"):  # the takeover records guard the claim
                    store.remove(rel, recursive=True)
            abort_uploads(store)
        except BaseException as exc:
            if committed:  # dataset.json may be gone already
                say_replaced(exc, store)
            raise
    return committed


def _refuse_foreign(store: Store, claim: Claim) -> None:
    """Refuse (and drop the claim) when shards/ or manifest/ hold objects although neither a
    dataset nor an unfinished pack's claim is here: shardkit did not write them (someone's own
    WebDataset, notes), and the commit's sweep of strays would delete them."""
    found = store.listing("shards") + store.listing("manifest")
    if not found:
        return
    claim.drop()
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    raise DatasetExistsError(f"{store.url} holds objects under shards/ or manifest/ but no shardkit dataset or "
                             f"unfinished pack ({store.url_of(found[0])}{more}); choose an empty prefix, or pass "
                             "--overwrite (overwrite=True) to delete them and pack there")


def abort_uploads(store: Store) -> None:
    """Abort the multipart uploads under shards/ and manifest/ that packs killed mid-upload left
    (their parts stay in the bucket, billed, until aborted).

    Called with the claim held and no upload of this pack running: any such upload belongs to
    a pack that is gone. Only those two folders, where packs write: never the uploads of anyone
    else under the prefix. A store that cannot list or abort them is only warned about.

    Args:
        store: the destination.
    """
    try:
        for key in store.abort_uploads(("shards", "manifest")):
            log.info("aborted the unfinished multipart upload of %s left by an earlier pack", key)
    except ShardkitError as exc:  # a store without the call, or no permission for it: not worth failing the pack
        log.warning("%s: could not list or abort unfinished multipart uploads under shards/ and manifest/ (%s); "
                    "an interrupted pack may have left some (S3 bills their parts until they are aborted)",
                    store.url, exc)


def sweep_strays(store: Store, ours: set[str]) -> None:
    """Remove the objects under shards/ and manifest/ that are not this pack's.

    A committed dataset holds only its own shards (outside readers take every tar under
    shards/). The strays are what an earlier, unfinished shardkit pack wrote: a pack that found
    objects there without such a pack's claim refused to start, unless told to overwrite.

    Args:
        store: the destination.
        ours: the paths this pack wrote (its shards and fragments).
    """
    for rel in store.listing("shards") + store.listing("manifest"):
        if rel not in ours and rel != SHARDS_PARQUET:
            log.info("removing %s, which is not part of this pack", store.url_of(rel))
            store.remove(rel, recursive=True)


def sweep_temp(store: Store) -> None:
    """Remove the local shard temp files that packs which died left (``*.tar.tmp.<pid>.<id>``).

    Args:
        store: the destination (an object store has none: an unfinished multipart upload is
            invisible, see :func:`abort_uploads`).
    """
    if store.is_object_store:
        return
    for rel in store.glob("shards/*.tmp.*"):
        pid = rel.rsplit(".tmp.", 1)[1].split(".", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            store.remove(rel)
