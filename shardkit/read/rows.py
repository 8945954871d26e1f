"""The manifest rows a reader slices samples with: one shard's row (:class:`ShardInfo`) and the
per-sample rows of one shard as numpy columns (:class:`ShardRows`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa

from shardkit.errors import ManifestError
from shardkit.format.checksums import BLOCK_BYTES_KEY

__all__ = ["FieldLayout", "ShardInfo", "ShardRows", "block_checksums", "check_spans"]


@dataclass(frozen=True)
class ShardInfo:
    """One row of shards.parquet as a plain object.

    ``samples_file`` is ``""`` and ``samples_row_group`` is ``-1`` in a manifest written
    before shards.parquet named each shard's row group.
    """

    shard: int
    path: str
    num_samples: int
    bytes: int
    first_sample: int
    checksum: str
    samples_file: str
    samples_row_group: int


@dataclass(frozen=True)
class FieldLayout:
    """Member offsets of one shard as (samples x fields) arrays, when every sample of the
    shard has the same fields (the common case); lets a batch be sliced with numpy."""

    names: tuple[str, ...]
    offs: np.ndarray
    sizes: np.ndarray
    keys: list[str]


class ShardRows:
    """The manifest rows of one shard as numpy columns (cheap to slice per sample).

    No Python object is kept per sample but the keys, and those only once a reader iterates
    the shard (``keys``; a random access reads one key from the Arrow column): a 512 MB shard
    of small samples has ~250,000 rows, and every DataLoader worker of every rank holds some.
    Fields are flat arrays, each sample's a slice of them (``fields``).

    Args:
        table: the shard's sample rows, at least the columns of :attr:`COLUMNS` but
            ``block_checksums`` (optional: manifests written before it lack it).
    """

    COLUMNS = ("key", "offset", "size", "fields", "checksum", "block_checksums")

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.offset: np.ndarray = table.column("offset").to_numpy()
        self.size: np.ndarray = table.column("size").to_numpy()
        self.checksum: np.ndarray = table.column("checksum").to_numpy()

    def __len__(self) -> int:
        return self.table.num_rows

    @functools.cached_property
    def _key_column(self) -> pa.Array:
        return self.table.column("key").combine_chunks()

    @functools.cached_property
    def keys(self) -> list[str]:
        """Every key as a str (~90 B a sample): for readers that go through the shard.

        Returns:
            The samples' keys in shard order, built on first use and kept.
        """
        return self._key_column.to_pylist()

    def key(self, i: int) -> str:
        """Sample ``i``'s key (from :attr:`keys` once built, else from the Arrow column).

        Args:
            i: the sample's position in the shard.

        Returns:
            The key.
        """
        keys = self.__dict__.get("keys")
        return keys[i] if keys is not None else self._key_column[i].as_py()

    @functools.cached_property
    def _blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(bounds, valid, flat digests) of ``block_checksums``: sample i's are entries
        bounds[i]:bounds[i + 1] when valid[i]; None for a manifest written before the column."""
        if "block_checksums" not in self.table.column_names:
            return None
        col = self.table.column("block_checksums").combine_chunks()
        if col.values.null_count:
            raise ManifestError("block_checksums holds null digests")
        return (col.offsets.to_numpy(), col.is_valid().to_numpy(zero_copy_only=False),
                col.values.to_numpy())

    @property
    def block_bytes(self) -> int | None:
        """The block size of ``block_checksums`` (the fragment's schema metadata), or None."""
        raw = (self.table.schema.metadata or {}).get(BLOCK_BYTES_KEY)
        try:
            return int(raw) if raw is not None and int(raw) > 0 else None
        except ValueError:
            return None

    def block_checksums(self, i: int) -> np.ndarray | None:
        """Sample ``i``'s block checksums as recorded, unchecked (see :func:`block_checksums`).

        Args:
            i: the sample's position in the shard.

        Returns:
            The uint64 digests, or None when the sample has none recorded.

        Raises:
            ManifestError: the column holds null digests.
        """
        blocks = self._blocks
        if blocks is None or not blocks[1][i]:
            return None
        bounds, _, flat = blocks
        return flat[int(bounds[i]):int(bounds[i + 1])]

    @functools.cached_property
    def _fields(self) -> tuple[np.ndarray, tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]:
        """(bounds, distinct names, name codes, offsets, sizes): sample i's fields are entries
        bounds[i]:bounds[i + 1] of the flat arrays, its names ``names[codes[...]]``."""
        fields = self.table.column("fields").combine_chunks()
        flat = fields.flatten()  # from the first sample's first field on, whatever the offsets say
        parts = (flat.field("name"), flat.field("offset"), flat.field("size"))
        if flat.null_count or any(p.null_count for p in parts):  # a null list is a sample without fields
            raise ManifestError("the fields column holds nulls")  # check_spans names the shard
        bounds = fields.offsets.to_numpy()
        names = flat.field("name").dictionary_encode()
        return (bounds - bounds[0], tuple(names.dictionary.to_pylist()), names.indices.to_numpy(),
                flat.field("offset").to_numpy(), flat.field("size").to_numpy())

    def fields(self, i: int) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Sample ``i``'s fields.

        Args:
            i: the sample's position in the shard.

        Returns:
            (field names, member offsets in the shard, member sizes).
        """
        bounds, names, codes, offs, sizes = self._fields
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        return [names[c] for c in codes[lo:hi].tolist()], offs[lo:hi], sizes[lo:hi]

    @functools.cached_property
    def _payload(self) -> np.ndarray:
        """Per sample, the bytes of its field bodies (what a reader hands to the training loop)."""
        bounds, _, _, _, sizes = self._fields
        ends = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        return ends[bounds[1:]] - ends[bounds[:-1]]

    def payload_bytes(self, positions: np.ndarray) -> int:
        """The bytes of the field bodies of these samples.

        Args:
            positions: sample positions in the shard.

        Returns:
            Their sum.
        """
        return int(self._payload[positions].sum())

    def spans(self, positions: np.ndarray) -> tuple[list[str], list[Sequence[str]], list[list[int]], list[list[int]]]:
        """The spans of the samples at ``positions``, as Python lists made in one go: a reader
        going through a shard's samples pays a few numpy calls per run of samples, not per
        sample.

        Args:
            positions: the samples' positions in the shard.

        Returns:
            (keys, field names, member offsets, member sizes), one entry per position.
        """
        keys = self.keys
        idx = positions.tolist()
        layout = self.layout
        if layout is not None:
            return ([keys[p] for p in idx], [layout.names] * len(idx), layout.offs[positions].tolist(),
                    layout.sizes[positions].tolist())
        names: list[Sequence[str]] = []
        offs: list[list[int]] = []
        sizes: list[list[int]] = []
        for p in idx:
            n, o, s = self.fields(p)
            names.append(n)
            offs.append(o.tolist())
            sizes.append(s.tolist())
        return [keys[p] for p in idx], names, offs, sizes

    @property
    def field_names(self) -> set[str]:
        """Every field name that some sample of the shard has."""
        return set(self._fields[1])

    @functools.cached_property
    def layout(self) -> FieldLayout | None:
        """The shard's fields as (samples x fields) arrays, worked out on first use and kept.

        Returns:
            The shard's :class:`FieldLayout`, or None when the shard is empty, its samples
            have no fields, or their fields (names, number or order) differ.
        """
        n = len(self)
        if n == 0:
            return None
        bounds, names, codes, offs, sizes = self._fields  # the flat arrays, reshaped (no copy)
        nf = int(bounds[1])
        if nf == 0 or not bool(np.all(np.diff(bounds) == nf)):
            return None
        grid = codes.reshape(n, nf)
        if not bool(np.all(grid == grid[0])):
            return None
        return FieldLayout(tuple(names[c] for c in grid[0].tolist()), offs.reshape(n, nf), sizes.reshape(n, nf),
                           self.keys)

    @property
    def nbytes(self) -> int:
        """Memory held, roughly: the Arrow rows, numpy columns, and what was built since."""
        n = len(self)
        held = self.table.nbytes + self.offset.nbytes + self.size.nbytes + self.checksum.nbytes
        if "keys" in self.__dict__:  # a list slot and a str header per key, and its characters
            held += n * (8 + 49) + self._key_column.nbytes
        for name in ("_fields", "_blocks"):
            if self.__dict__.get(name) is not None:
                held += sum(a.nbytes for a in self.__dict__[name] if isinstance(a, np.ndarray))
        return held  # a layout is views of the flat field arrays


def block_checksums(info: ShardInfo, rows: ShardRows, pos: int) -> tuple[np.ndarray, int] | None:
    """The block checksums of sample ``pos`` of shard ``info``, checked against its size.

    Args:
        info: the shard's row of shards.parquet (names it in errors).
        rows: the shard's manifest rows.
        pos: the sample's position in the shard.

    Returns:
        (block checksums, block size), or None when the sample has none recorded.

    Raises:
        ManifestError: the rows lack the block size, or record another number of blocks
            than the sample's size makes.
    """
    digests = rows.block_checksums(pos)
    if digests is None:
        return None
    block_bytes = rows.block_bytes
    if block_bytes is None:
        raise ManifestError(f"manifest rows of shard {info.shard} ({info.path}) have block_checksums but no "
                            "shardkit.block_bytes in their schema metadata")
    size = int(rows.size[pos])
    if len(digests) != -(-size // block_bytes):
        raise ManifestError(f"sample {rows.key(pos)!r} in {info.path}: {len(digests)} block checksums for "
                            f"{size} bytes in blocks of {block_bytes}")
    return digests, block_bytes


def check_spans(info: ShardInfo, rows: ShardRows) -> None:
    """Refuse manifest rows that place a sample outside its shard, or a field outside its
    sample's bytes ``[offset, offset+size)``: the only bytes its checksum covers. Readers
    slice fields with these spans unchecked (a negative offset would count from the end), so
    a bad span would hand out another sample's bytes, or a truncated field, with no error.

    Once per shard, when its rows are read, in a few numpy passes (no per-sample Python).

    Args:
        info: the shard's row of shards.parquet (names it in the error).
        rows: its manifest rows.

    Raises:
        ManifestError: naming the shard, the sample's key and the field at fault.
    """
    where = f"shard {info.shard} ({info.path})"
    fix = (f"the sample manifest{' ' + info.samples_file if info.samples_file else ''} is corrupt or was "
           "edited: restore it, or pack the dataset again")
    if len(rows) == 0:
        return
    off, size = rows.offset, rows.size
    if any(col.dtype.kind not in "iu" for col in (off, size, rows.checksum)):  # nulls make them floats
        raise ManifestError(f"{where}: sample offsets, sizes or checksums hold nulls; {fix}")
    off, size = off.astype(np.int64, copy=False), size.astype(np.int64, copy=False)
    bad = np.flatnonzero((off < 0) | (size < 0) | (off > info.bytes - size))
    if bad.size:
        i = int(bad[0])
        raise ManifestError(f"{where}: sample {rows.key(i)!r} spans bytes [{int(off[i])}, {int(off[i]) + int(size[i])}), "
                            f"outside the shard's {info.bytes} bytes; {fix}")
    try:
        bounds, names, codes, foffs, fsizes = rows._fields
    except ManifestError as exc:
        raise ManifestError(f"{where}: {exc}; {fix}") from exc
    owner = np.repeat(np.arange(len(rows), dtype=np.int64), np.diff(bounds))
    lo = off[owner]
    hi = lo + size[owner]
    foffs, fsizes = foffs.astype(np.int64, copy=False), fsizes.astype(np.int64, copy=False)
    # fsizes >= 0 and hi <= info.bytes: hi - fsizes cannot overflow where it decides
    bad = np.flatnonzero((fsizes < 0) | (foffs < lo) | (foffs > hi - fsizes))
    if bad.size:
        j = int(bad[0])
        i = int(owner[j])
        raise ManifestError(f"{where}: field {names[int(codes[j])]!r} of sample {rows.key(i)!r} spans bytes "
                            f"[{int(foffs[j])}, {int(foffs[j]) + int(fsizes[j])}), outside the sample's "
                            f"[{int(lo[j])}, {int(hi[j])}); {fix}")
