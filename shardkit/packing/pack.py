"""``shardkit.pack``: check the arguments, list the source, plan by bytes, run the tasks, commit.

The work is done by the modules this one calls in turn: the source is listed
(:mod:`shardkit.packing.sources`) and planned (:mod:`shardkit.packing.plan`; as the listing
arrives, :mod:`shardkit.packing.plan_stream`, for a source that streams its listing into a
destination holding no dataset yet), the destination is
claimed (:mod:`shardkit.packing.claim`) and made safe to write (:mod:`shardkit.packing.destination`),
an engine runs the tasks (:mod:`shardkit.packing.engines`, each task
:func:`shardkit.packing.task.run_task`), and the driver alone commits
(:mod:`shardkit.packing.commit`): ``shards.parquet``, then ``dataset.json`` create-only, so a
dataset is visible only when complete. An iterable of samples takes its own path
(:mod:`shardkit.packing.iterable`), and so does a source of parts or a Ray dataset
(:mod:`shardkit.packing.pack_parts`).
"""

from __future__ import annotations

import time
from typing import Any

from shardkit.config import DEFAULT_SHARD_BYTES, DEFAULT_TASK_BYTES, parse_size
from shardkit.errors import ConfigError, SourceError
from shardkit.format.manifest import DATASET_JSON
from shardkit.packing.append import append_pack, committed_as
from shardkit.packing.claim import Claim
from shardkit.packing.commit import commit_pack
from shardkit.packing.destination import (prepare_destination, refuse_committed, refuse_file_dest, refuse_nested,
                                          say_replaced, sweep_temp)
from shardkit.packing.engines import engine_for
from shardkit.packing.iterable import pack_iterable
from shardkit.packing.pack_parts import pack_parts
from shardkit.packing.plan import PackPlan, Planner, make_plan
from shardkit.packing.plan_stream import TaskStream
from shardkit.packing.sources import resolve_source
from shardkit.packing.sources.base import ListingSkips
from shardkit.packing.sources.hf import HfSource, hf_iterable_samples, hf_kind
from shardkit.packing.sources.parts import as_parts
from shardkit.packing.sources.ray_data import ray_dataset_parts
from shardkit.packing.task import PackOptions
from shardkit.packing.transforms import describe_transform
from shardkit.storage.store import Store

__all__ = ["pack"]


