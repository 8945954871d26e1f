"""Dataset versions: which versions a dataset has, and opening one of them.

A dataset that was appended to (``pack(..., append=True)``) holds one marker per version under
``versions/``: ``versions/vNNNNNN.json``, written create-only (the version's commit), holding
that version's ``dataset.json`` content plus ``dataset_version`` (its number) and
``shards_file`` (its shard table, ``versions/vNNNNNN-<xxh3 of the bytes>.parquet``, never
rewritten). Version N's shard table lists the shards of every version up to N, numbered on
from the shards before them, so version N is a prefix of every later version.

The root ``dataset.json`` and ``manifest/shards.parquet`` are copies of the latest version's,
rewritten after its marker exists: what readers that know nothing of versions (older shardkit,
outside tools) open. This module never reads them for a dataset that has markers: the latest
version is the highest marker listed, so a reader never sees a half-moved root. A dataset
packed once and never appended to has no ``versions/``: it is version 1, read from the root.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from shardkit.errors import ConfigError, DatasetNotFoundError, ManifestError
from shardkit.read.manifest import read_info, read_shards
from shardkit.storage.store import Store

__all__ = ["VERSIONS", "VersionInfo", "check_version_arg", "list_versions", "marker_name", "open_version",
           "shards_file_name", "version_infos"]

VERSIONS = "versions"
_MARKER = re.compile(r"^versions/v(\d{6})\.json$")
_SHARDS_FILE = re.compile(r"^versions/v\d{6}-[0-9a-f]{16}\.parquet$")


@dataclass(frozen=True)
class VersionInfo:
    """One committed version, as ``shardkit info`` lists it.

    Attributes:
        version: its number, from 1.
        num_samples: samples in it (every version up to it).
        num_shards: shards in it.
        total_bytes: their bytes.
        created: its commit time (UTC, ISO 8601).
    """

    version: int
    num_samples: int
    num_shards: int
    total_bytes: int
    created: str


def marker_name(version: int) -> str:
    """The marker (commit) of ``version``.

    Args:
        version: the version number.

    Returns:
        ``versions/vNNNNNN.json``.
    """
    return f"{VERSIONS}/v{version:06d}.json"


def shards_file_name(version: int, digest: str) -> str:
    """The shard table of ``version`` whose bytes hash to ``digest``: named by its content, so
    two writers of one version never overwrite each other's table.

    Args:
        version: the version number.
        digest: 16 hex digits (xxh3-64 of the table's bytes).

    Returns:
        ``versions/vNNNNNN-<digest>.parquet``.
    """
    return f"{VERSIONS}/v{version:06d}-{digest}.parquet"


def check_version_arg(version: Any) -> int | None:
    """Check a ``version=`` argument.

    Args:
        version: None (the latest) or a version number.

    Returns:
        The version, or None.

    Raises:
        ConfigError: it is not a whole number >= 1.
    """
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigError(f"version: expected a version number >= 1 (or None for the latest), got {version!r}")
    return version


def list_versions(store: Store) -> list[int]:
    """The version numbers whose markers exist, ascending (empty for a dataset never appended to).

    Args:
        store: the dataset root.

    Returns:
        The numbers.

    Raises:
        StorageError: listing failed.
    """
    found = (_MARKER.match(rel) for rel in store.listing(VERSIONS))
    return sorted(int(m.group(1)) for m in found if m)


def _available(store: Store, versions: list[int]) -> str:
    return f"{store.url} has versions 1..{versions[-1]}" if versions else f"{store.url} has only version 1"


def open_version(store: Store, version: int | None = None) -> tuple[dict[str, Any], pa.Table]:
    """The ``dataset.json`` content and shard table of one version.

    Args:
        store: the dataset root.
        version: the version, or None for the latest.

    Returns:
        (info, shards table); ``info["dataset_version"]`` is the version's number (absent for
        a dataset never appended to: version 1).

    Raises:
        ConfigError: a bad ``version``.
        DatasetNotFoundError: no dataset, or no such version.
        ManifestError: a marker or shard table is unreadable, or names a file outside ``versions/``.
    """
    version = check_version_arg(version)
    versions = list_versions(store)
    if not versions:
        if version not in (None, 1):
            raise DatasetNotFoundError(f"no version {version}: {_available(store, versions)} (never appended to)")
        info = read_info(store)
        if info.get("dataset_version") in (None, 1):
            return info, read_shards(store)
        versions = list_versions(store)  # the first append committed between the listing and the read
        if not versions:
            raise ManifestError(f"{store.url_of('dataset.json')} names version {info.get('dataset_version')} but "
                                f"{store.url_of(VERSIONS)}/ holds no marker of it")
    number = versions[-1] if version is None else version
    if number not in versions:
        raise DatasetNotFoundError(f"no version {number}: {_available(store, versions)}")
    rel = marker_name(number)
    info = read_info(store, rel)
    shards_file = info.get("shards_file")
    if info.get("dataset_version") != number or not isinstance(shards_file, str) or not _SHARDS_FILE.match(shards_file):
        raise ManifestError(f"{store.url_of(rel)}: dataset_version/shards_file do not name this version's shard "
                            "table under versions/; restore the file the pack wrote")
    return info, read_shards(store, shards_file)


def version_infos(store: Store) -> list[VersionInfo]:
    """Every committed version, ascending (one, from the root, for a dataset never appended to).

    Args:
        store: the dataset root.

    Returns:
        The versions.

    Raises:
        DatasetNotFoundError: there is no dataset.
        ManifestError: a marker is unreadable.
    """
    versions = list_versions(store)
    infos = [read_info(store, marker_name(v)) for v in versions] if versions else [read_info(store)]
    return [VersionInfo(v, int(i["num_samples"]), int(i["num_shards"]), int(i.get("total_bytes") or 0),
                        str(i.get("created"))) for v, i in zip(versions or [1], infos)]
