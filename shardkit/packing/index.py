"""``shardkit index``: a manifest for existing WebDataset tars, built in place.

The tars are not rewritten: each becomes one shard whose ``path`` is the tar's path relative
to the dataset root. Each tar is read exactly once, front to back, in bounded chunks: the
bytes pass through :func:`shardkit.format.tarscan.scan_tar` (which refuses hostile members) and,
on the way, into the whole-file xxh3-128 and the per-sample xxh3-64 of
``[offset of the sample's first header, end of its last member)`` (and of its 1 MiB blocks,
:mod:`shardkit.format.checksums`). Memory is one read chunk
plus the small headers between members, whatever the member sizes.

Samples are what the webdataset library reads from the same tars: its keys (``./0001`` for
``./0001.jpg``), its lowercased fields, and the members it skips (``README``, ``__meta__``,
``._0001.jpg``) left out, counted and listed per tar in dataset.json's ``skipped``. A skipped
member between two members of one sample lies inside that sample's byte range, in no field.

Nothing is committed unless every tar scans cleanly and no sample key repeats:
``dataset.json`` is written last, create-only, exactly as :func:`shardkit.pack` does, and
while holding the claim a pack holds (:mod:`shardkit.packing.claim`): of two index runs of one
folder exactly one writes and commits, the other fails at once, having written and deleted
nothing. Keys
are checked with a :class:`~shardkit.packing.key_ledger.KeyLedger` (12 bytes a key) once every tar is
read, so the driver's memory stays small at tens of millions of samples.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from shardkit.errors import DatasetExistsError, SourceError
from shardkit.format.fragments import build_fragment
from shardkit.format.manifest import DATASET_JSON, SHARDS_PARQUET, dataset_info, fragment_name, parquet_file, shards_table
from shardkit.format.rows import SampleRows, ShardRecord
from shardkit.packing.claim import INDEX_PLAN, Claim
from shardkit.packing.index_scan import index_tar
from shardkit.packing.key_ledger import KeyLedger
from shardkit.packing.manifest_writer import put_dataset_json, put_fragment, put_shards_table
from shardkit.packing.progress import Progress
from shardkit.storage.store import Store

__all__ = ["FRAGMENT_ROWS", "index_tars"]

log = logging.getLogger(__name__)

# Sample rows held before a fragment is written (bounds driver memory on huge datasets).
FRAGMENT_ROWS = 250_000


def _list_tars(store: Store) -> list[str]:
    """Every ``*.tar`` under the root, in subfolders too (as ``shardkit pack`` of a folder of
    tars reads them); not what an unfinished pack left in ``_pack/``.

    Args:
        store: the dataset root.

    Returns:
        Their paths relative to the root, sorted.
    """
    found = set(store.glob("*.tar")) | set(store.glob("**/*.tar"))
    return sorted(t for t in found if not t.startswith("_pack/"))


def index_tars(dest: str, *, overwrite: bool = False, progress: bool = True,
               storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build a shardkit manifest for the WebDataset tars at ``dest`` without rewriting them.

    Args:
        dest: a dataset root (any fsspec URL) holding ``*.tar`` directly or under ``shards/``.
        overwrite: replace an existing dataset.json and everything under ``manifest/`` (the
            tars are kept). Without it, files under ``manifest/`` and no dataset.json are
            refused rather than deleted.
        progress: show a progress bar on stderr.
        storage_options: fsspec options (credentials, endpoint).

    Returns:
        The committed dataset.json content.

    Raises:
        DatasetExistsError: ``dest`` already holds a dataset or files under ``manifest/`` (and
            not ``overwrite``), or another index or a pack is writing there (or left an
            unfinished pack).
        UnsafeTarError: a tar holds a hostile member (names it); nothing is committed.
        SourceError: no tars, or a sample key repeats (names both tars).
    """
    started = time.monotonic()
    store = Store(dest, storage_options)
    if store.exists(DATASET_JSON) and not overwrite:  # checked again once claimed
        raise DatasetExistsError(f"{store.url} already holds a dataset; pass --overwrite (overwrite=True) to re-index it")
    # The claim a pack takes: of two index runs of one folder (or an index and a pack) exactly
    # one goes on; the other fails here, before it has written or deleted anything.
    claim = Claim(store, INDEX_PLAN, {"type": "index"}, kind="index")
    claim.take(overwrite=False)  # a pack's claim is never taken over by an index, a dead index's is
    try:
        _prepare(store, claim, overwrite)
    except BaseException:
        claim.drop()
        raise
    try:
        info = _index_claimed(store, progress)
    except BaseException:
        claim.release(ended=True)  # a rerun takes the claim over at once
        raise
    claim.release(ended=False)  # stop the heartbeat first: a late refresh would recreate the claim
    store.remove("_pack", recursive=True)
    log.info("indexed %d samples in %d tars (%d bytes) in %.1fs", info["num_samples"], info["num_shards"],
             info["total_bytes"], time.monotonic() - started)
    return info


def _prepare(store: Store, claim: Claim, overwrite: bool) -> None:
    """With the claim held: refuse a committed dataset (unless ``overwrite``: uncommit it) or
    files under manifest/ that no index wrote, and clear what a dead index left there."""
    if store.exists(DATASET_JSON):
        if not overwrite:
            raise DatasetExistsError(f"{store.url} already holds a dataset; pass --overwrite (overwrite=True) to "
                                     "re-index it")
        store.remove(DATASET_JSON)  # uncommit first, so nobody reads a half-replaced manifest
    elif claim.fresh and not overwrite:
        _refuse_foreign_manifest(store)
    if not _list_tars(store):
        raise SourceError(f"no .tar files at {store.url} (looked at **/*.tar)")
    if overwrite or not claim.fresh:
        # --overwrite replaces manifest/ as a whole; a claim taken over is a dead index's, and
        # manifest/ holds what it wrote.
        store.remove("manifest", recursive=True)


