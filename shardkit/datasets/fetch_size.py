"""The batch size of a plain torch ``DataLoader`` that pulls single samples from a stream.

torch never tells an ``IterableDataset`` how its DataLoader batches: the loader's fetcher asks
for a batch by calling ``next()`` on the dataset's iterator once per index of the batch it was
handed (``possibly_batched_index``, as long as the batch). A stream needs that size to split
its share among DataLoader workers in whole batches, as it does when told
(``loader_batch_size=``, or :class:`shardkit.StreamingDataLoader`): the loader then yields
exactly the rank's order (so a resume is exact), and each worker reads contiguous runs of
samples (without a cache, only its own bytes; one sample each, taking turns, made every
worker fetch nearly every shard whole). So at its first sample a stream looks for that call
among its callers' frames. Where it is not found (another torch, a loader that does not
batch, iteration outside a DataLoader) nothing changes.
"""

from __future__ import annotations

import sys

__all__ = ["fetcher_batch_size"]

_DEPTH = 6  # frames looked through: this function's caller, its callers, then the fetcher's


def fetcher_batch_size() -> int | None:
    """The batch size of the torch DataLoader fetch calling into the current stream, if any.

    Call it from the stream's ``__iter__`` body (or a method it calls), before the first sample.

    Returns:
        The length of the fetcher's batch of indices, or None when no batching fetcher of
        an iterable dataset is among the callers.
    """
    frame = sys._getframe(1)
    for _ in range(_DEPTH):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        if frame.f_code.co_name != "fetch" or "possibly_batched_index" not in frame.f_code.co_varnames:
            continue
        local = frame.f_locals
        fetcher = local.get("self")
        if type(fetcher).__name__ != "_IterableDatasetFetcher" or not getattr(fetcher, "auto_collation", False):
            return None
        try:
            size = len(local["possibly_batched_index"])
        except TypeError:
            return None
        return size if size >= 1 else None
    return None
