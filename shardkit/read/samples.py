"""Slicing samples out of shard bytes with the manifest's offsets: WebDataset-style dicts of
views (``__key__``, ``__index__``, ``__shard__`` and one entry per field), never parsed from
tar headers. The bytes are verified before (see :mod:`shardkit.read.verify`)."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from shardkit.read.rows import ShardRows

__all__ = ["sample_dict", "sample_dicts", "sample_from"]


def sample_dict(view: memoryview, base: int, rows: ShardRows, i: int, index: int, shard_path: str) -> dict[str, Any]:
    """Slice sample ``i`` of a shard out of ``view``. Readers going through many samples use
    :func:`sample_dicts`.

    Args:
        view: shard bytes, already verified, from shard byte ``base`` on.
        base: the shard offset ``view`` starts at.
        rows: the shard's manifest rows.
        i: the sample's position in the shard.
        index: its global sample index (``__index__``).
        shard_path: the shard's path (``__shard__``).

    Returns:
        The sample dict, its fields views into ``view``.
    """
    names, offs, sizes = rows.fields(i)
    return sample_from(view, base, rows.key(i), index, shard_path, names, offs.tolist(), sizes.tolist())


def sample_dicts(view: memoryview, base: int, rows: ShardRows, positions: np.ndarray, first: int,
                 shard_path: str) -> Iterator[dict[str, Any]]:
    """:func:`sample_dict` of each of ``positions``. The spans are worked out before the first
    sample; ``view`` is only sliced per sample.

    Args:
        view: shard bytes, already verified, from shard byte ``base`` on.
        base: the shard offset ``view`` starts at.
        rows: the shard's manifest rows.
        positions: the samples' positions in the shard.
        first: the global index of the shard's first sample (``__index__`` is ``first`` +
            position).
        shard_path: the shard's path (``__shard__``).

    Yields:
        The sample dicts, in the order of ``positions``.
    """
    keys, names, offs, sizes = rows.spans(positions)
    for k, p in enumerate(positions.tolist()):
        yield sample_from(view, base, keys[k], first + p, shard_path, names[k], offs[k], sizes[k])


def sample_from(view: memoryview, base: int, key: str, index: int, shard_path: str, names: Sequence[str],
                offs: list[int], sizes: list[int], copy: bool = False) -> dict[str, Any]:
    """A sample dict of views into ``view`` (shard byte ``base`` on) from its spans.

    Args:
        view: shard bytes from shard byte ``base`` on.
        base: the shard offset ``view`` starts at.
        key: ``__key__``.
        index: ``__index__``.
        shard_path: ``__shard__``.
        names: the field names.
        offs: each field's member offset in the shard.
        sizes: each field's size.
        copy: the fields as ``bytes`` copies instead of views (raw samples handed out one by
            one: made here, not by copying a dict of views afterwards).

    Returns:
        The sample dict.
    """
    sample: dict[str, Any] = {"__key__": key, "__index__": index, "__shard__": shard_path}
    if copy:
        for name, start, size in zip(names, offs, sizes):
            sample[name] = view[start - base:start - base + size].tobytes()
        return sample
    for name, start, size in zip(names, offs, sizes):
        sample[name] = view[start - base:start - base + size]
    return sample
