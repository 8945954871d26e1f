"""``Stream``: one dataset of a mixture, with the share of each epoch it contributes.

A Stream only names its data and its share (see :mod:`shardkit.read.mixture` for what
``weight``, ``repeat`` and ``choose`` mean); ``StreamingDataset([Stream(...), ...])`` opens and
reads it. A stream may be a subset of its dataset (``where=`` or ``indices=``, as for one
dataset: :mod:`shardkit.read.selection`): the mixture then sees the selected samples only.
"""

from __future__ import annotations

import os
from typing import Any

from shardkit.errors import ConfigError
from shardkit.read.mix_counts import Share

__all__ = ["Stream"]


class Stream:
    """One dataset of a mixture.

    Args:
        url: the dataset root (``s3://bucket/ds``, a local path, ...).
        weight: relative share of each epoch (every stream of a mixture has one, or none).
        repeat: upsample factor: ``round(repeat * n)`` samples per epoch (whole copies and a
            seeded subset for the fraction).
        choose: samples per epoch (a seeded subset, or copies and a subset).
        storage_options: fsspec/s3fs options for this URL (default: the dataset's).
        where: only the samples this SQL condition over the dataset's manifest columns selects
            (``"label < 500"``; needs ``shardkit[query]``), as ``StreamingDataset(where=)``;
            ``weight``/``repeat``/``choose`` then apply to the selected samples.
        indices: only these global sample indices; not with ``where``.

    Raises:
        ConfigError: ``url`` is no string or path, more than one of weight/repeat/choose is set,
            or one of them is out of range.
    """

    def __init__(self, url: str | os.PathLike[str], weight: float | None = None, repeat: float | None = None,
                 choose: int | None = None, storage_options: dict[str, Any] | None = None, *,
                 where: str | None = None, indices: Any = None) -> None:
        if not isinstance(url, (str, os.PathLike)):
            raise ConfigError(f"Stream: url must be a string or path, got {type(url).__name__}")
        if where is not None and not isinstance(where, str):
            raise ConfigError(f"Stream: where must be an SQL condition (a string), got {type(where).__name__}")
        self.url = os.fspath(url)
        self.share = Share(weight=weight, repeat=repeat, choose=choose)
        self.storage_options = storage_options
        self.where, self.indices = where, indices

    @property
    def weight(self) -> float | None:
        """The stream's weight (None: absolute)."""
        return self.share.weight

    @property
    def repeat(self) -> float | None:
        """The stream's repeat factor, if set."""
        return self.share.repeat

    @property
    def choose(self) -> int | None:
        """The stream's absolute count, if set."""
        return self.share.choose

    def __repr__(self) -> str:
        opts = "".join(f", {k}={getattr(self, k)!r}" for k in ("weight", "repeat", "choose", "where")
                       if getattr(self, k) is not None)
        return f"Stream({self.url!r}{opts})"