def _index_claimed(store: Store, progress: bool) -> dict[str, Any]:
    """Scan every tar, write the manifest and commit it (the claim held); on failure remove
    what this run wrote."""
    tars = _list_tars(store)
    total = sum(store.size(t) for t in tars)
    records: list[ShardRecord] = []
    files: list[str] = []
    groups: list[int] = []
    fields: set[str] = set()
    keys = KeyLedger()
    rows = SampleRows()
    pending: list[ShardRecord] = []
    skipped: list[tuple[str, int, str]] = []  # tars with members webdataset skips
    try:
        with Progress(None, total, len(tars), "index", enabled=progress) as bar:
            for rel in tars:
                rec = index_tar(store, rel, len(records) + len(pending), rows, keys, fields, bar.advance,
                                skipped)
                bar.task_done()
                if rec.num_samples == 0:
                    log.warning("%s holds no samples; left out of the manifest", store.url_of(rel))
                    continue
                pending.append(rec)
                if len(rows) >= FRAGMENT_ROWS:
                    _flush(store, len(set(files)), rows, pending, records, files, groups)
                    rows = SampleRows()
            if pending:
                _flush(store, len(set(files)), rows, pending, records, files, groups)
        if not records:
            raise SourceError(f"the tars at {store.url} hold no samples")
        _refuse_repeated_keys(store, keys, records, files, groups)
        table = shards_table(records, files, groups)
        put_shards_table(store, table)
        passed = sum(n for _, n, _ in skipped)
        if skipped:
            log.warning("skipped %d members in %d tars that the webdataset library skips too (no dot in the name, "
                        "__*__ metadata, hidden ._ files), first %r in %s; listed in dataset.json", passed,
                        len(skipped), skipped[0][2], store.url_of(skipped[0][0]))
        # One entry a tar, not a member: a collection can hold a ._ file beside every sample.
        listed = [{"ref": rel, "key": "", "reason": f"{n} members the webdataset library skips too, first {first!r}"}
                  for rel, n, first in skipped]
        info = dataset_info(table, sorted(fields), {"type": "index", "path": store.url, "tars": len(tars)}, None,
                            listed, {"index": {"tars": len(records), "skipped_members": passed}})
        put_dataset_json(store, info)
    except BaseException:
        # Only what this run wrote (manifest/ was empty or cleared when it started): its
        # fragments, the one it may have been writing, and shards.parquet.
        ours = [fragment_name(i) for i in range(len(set(files)) + 1)] + [SHARDS_PARQUET]
        try:
            for rel in ours:
                store.remove(rel)
            if not store.is_object_store and not store.glob("manifest/*"):
                store.remove("manifest", recursive=True)  # the empty folder this run made
        except Exception:  # noqa: BLE001 - best-effort cleanup while the real error propagates
            log.debug("cleanup of %s/manifest failed", store.url, exc_info=True)
        raise
    return info


def _refuse_foreign_manifest(store: Store) -> None:
    """DatasetExistsError when manifest/ holds anything while no dataset is committed: index
    writes its manifest there and must not delete or mix with files it did not write (a
    user's notes, or what an index killed midway left: --overwrite replaces those)."""
    found = store.listing("manifest")
    if found:
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        raise DatasetExistsError(f"{store.url} holds no dataset but its manifest/ is not empty "
                                 f"({store.url_of(found[0])}{more}); move those files away, or pass --overwrite "
                                 "(overwrite=True) to replace manifest/ (the tars are kept)")


def _flush(store: Store, number: int, rows: SampleRows, pending: list[ShardRecord], records: list[ShardRecord],
           files: list[str], groups: list[int]) -> None:
    name = fragment_name(number)
    row_groups = put_fragment(store, name, build_fragment(name, rows, pending))
    records.extend(pending)
    files.extend(name for _ in pending)
    groups.extend(row_groups)
    pending.clear()


def _refuse_repeated_keys(store: Store, keys: KeyLedger, records: list[ShardRecord], files: list[str],
                          groups: list[int]) -> None:
    """Raise SourceError naming a key that two samples share (and their tars), reading back
    only the keys of shards the ledger suspects (equal 64-bit hashes)."""
    fragments: dict[str, Any] = {}

    def keys_of(shard: int) -> list[str]:
        name = files[shard]
        if name not in fragments:
            fragments[name] = parquet_file(store.read_checked(name), store.url_of(name))
        return fragments[name].read_row_group(groups[shard], columns=["key"], use_threads=False).column(0).to_pylist()

    for a, b in keys.suspects():
        url, rel_a, rel_b = store.url_of(records[a].path), records[a].path, records[b].path
        if a == b:
            repeated = sorted(k for k, n in Counter(keys_of(a)).items() if n > 1)
            if repeated:
                raise SourceError(f"{url}: sample key {repeated[0]!r} appears twice "
                                  "(members of a sample must be adjacent)")
        else:
            both = sorted(set(keys_of(a)) & set(keys_of(b)))
            if both:
                raise SourceError(f"duplicate sample key {both[0]!r}: in {rel_a} and {rel_b}")
