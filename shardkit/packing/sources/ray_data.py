"""A ``ray.data.Dataset`` as a source of parts: one part per block, its rows the sample dicts.

The dataset is materialized once on the driver; each part fetches its block from the object
store (where it runs: a Ray task with ``engine="ray"``, this process with ``"local"``) and
reads its rows as dicts (a tensor column's value is a numpy array, stored as ``.npy``). Ray
is imported only when a Ray dataset is given, so this module imports without it.

A rerun resumes only a dataset of the same blocks (their number, their row counts and the
schema): a pipeline whose blocks change from run to run packs anew.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import xxhash

from shardkit.errors import SourceError
from shardkit.packing.sources.parts import Parts

__all__ = ["block_rows", "is_ray_dataset", "ray_dataset_parts"]


def is_ray_dataset(source: Any) -> bool:
    """Whether ``source`` is a ``ray.data.Dataset`` (checked without importing Ray).

    Args:
        source: what :func:`~shardkit.pack` was given.

    Returns:
        True for a Ray dataset (materialized or not).
    """
    return any(c.__module__.startswith("ray.data") and c.__name__ == "Dataset" for c in type(source).__mro__)


def block_rows(blocks: Iterable[Any]) -> Iterator[dict[str, Any]]:
    """The rows of Ray Data blocks (Arrow or pandas) as sample dicts.

    Args:
        blocks: the blocks.

    Yields:
        Each row as a dict of field -> value (numpy arrays for tensor columns).
    """
    from ray.data.block import BlockAccessor  # Ray is there: these are its blocks

    for block in blocks:
        row: Any
        for row in BlockAccessor.for_block(block).iter_rows(public_row_format=True):
            yield dict(row)


class _BlockRows:
    """Part ``i``: the rows of the dataset's block ``i`` (pickled with the blocks' refs)."""

    def __init__(self, refs: list[Any]) -> None:
        self.refs = refs

    def __call__(self, part: int) -> Iterator[dict[str, Any]]:
        import ray

        return block_rows([ray.get(self.refs[part])])


def ray_dataset_parts(source: Any) -> Parts | None:
    """``source`` as :class:`~shardkit.packing.sources.parts.Parts`, one per block, if it is a
    Ray dataset; None for anything else.

    Args:
        source: what :func:`~shardkit.pack` was given.

    Returns:
        The parts (the dataset materialized: its blocks are in the object store), or None.

    Raises:
        SourceError: the dataset has no blocks.
    """
    if not is_ray_dataset(source):
        return None
    ds = source.materialize()
    refs = ds.to_arrow_refs()
    if not refs:
        raise SourceError("source ray.data.Dataset is empty: it has no blocks")
    schema = xxhash.xxh3_64_hexdigest(str(ds.schema()).encode())
    name = f"ray.data.Dataset: {len(refs)} blocks, {ds.count()} rows, schema {schema}"
    return Parts(_BlockRows(refs), len(refs), name=name)
