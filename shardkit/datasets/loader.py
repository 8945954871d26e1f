"""StreamingDataLoader: a torch DataLoader that makes StreamingDataset resume exactly.

It tells the dataset how samples are grouped into batches, so DataLoader workers take turns
in whole batches and the loader yields exactly the rank's order; it counts the samples the
training loop has received in the main process, which is the position a checkpoint needs.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Iterator

import numpy as np
from torch.utils.data import DataLoader, default_convert

from shardkit.batch.buffers import BufferPool
from shardkit.batch.ring import BatchRing, RingBatch
from shardkit.config import int_arg
from shardkit.datasets.streaming import StreamingDataset
from shardkit.datasets.tensors import pinned_buffer, to_torch
from shardkit.errors import ConfigError

__all__ = ["MAX_RING_SLOT", "StreamingDataLoader"]

MAX_RING_SLOT = 256 << 20  # bigger batches (huge samples) are not worth parking in shared memory


class StreamingDataLoader(DataLoader):  # type: ignore[type-arg]
    """A :class:`torch.utils.data.DataLoader` over a :class:`StreamingDataset` with resume.

    For raw bytes, ``num_workers=0`` is often the fastest: the dataset then fills batches
    with its own read threads (``StreamingDataset(read_threads=2)``), or hands out views of
    the cache files with no copy at all (``StreamingDataset(zero_copy=True)``, which needs
    ``num_workers=0``). Workers pay off for decoding and other per-sample Python work.

    ``state_dict()`` is ``dataset.state_dict(consumed=<samples yielded by this loader this
    epoch>)``; call it between steps and save it with the model. ``load_state_dict`` forwards.

    Args:
        dataset: the stream.
        batch_size: samples per batch. When the dataset already batches in its workers
            (``StreamingDataset(batch_size=...)``), leave this ``None``: the DataLoader then
            passes the worker's batches through (``DataLoader(batch_size=None)``).
        handoff: ``"auto"`` (default) uses the shared ring when the dataset builds raw
            batches in forked workers: each worker writes its batches into shared memory made
            before it forked, and this process reads them there without a copy (only small
            descriptors go through the worker pipe). ``"ring"`` insists on it; ``"copy"``
            sends batches through the DataLoader's usual pickling.
        **kwargs: any other DataLoader argument (``num_workers``, ``pin_memory``,
            ``persistent_workers``, ``collate_fn``, ...).

    Raises:
        ConfigError: ``dataset`` is not a StreamingDataset, a bad ``handoff`` or
            ``batch_size``, ``zero_copy`` with workers, or ``handoff="ring"`` where the ring
            cannot be used (the message says why).
    """

    def __init__(self, dataset: StreamingDataset, batch_size: int | None = None, *, handoff: str = "auto",
                 **kwargs: Any) -> None:
        if handoff not in ("auto", "ring", "copy"):
            raise ConfigError(f"handoff: expected 'auto', 'ring' or 'copy', got {handoff!r}")
        if not isinstance(dataset, StreamingDataset):
            raise ConfigError("StreamingDataLoader needs a shardkit.StreamingDataset")
        batch_size = None if batch_size is None else int_arg("batch_size", batch_size, 1)
        if getattr(dataset, "zero_copy", False) and kwargs.get("num_workers", 0):
            raise ConfigError("zero_copy=True: use num_workers=0 (views into this process's maps "
                              "cannot come from a worker)")
        if dataset.batch_size is not None:
            if batch_size not in (None, dataset.batch_size):
                raise ConfigError(f"batch_size={batch_size} but the dataset already batches by "
                                  f"{dataset.batch_size}; pass batch_size=None")
            batch_size = None
            dataset.chunk = dataset.batch_size
        else:
            dataset.chunk = batch_size or 1
        dataset.chunk_from_loader = False  # told here, not learned from torch's fetcher
        kwargs.setdefault("shuffle", None)  # order comes from the dataset
        if dataset.batch_size is not None:
            # The dataset's batches are already tensors: DataLoader's default_convert would only
            # walk every key of every batch again.
            kwargs.setdefault("collate_fn", _as_is)
        elif batch_size is None:
            # Single samples: decoded arrays may be read-only views of the mapped cache file,
            # and a tensor over them crashes the process (SIGSEGV) when written in place (in a
            # worker, torch warns of exactly that before the tensor is pickled).
            kwargs.setdefault("collate_fn", _convert_writable)
        super().__init__(dataset, batch_size=batch_size, **kwargs)
        dataset.loader_workers = self.num_workers
        dataset.tensors_in_main = True  # a worker's batch in shared slots comes as numpy: see __iter__
        self._ring_bytes = self._ring_slot_bytes(dataset)
        why_not = self._ring_blocker(dataset)
        if handoff == "ring" and why_not:
            raise ConfigError(f"handoff='ring': {why_not}")
        self._use_ring = handoff != "copy" and not why_not
        self._ring: BatchRing | None = None
        self._ring_clean = False  # the last epoch ran to its end: its workers are gone
        self._pool = BufferPool(allocate=pinned_buffer) if bool(self.pin_memory) and _cuda_available() else None
        self._consumed = 0
        self._per_batch = batch_size or dataset.batch_size or 1
        # Unbatched (no batch_size anywhere): every item is one sample, whatever it holds
        # (its "__key__" is a string, whose len() is not a sample count).
        self._batched = batch_size is not None or dataset.batch_size is not None

    @staticmethod
    def _ring_slot_bytes(dataset: StreamingDataset) -> int:
        # Room for a batch half again as large as an average one (pages are only backed by
        # memory once written); a larger batch goes the ordinary way.
        ds = dataset.ds
        mean = ds.info.get("total_bytes", 0) / max(1, ds.num_samples)
        return int(mean * (dataset.batch_size or 1) * 1.5) + (1 << 20)

    def _ring_blocker(self, dataset: StreamingDataset) -> str:
        """Why the shared ring cannot be used here ('' if it can)."""
        if dataset.batch_size is None or dataset.decode is not None:
            return "needs StreamingDataset(batch_size=..., decode=None) (raw batches built in the workers)"
        if getattr(dataset, "streams", None):
            return "a mixture of streams collates its batches from samples (no raw batches to write into it)"
        if self.num_workers < 1:
            return "needs num_workers > 0"
        if getattr(dataset, "annotations", False):  # side columns ride with copied batches, not ring slots
            return "not with StreamingDataset(annotations=True)"
        ctx = self.multiprocessing_context
        method = ctx.get_start_method() if ctx is not None else multiprocessing.get_start_method()
        if method != "fork":
            return f"needs forked workers (multiprocessing start method is {method!r})"
        if self._ring_bytes > MAX_RING_SLOT:
            return (f"batches of ~{self._ring_bytes >> 20} MiB exceed the ring's {MAX_RING_SLOT >> 20} MiB slots; "
                    "use a smaller batch_size")
        return ""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """This rank's batches (or samples) of the epoch, counting what the loop receives.

        Yields:
            Batches as the DataLoader makes them; ring batches arrive as dicts of tensors
            (copied into pinned memory with ``pin_memory`` and CUDA).
        """
        self._consumed = 0
        # torch remembers the length of the last len(loader) call and warns when an epoch
        # yields more; after a resumed (shorter) epoch that is every later epoch's every batch.
        self._IterableDataset_len_called = None
        dataset: StreamingDataset = self.dataset  # type: ignore[assignment]
        forks = self.num_workers > 0 and (self._iterator is None or not self.persistent_workers)
        if self._use_ring and forks and (self._ring is None or not self._ring_clean):
            # Made before the workers fork, so they inherit it. Reused across epochs once an
            # epoch has ended (its workers are gone); slots still held by batches stay busy.
            self._ring = _take_ring(self.num_workers, (self.prefetch_factor or 2) + 2, self._ring_bytes)
        dataset.ring = self._ring if self._use_ring else None
        self._ring_clean = False
        share = dataset.samples_per_rank()
        for batch in super().__iter__():
            if isinstance(batch, RingBatch):
                batch = self._from_ring(batch)
            elif dataset.batch_size is not None and isinstance(batch, dict):
                batch = to_torch(batch)  # numpy arrays over a worker's shared slots; tensors pass as they are
            n = _count(batch) if self._batched else 1
            # A batch that does not say its size (a decoder's tuples, say) is a full one: the
            # workers take turns in whole batches, so only the rank's last batch is short.
            self._consumed = min(self._consumed + (self._per_batch if n is None else n), share)
            yield batch
        self._ring_clean = not self.persistent_workers

    def __del__(self) -> None:
        if getattr(self, "_ring_clean", False) and self._ring is not None:
            _spare_ring(self._ring)  # no worker can write it any more: the next loader may

    def _from_ring(self, rb: RingBatch) -> dict[str, Any]:
        batch = rb.to_dict()
        if self._pool is not None:  # pin_memory: one copy, into page-locked memory
            for name in rb.names:
                pinned = self._pool.take(batch[name].nbytes)
                pinned[:] = batch[name]
                batch[name] = pinned
        return to_torch(batch)

    @property
    def consumed(self) -> int:
        """Samples this loader has yielded this epoch (on this rank)."""
        return self._consumed

    def state_dict(self) -> dict[str, Any]:
        """The dataset's resumable state at the samples this loader has yielded.

        Returns:
            See :meth:`StreamingDataset.state_dict <shardkit.datasets.streaming.StreamingDataset.state_dict>`.
        """
        return self.dataset.state_dict(consumed=self._consumed)  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a stopped epoch (any world size or worker count).

        Args:
            state: a dict :meth:`state_dict` returned.

        Raises:
            ConfigError: the state does not fit this dataset (see
                :meth:`StreamingDataset.load_state_dict <shardkit.datasets.streaming.StreamingDataset.load_state_dict>`).
        """
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]
        self._consumed = 0


