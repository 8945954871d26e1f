"""A Ray Data datasink writing a shardkit dataset: ``ds.write_datasink(shardkit.ray.Datasink(url))``.

Built on Ray Data's public ``Datasink`` contract: :meth:`Datasink.on_write_start` claims and
clears the destination on the driver; each write task packs its blocks as one part
(:func:`~shardkit.packing.part_task.run_part`, named by the task's index, so a retried task
rewrites the same shards rather than adding samples); :meth:`Datasink.on_write_complete`
commits once, on the driver, from the tasks' results
(:func:`~shardkit.packing.part_commit.commit_parts`, which also sweeps what a failed attempt
left). A job that fails commits nothing (:meth:`Datasink.on_write_failed` releases the claim).
This module imports Ray: reach it through :mod:`shardkit.ray`, which imports it on first use.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from ray.data import Datasink as _RayDatasink

from shardkit.config import DEFAULT_SHARD_BYTES, parse_size
from shardkit.errors import ConfigError
from shardkit.packing.claim import Claim
from shardkit.packing.destination import prepare_destination, refuse_committed, refuse_file_dest, sweep_temp
from shardkit.packing.part_commit import commit_parts
from shardkit.packing.part_task import run_part
from shardkit.packing.sources.parts import part_samples
from shardkit.packing.sources.ray_data import block_rows
from shardkit.packing.task import PackOptions, TaskResult
from shardkit.packing.transforms import describe_transform
from shardkit.storage.options import with_env_location
from shardkit.storage.store import Store

__all__ = ["DATASINK_PLAN", "Datasink"]

_SOURCE = {"type": "ray_datasink"}
#: The plan id of every datasink write's claim.
DATASINK_PLAN = "ray-datasink"


class Datasink(_RayDatasink):
    """Writes a Ray dataset as a shardkit dataset at ``url``: shards per write task, one commit.

    Rows are sample dicts as :func:`shardkit.pack` takes them (``__key__`` optional: the
    default key is ``<write task>-<row>``). After ``write_datasink`` returns, :attr:`result`
    holds the dataset.json content. A rerun after a failed job starts over (it is not
    resumed: Ray Data may split the rows into other tasks).

    Args:
        url: the destination (any fsspec URL).
        shard_bytes: target shard size (``"512MB"``).
        shard_samples: also close a shard once it holds this many samples.
        on_error: ``"raise"`` fails the job at the first bad sample (naming it and its write
            task); ``"skip"`` leaves it out and lists it in dataset.json.
        overwrite: replace a dataset already committed at ``url``.
        storage_options: fsspec options for ``url``.
        transform: applied to each sample, as :func:`shardkit.pack`'s ``transform``.

    Raises:
        ConfigError: a bad option, or ``url`` is a file.
    """

    def __init__(self, url: str, shard_bytes: int | str = DEFAULT_SHARD_BYTES, *, shard_samples: int | None = None,
                 on_error: str = "raise", overwrite: bool = False, storage_options: dict[str, Any] | None = None,
                 transform: Any = None) -> None:
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error: expected 'raise' or 'skip', got {on_error!r}")
        if shard_samples is not None and shard_samples < 1:
            raise ConfigError(f"shard_samples: must be >= 1, got {shard_samples}")
        store = Store(url, storage_options)
        refuse_file_dest(store)
        # Write tasks write where this driver commits, whatever endpoint their nodes' environments name.
        self.store = Store(store.url, with_env_location(store.url, store.storage_options))
        sbytes = parse_size(shard_bytes, "shard_bytes")
        desc = describe_transform(transform)
        self.opts = PackOptions(sbytes, shard_samples, sbytes, on_error, transform, desc)
        self.overwrite = overwrite
        self.settings = {"source": _SOURCE, "on_error": on_error, "transform": desc, "shard_bytes": sbytes,
                         "shard_samples": shard_samples}
        # One plan for every datasink: a write is never resumed (its destination is cleared at
        # the start), so a rerun with other options may take over a failed write's claim.
        self.plan_id = DATASINK_PLAN
        self.result: dict[str, Any] | None = None
        self._claim: Claim | None = None
        self._started = 0.0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_claim"] = None  # the driver's (a heartbeat thread): write tasks never touch it
        return state

    def on_write_start(self, schema: Any = None) -> None:
        """Claim the destination and clear what an earlier, unfinished write left (on the driver).

        Args:
            schema: the data's Arrow schema (unused: every row is checked as it is written).

        Raises:
            DatasetExistsError: a dataset is there (and not ``overwrite``), or another pack is.
            StorageError: storage failed.
        """
        self._started = time.monotonic()
        refuse_committed(self.store, self.overwrite)
        claim = Claim(self.store, self.plan_id, self.settings)
        claim.take(self.overwrite)
        try:
            prepare_destination(self.store, claim, self.overwrite, resumable=False)
            sweep_temp(self.store)
        except BaseException:
            claim.release(ended=True)
            raise
        self._claim = claim

    def write(self, blocks: Iterable[Any], ctx: Any) -> TaskResult:
        """Pack one write task's blocks as part ``ctx.task_idx`` (in the write task).

        Args:
            blocks: the task's blocks.
            ctx: Ray Data's task context (its ``task_idx`` names the part).

        Returns:
            The part's result, handed to :meth:`on_write_complete`.

        Raises:
            SourceError: a bad row, naming the write task and the row.
            StorageError: a write failed.
        """
        part = int(ctx.task_idx)
        skipped: list[dict[str, str]] = []
        samples = part_samples(part, lambda: block_rows(blocks), skipped if self.opts.on_error == "skip" else None)
        return run_part(self.store, part, samples, skipped, self.plan_id, self.opts)

    def on_write_complete(self, write_result: Any) -> None:
        """Commit the dataset from every write task's result (on the driver, once).

        Args:
            write_result: Ray Data's ``WriteResult``; its ``write_returns`` are the parts.

        Raises:
            SourceError: no row was written, or two rows share a key.
            DatasetExistsError: another pack took the destination over.
            StorageError: storage failed.
        """
        if self._claim is None:
            raise RuntimeError("shardkit Datasink: on_write_complete without on_write_start")
        by_part: dict[int, TaskResult] = {}
        for res in write_result.write_returns:
            by_part[res.task] = res  # a task's index appears once, even if Ray retried the task
        self.result = commit_parts(self.store, self._claim, [by_part[p] for p in sorted(by_part)], source=_SOURCE,
                                   started=self._started, engine="ray_data", opts=self.opts)
        self._claim = None

    def on_write_failed(self, error: Exception) -> None:
        """Release the claim (marked as ended, so a rerun need not wait); nothing is committed.

        Args:
            error: the job's first error.
        """
        if self._claim is not None:
            self._claim.release(ended=True)
            self._claim = None
