"""StreamingDataLoader: a torch DataLoader that makes StreamingDataset resume exactly.

It tells the dataset how samples are grouped into batches, so DataLoader workers take turns
in whole batches and the loader yields exactly the rank's order; it counts the samples the
training loop has received in the main process, which is the position a checkpoint needs.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import DataLoader

from .dataset import StreamingDataset
from .errors import ConfigError
from .rawbatch import BatchPlan


class StreamingDataLoader(DataLoader):  # type: ignore[type-arg]
    """A :class:`torch.utils.data.DataLoader` over a :class:`StreamingDataset` with resume.

    Args:
        dataset: the stream.
        batch_size: samples per batch. When the dataset already batches in its workers
            (``StreamingDataset(batch_size=...)``), leave this ``None``: the DataLoader then
            passes the worker's batches through (``DataLoader(batch_size=None)``).
        handoff: ``"auto"`` (default) uses the map handoff when the dataset yields raw batches
            from a node cache through workers: workers send small batch plans and this process
            copies the bytes from the verified cached shards, so raw bytes never go through
            the worker pipe. ``"copy"`` always sends filled batches.
        **kwargs: any other DataLoader argument (``num_workers``, ``pin_memory``,
            ``persistent_workers``, ``collate_fn``, ...).

    ``state_dict()`` is ``dataset.state_dict(consumed=<samples yielded by this loader this
    epoch>)``; call it between steps and save it with the model. ``load_state_dict`` forwards.
    """

    def __init__(self, dataset: StreamingDataset, batch_size: int | None = None, *, handoff: str = "auto",
                 **kwargs: Any) -> None:
        if handoff not in ("auto", "map", "copy"):
            raise ConfigError(f"handoff: expected 'auto', 'map' or 'copy', got {handoff!r}")
        if not isinstance(dataset, StreamingDataset):
            raise ConfigError("StreamingDataLoader needs a shardkit.StreamingDataset")
        if dataset.batch_size is not None:
            if batch_size not in (None, dataset.batch_size):
                raise ConfigError(f"batch_size={batch_size} but the dataset already batches by "
                                  f"{dataset.batch_size}; pass batch_size=None")
            batch_size = None
            dataset.chunk = dataset.batch_size
        else:
            dataset.chunk = batch_size or 1
        kwargs.setdefault("shuffle", None)  # order comes from the dataset
        super().__init__(dataset, batch_size=batch_size, **kwargs)
        # Raw batches from a node cache: workers send plans, this process copies from the
        # cached files (bytes never cross the worker pipe). Decoded data stays in workers.
        mappable = (dataset.batch_size is not None and dataset.decode is None and dataset.cache_dir is not None
                    and self.num_workers > 0)
        if handoff == "map" and not mappable:
            raise ConfigError("handoff='map' needs StreamingDataset(batch_size=..., decode=None, cache_dir=...) "
                              "and num_workers > 0")
        dataset.loader_workers = self.num_workers
        dataset.handoff = "map" if mappable and handoff != "copy" else "copy"
        if dataset.handoff == "map" and not dataset.map_handoff_fits():
            # A cache too small for everyone's pins plus a main-process pin could stall: the
            # main process would wait for space that blocked workers hold. Copy instead.
            if handoff == "map":
                raise ConfigError(f"handoff='map': cache_limit {dataset.cache_limit} bytes is too small for the "
                                  "shards every process pins; raise it or use handoff='copy'")
            dataset.handoff = "copy"
        self._pin = bool(self.pin_memory) and _cuda_available()
        self._consumed = 0
        self._per_batch = batch_size or dataset.batch_size or 1

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._consumed = 0
        for batch in super().__iter__():
            if isinstance(batch, BatchPlan):
                batch = self.dataset.materialize(batch, pin=self._pin)  # type: ignore[attr-defined]
            self._consumed += _count(batch, self._per_batch)
            yield batch

    @property
    def consumed(self) -> int:
        """Samples this loader has yielded this epoch (on this rank)."""
        return self._consumed

    def state_dict(self) -> dict[str, Any]:
        """The dataset's resumable state at the samples this loader has yielded."""
        return self.dataset.state_dict(consumed=self._consumed)  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a stopped epoch (any world size or worker count)."""
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]
        self._consumed = 0


def _count(batch: Any, default: int) -> int:
    if isinstance(batch, dict) and "__key__" in batch:
        return len(batch["__key__"])
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], dict) and "__key__" in batch[0]:
        return len(batch)
    return default


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())