# Rings of loaders that are gone (and whose workers are gone), for the next loader in this
# process: fresh shared memory costs the kernel a zero-filled page per 4 KiB, which a loader
# made per epoch or per evaluation would otherwise pay for its whole ring every time.
_SPARE_RINGS: list[BatchRing] = []
_KEEP_SPARE = 2


def _take_ring(workers: int, per_worker: int, slot_bytes: int) -> BatchRing:
    for ring in _SPARE_RINGS:
        if (ring.owner == os.getpid() and ring.workers == workers and ring.per_worker == per_worker
                and slot_bytes <= ring.slot_bytes <= 2 * slot_bytes):
            _SPARE_RINGS.remove(ring)
            return ring
    return BatchRing(workers, per_worker, slot_bytes)


def _spare_ring(ring: BatchRing) -> None:
    if ring.owner == os.getpid() and ring not in _SPARE_RINGS:
        _SPARE_RINGS.append(ring)
        del _SPARE_RINGS[:-_KEEP_SPARE]


def _as_is(batch: Any) -> Any:
    return batch


def _convert_writable(sample: Any) -> Any:
    """torch's default_convert, copying read-only numpy arrays first."""
    return default_convert(_writable(sample))


def _writable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else value.copy()
    if isinstance(value, dict):
        return {k: _writable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_writable(v) for v in value]
    if isinstance(value, tuple):
        items = [_writable(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuples too
    return value


def _count(batch: Any) -> int | None:
    """Samples in a batch that says so (its keys), else None."""
    if isinstance(batch, dict) and isinstance(batch.get("__key__"), (list, tuple)):
        return len(batch["__key__"])
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], dict) and "__key__" in batch[0]:
        return len(batch)
    return None


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())