def pack(source: Any, dest: str, shard_bytes: int | str = DEFAULT_SHARD_BYTES, engine: str = "local", *,
         shard_samples: int | None = None, labels_from_dirs: bool = False, on_error: str = "raise",
         overwrite: bool = False, storage_options: dict[str, Any] | None = None, ray_address: str | None = None,
         transform: Any = None, task_bytes: int | str = DEFAULT_TASK_BYTES, hdf5_rows: str | None = None,
         progress: bool = True, zarr_rows: str | None = None, lmdb_field: str | None = None,
         append: bool = False, payload_columns: str | dict[str, str] | None = None,
         token_dtype: str | None = None, token_column: str | None = None) -> dict[str, Any]:
    """Pack ``source`` into a dataset at ``dest`` and return its dataset.json content.

    A rerun of a pack that failed or was killed resumes it: tasks whose shards and fragment
    are complete are kept (same source, same options). A rerun of a pack that committed (same
    source listing, same options) writes nothing and returns ``up_to_date=True``. At most one
    pack writes to a destination at a time.

    Args:
        source: a path (folder, ImageFolder, CSV/Parquet list, .h5, .npy/.npz, .tar, a Zarr
            store, an LMDB environment, TFRecords, a Parquet/Arrow table holding the payload), a
            WebDataset tar URL/glob, a Zarr store URL, a :class:`~shardkit.packing.sources.Source`,
            an iterable of dicts (packed as it comes, ``engine="local"`` only), a Hugging Face
            ``datasets.Dataset`` / ``IterableDataset`` (the latter packed as an iterable), a
            :class:`~shardkit.packing.sources.parts.Parts` or a list of iterables or of callables
            returning them (one task per part, resumed per part), or a ``ray.data.Dataset`` (a
            part per block).
        dest: any fsspec URL (``s3://bucket/prefix``, a local path, ``memory://...``).
        shard_bytes: target shard size (``"512MB"``); shards close before overflowing it.
        engine: ``"local"`` (in this process) or ``"ray"`` (one Ray task per planned task).
        shard_samples: also close a shard once it holds this many samples.
        labels_from_dirs: read a folder as an ImageFolder: ``root/<class>/<image>``, the class
            index as field ``cls``, the class names in dataset.json's ``labels``.
        on_error: ``"raise"`` stops at the first bad input naming it; ``"skip"`` leaves it out
            and lists it under ``skipped`` in dataset.json.
        overwrite: replace a dataset already committed at ``dest``. The old dataset is removed
            when the pack starts (once options, source, plan and claim are checked), not when
            the new one commits: a pack that then fails leaves no dataset there (its error says
            so). To keep the old one readable until the new one is done, pack to a new prefix.
        storage_options: fsspec options for ``dest`` and a remote ``source`` (credentials,
            endpoint).
        ray_address: the Ray cluster for ``engine="ray"`` (default: ``RAY_ADDRESS``, else a
            local Ray).
        transform: a :class:`~shardkit.packing.transforms.ImageTransform` or callable applied to
            each sample. Its identity (part of the plan, so a rerun resumes only the same
            transform) is its qualified name and a digest of its code and the values it closes
            over, or the name :func:`~shardkit.packing.transforms.named_transform` gives it.
        task_bytes: the most bytes one task packs (``"2GB"``); the plan aims at enough tasks
            for a cluster to share, never fewer bytes than a shard.
        hdf5_rows: for an HDF5 source, the comma-separated datasets whose rows are the samples
            (default: each dataset is a sample).
        progress: show a progress bar on stderr.
        zarr_rows: for a Zarr source, the comma-separated arrays whose rows are the samples
            (default: each array is a sample).
        lmdb_field: for an LMDB source, the field each value is packed as, a decoder hint
            (``"jpg"``; default ``"bin"``).
        append: pack the source as the next version of the dataset at ``dest``
            (:mod:`shardkit.packing.append`): new shards beside the old ones, keys already in
            the dataset refused (or skipped with ``on_error="skip"``), committed atomically; on
            an empty ``dest`` it is a plain pack (version 1).
        payload_columns: for a Parquet/Arrow table or a Hugging Face dataset, column -> field of
            its binary columns (``"img:jpg,depth:npy"``).
        token_dtype: pack tokenized documents (``.npy``/``.bin`` token arrays, Parquet token
            lists; see :mod:`shardkit.packing.sources.tokens`) stored as ``"uint16"`` or
            ``"uint32"``; needed for raw ``.bin`` files.
        token_column: pack tokenized documents, Parquet rows' token lists in this column.

    Returns:
        The dataset.json content, plus ``elapsed_seconds``, ``reused_tasks`` (tasks an
        earlier run completed), ``tasks``, and with ``engine="ray"`` ``nodes`` (Ray node id ->
        tasks it packed in this run); with ``up_to_date=True`` (and ``tasks`` 0) when a pack of
        the same source and options had committed there already: nothing was written.

    Raises:
        ConfigError: a bad option, an engine that is not installed, or a destination nested
            with the source.
        SourceNotFoundError: the source does not exist.
        SourceError: a bad input (``on_error="raise"``), or an empty source.
        DatasetExistsError: ``dest`` holds a dataset made from another source or options (and
            neither ``overwrite`` nor ``append``), an index of existing tars, objects shardkit
            did not write, or another pack is writing there (or committed the version an
            append was making).
        StorageError: reading or writing storage failed.
    """
    runner = engine_for(engine, ray_address)
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error: expected 'raise' or 'skip', got {on_error!r}")
    sbytes = parse_size(shard_bytes, "shard_bytes")
    if shard_samples is not None and shard_samples < 1:
        raise ConfigError(f"shard_samples: must be >= 1, got {shard_samples}")
    store = Store(dest, storage_options)
    refuse_nested(source, store)
    refuse_file_dest(store)
    desc = describe_transform(transform)  # the same in every process: a rerun resumes
    opts = PackOptions(sbytes, shard_samples, parse_size(task_bytes, "task_bytes"), on_error, transform, desc)
    if append and overwrite:
        raise ConfigError("append and overwrite exclude each other: append adds a version, overwrite replaces the "
                          "dataset")
    given = [name for name, value in (("hdf5_rows", hdf5_rows), ("zarr_rows", zarr_rows),
                                      ("lmdb_field", lmdb_field), ("labels_from_dirs", labels_from_dirs or None),
                                      ("token_dtype", token_dtype), ("token_column", token_column))
             if value is not None]
    parts = as_parts(source) or ray_dataset_parts(source)
    if parts is not None:
        if append:
            raise ConfigError("append: parts of samples cannot be appended yet (they cannot be listed ahead to check "
                              "their keys); write them to files and append those")
        if given or payload_columns is not None:
            raise ConfigError(f"{given[0] if given else 'payload_columns'}: applies to a source path, not to parts of "
                              "samples (give each sample its fields)")
        return pack_parts(parts, store, opts, overwrite, progress, engine, ray_address)
    hf = hf_kind(source)  # a Hugging Face dataset: by its type's name, datasets is not imported for others
    if hf == "Dataset":
        source = HfSource(source, payload_columns)
    elif hf == "IterableDataset":
        source = hf_iterable_samples(source, payload_columns)
    if _is_iterable(source):
        if append:
            raise ConfigError("append: an iterable source cannot be appended (it cannot be listed ahead to check its "
                              "keys); write it to files and append those")
        if engine != "local":
            raise ConfigError("engine: an iterable source is packed with engine='local' (it cannot be listed ahead)")
        if given:
            raise ConfigError(f"{given[0]}: applies to a source path, not to an iterable of samples (give each sample "
                              "its fields)")
        if payload_columns is not None and hf is None:
            raise ConfigError("payload_columns: applies to a table or a Hugging Face dataset, not to an iterable of "
                              "samples (give each sample its fields)")
        return pack_iterable(source, store, opts, overwrite, progress)
    src = resolve_source(source, labels_from_dirs=labels_from_dirs, storage_options=storage_options,
                         hdf5_rows=hdf5_rows, zarr_rows=zarr_rows, lmdb_field=lmdb_field,
                         payload_columns=None if hf else payload_columns, token_dtype=token_dtype,
                         token_column=token_column)
    listing: ListingSkips | None = getattr(src, "listing", None)  # sources that can skip while listing
    if listing is not None:
        listing.skip = on_error == "skip"
    started = time.monotonic()
    settings: dict[str, Any] = {"on_error": on_error, "transform": desc, "source": src.describe()}
    claim_settings = {**settings, "shard_bytes": sbytes, "shard_samples": shard_samples, "task_bytes": opts.task_bytes}
    planner = Planner(shard_bytes=sbytes, shard_samples=shard_samples, task_bytes=opts.task_bytes, options=settings)
    streamed = getattr(src, "iter_items", None)
    feed: PackPlan | TaskStream
    if callable(streamed) and not append and not store.exists(DATASET_JSON):
        # Plan as the listing arrives: the first tasks run while the rest is listed. The claim
        # is the settings' (the whole listing's fingerprint comes at its end); each task's own
        # fingerprint tells a rerun which tasks are done.
        feed = TaskStream(streamed(), planner)
        claim_id = planner.settings_id
        try:
            feed.prime()  # a missing or empty source fails here, before anything is claimed
        except BaseException:
            feed.close()
            raise
        if feed.done and not feed.num_items:
            feed.close()
            raise SourceError(f"source {source} is empty")
    else:
        # The whole listing first: an append checks its keys, a committed dataset here is up to
        # date or refused, before anything is written.
        items = src.list_items()
        if not items:
            raise SourceError(f"source {source} is empty")
        plan = make_plan(items, shard_bytes=sbytes, shard_samples=shard_samples, task_bytes=opts.task_bytes,
                         options=settings)
        if not overwrite:
            done = committed_as(store, plan.plan_id)
            if done is not None:  # the same source and options committed here already: nothing to write
                return {**done, "up_to_date": True, "elapsed_seconds": round(time.monotonic() - started, 3),
                        "reused_tasks": 0, "tasks": 0}
        if append and store.exists(DATASET_JSON):
            return append_pack(store, src, items, settings=settings, opts=opts, fingerprint=plan.plan_id,
                               engine=engine, runner=runner, progress=progress,
                               listing_skipped=listing.skipped if listing is not None else [], started=started)
        feed = plan
        # A source that streams claims by its settings either way, so a rerun resumes it whichever
        # way it is listed.
        claim_id = planner.settings_id if callable(streamed) else plan.plan_id
    try:
        refuse_committed(store, overwrite)  # before claiming: nothing written (checked again once claimed)
        claim = Claim(store, claim_id, claim_settings)
        claim.take(overwrite)
    except BaseException:
        _close(feed)
        raise
    replaced = False
    try:
        runner.start()  # reach Ray (or fail naming it) before an --overwrite removes the old dataset
        # Everything checkable is checked by now (options, source listed or its first task
        # planned, claim taken): only from here on may an --overwrite remove the old dataset.
        replaced = prepare_destination(store, claim, overwrite)
        sweep_temp(store)
        results = runner.run(store, src, feed, opts, progress, claim.check)
        return commit_pack(store, claim, results, source=src.describe(), labels=src.labels(), started=started,
                           engine=engine, opts=opts, listing_skipped=listing.skipped if listing is not None else [],
                           fingerprint=feed.plan_id)
    except BaseException as exc:
        claim.release(ended=True)
        if replaced:
            say_replaced(exc, store)
        raise
    finally:
        _close(feed)


def _close(feed: PackPlan | TaskStream) -> None:
    """Stop a streamed listing (a plan made from a whole listing has nothing to stop)."""
    if isinstance(feed, TaskStream):
        feed.close()


def _is_iterable(source: Any) -> bool:
    """Whether ``source`` is an iterable of samples rather than a path, URL or Source."""
    return (not isinstance(source, (str, bytes)) and not hasattr(source, "list_items") and hasattr(source, "__iter__")
            and not hasattr(source, "__fspath__"))
