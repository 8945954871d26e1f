"""``Stream``: one dataset of a mixture, with the share of each epoch it contributes.

A Stream only names its data and its share (see :mod:`shardkit.read.mixture` for what
``weight``, ``repeat`` and ``choose`` mean); ``StreamingDataset([Stream(...), ...])`` opens and
reads it. It is the place where a per-stream selection (a ``where=`` view of the dataset) fits
later: the mixture sees only each stream's sample counts and a map back to real samples.
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

    Raises:
        ConfigError: ``url`` is no string or path, more than one of weight/repeat/choose is set,
            or one of them is out of range.
    """

    def __init__(self, url: str | os.PathLike[str], weight: float | None = None, repeat: float | None = None,
                 choose: int | None = None, storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(url, (str, os.PathLike)):
            raise ConfigError(f"Stream: url must be a string or path, got {type(url).__name__}")
        self.url = os.fspath(url)
        self.share = Share(weight=weight, repeat=repeat, choose=choose)
        self.storage_options = storage_options

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
        opts = "".join(f", {k}={getattr(self, k)!r}" for k in ("weight", "repeat", "choose")
                       if getattr(self, k) is not None)
        return f"Stream({self.url!r}{opts})"
