"""Create-only writes that recognise their own earlier success.

A create-only PUT (``If-None-Match: *``) whose response is lost (a reset after the server
applied it, a proxy timing out) is retried, and the retry is refused because the object now
exists: the writer's own object. Taken at face value, a pack then reported "another writer
committed first" over its own complete dataset, and a claim refused its own process. So when a
create is refused, the object is read back: if it holds exactly the bytes this writer meant to
create, the create succeeded. The bytes written this way are unique to their writer (a claim
carries the pack's random token and its start time, ``dataset.json`` its commit time and, under
the claim that only one writer holds, what that writer packed), so equal bytes are not another
writer's.
"""

from __future__ import annotations

import logging

from shardkit.errors import DatasetExistsError, ShardkitError, StorageError
from shardkit.storage.store import Store

__all__ = ["create_once"]

log = logging.getLogger(__name__)


def create_once(store: Store, rel: str, data: bytes) -> None:
    """Create ``rel`` holding ``data``, create-only; an object already there with exactly
    these bytes is this writer's own (an earlier try whose answer was lost) and counts as created.

    Args:
        store: the root.
        rel: the object, relative to the root.
        data: its bytes (unique to this writer: see the module docstring).

    Raises:
        DatasetExistsError: ``rel`` exists with other bytes (another writer created it).
        StorageError: the store failed, and ``rel`` does not hold these bytes.
    """
    try:
        store.put_create(rel, data)
    except DatasetExistsError:
        if not _holds(store, rel, data):
            raise DatasetExistsError(f"{store.url_of(rel)} already exists (another writer created it first)") from None
    except StorageError:
        # The retries ran out with the last answer lost too: the write may still have landed.
        if not _holds(store, rel, data):
            raise


def _holds(store: Store, rel: str, data: bytes) -> bool:
    """Whether ``rel`` exists holding exactly ``data`` (False when it cannot be read)."""
    try:
        found = store.read_bytes(rel)
    except ShardkitError:
        return False
    if found != data:
        return False
    log.info("%s: created by an earlier try of this write whose answer was lost", store.url_of(rel))
    return True
