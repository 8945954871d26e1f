"""What a selection (``where=``/``indices=``) and side columns add to a stream: the selection's
part of the resume state, and samples or batches with their side columns.

Kept apart from :mod:`shardkit.datasets.streaming` so the stream itself changes in a few lines.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from shardkit.read.annotations import Annotations
from shardkit.read.dataset import Dataset
from shardkit.read.selection import Selection

__all__ = ["selection_state", "with_annotations"]


def selection_state(selection: Selection | None) -> dict[str, Any]:
    """The keyword arguments :func:`~shardkit.datasets.state.make_state` and
    :func:`~shardkit.datasets.state.check_state` take for a stream's selection.

    Args:
        selection: the stream's selection, or None (the whole dataset).

    Returns:
        ``{"selection": digest or None, "num_samples": selected count}`` (empty without one).
    """
    if selection is None:
        return {}
    return {"selection": selection.digest, "num_samples": len(selection)}


def with_annotations(ds: Dataset) -> Callable[[Any], Any]:
    """A function adding ``ds``'s side columns to a sample or batch dict as ``__annotations__``
    (looked up by ``__index__``); anything else (a decoder's own object) passes unchanged.

    Args:
        ds: the dataset (its annotations are read once per process and kept).

    Returns:
        The function.

    Raises:
        ManifestError: an annotation is unreadable or written for another pack.
        StorageError: reading one failed.
    """
    memo: dict[str, Annotations] = ds.memo("annotations")
    side = memo.get("all")
    if side is None:
        side = memo["all"] = Annotations(ds)

    def add(item: Any) -> Any:
        if not isinstance(item, dict) or "__index__" not in item:
            return item
        index = item["__index__"]
        if isinstance(index, (int, np.integer)):
            item["__annotations__"] = side.row(int(index))
        else:
            item["__annotations__"] = side.lookup(np.asarray(index))
        return item

    return add
