"""Manifest rows as packing produces them: one record per shard, column lists per sample.

Both sides share these types: the pack writer fills them, the manifest and fragment code turn
them into Arrow tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PIECE_ROWS", "ShardRecord", "SampleRows", "shard_name"]

# A shard with ``on_rows`` hands its manifest rows over every this many samples: a 512 MB shard
# of 1 KB samples would otherwise hold half a million rows as Python objects (~0.5 GB).
PIECE_ROWS = 4096


def shard_name(index: int) -> str:
    """The deterministic path of shard ``index`` relative to the dataset root.

    Args:
        index: the shard number.

    Returns:
        ``shards/shard-NNNNNN.tar``.
    """
    return f"shards/shard-{index:06d}.tar"


@dataclass
class ShardRecord:
    """One row of manifest/shards.parquet (``first_sample`` is filled in at commit)."""

    shard: int
    path: str
    num_samples: int
    bytes: int
    checksum: str


@dataclass
class SampleRows:
    """Column lists of manifest/samples rows (columnar to keep millions of rows small)."""

    key: list[str] = field(default_factory=list)
    shard: list[int] = field(default_factory=list)
    offset: list[int] = field(default_factory=list)
    size: list[int] = field(default_factory=list)
    fields: list[list[dict[str, Any]]] = field(default_factory=list)
    checksum: list[int] = field(default_factory=list)
    blocks: list[list[int] | None] = field(default_factory=list)  # block_checksums (None: one block or less)
    meta: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.key)

    def extend(self, other: "SampleRows") -> None:
        """Append ``other``'s rows.

        Args:
            other: rows to append.
        """
        for name in _ROW_COLUMNS:
            getattr(self, name).extend(getattr(other, name))

    def slice(self, start: int, stop: int) -> "SampleRows":
        """Rows ``[start, stop)``.

        Args:
            start: the first row.
            stop: the row after the last.

        Returns:
            A copy of those rows.
        """
        return SampleRows(*(getattr(self, name)[start:stop] for name in _ROW_COLUMNS))


_ROW_COLUMNS = ("key", "shard", "offset", "size", "fields", "checksum", "blocks", "meta")

