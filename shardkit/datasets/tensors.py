"""The torch side of batching: numpy batches into tensors, pinned buffers, and which process reads.

``shardkit.batch`` builds batches as numpy arrays and bytes without importing torch; the
torch-facing readers convert them here, as they hand them to the training loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["in_main_process", "pinned_buffer", "to_torch"]


def in_main_process() -> bool:
    """Whether this code runs outside a DataLoader worker.

    Returns:
        True in the process that owns the DataLoader (or without torch); False in a worker.
    """
    try:
        from torch.utils.data import get_worker_info
    except ImportError:
        return True
    return get_worker_info() is None


def to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with its numpy arrays as tensors over the same memory (no copy).

    Args:
        batch: a batch dict; values other than numpy arrays (keys, lists) pass unchanged.

    Returns:
        A new dict; without torch installed, ``batch`` itself.
    """
    try:
        import torch
    except ImportError:
        return batch
    return {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in batch.items()}


def pinned_buffer(nbytes: int) -> np.ndarray:
    """A uint8 array over page-locked (CUDA pinned) memory, for a copy-free GPU transfer.

    Args:
        nbytes: its size.

    Returns:
        The array; it keeps the tensor that owns the pinned memory alive.
    """
    import torch

    tensor: Any = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return tensor.numpy()  # keeps the tensor (and its pinned memory) alive
