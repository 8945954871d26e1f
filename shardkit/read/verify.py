"""Checking shard bytes against the manifest: a whole shard's xxh3-128, each sample's xxh3-64
and block checksums, and the pieces of :meth:`shardkit.read.dataset.Dataset.verify` (every
shard present with its size, or with ``deep`` every byte), which names each fault it finds.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import xxhash

from shardkit.errors import IntegrityError, ShardkitError
from shardkit.format.checksums import bad_blocks
from shardkit.read.rows import ShardInfo, ShardRows, block_checksums
from shardkit.storage.store import Store

__all__ = ["VERIFY_NAMED", "check_shard_bytes", "missing_samples_files", "raise_failures", "verify_samples",
           "verify_shards"]

VERIFY_NAMED = 5  # failing shards a verify error names in its one line


def check_shard_bytes(data: bytes | memoryview, info: ShardInfo) -> None:
    """Check a whole shard's bytes: its size and xxh3-128 as shards.parquet records them.

    Args:
        data: the shard's bytes.
        info: its row of shards.parquet.

    Raises:
        IntegrityError: the size or the checksum differs.
    """
    if len(data) != info.bytes:
        raise IntegrityError(f"shard {info.shard} ({info.path}) is {len(data)} bytes, manifest says {info.bytes}")
    digest = xxhash.xxh3_128_hexdigest(data)
    if digest != info.checksum:
        raise IntegrityError(f"shard {info.shard} ({info.path}) checksum mismatch: {digest} != manifest {info.checksum}")


def _verify_sample(view: memoryview, base: int, rows: ShardRows, i: int, shard_path: str) -> None:
    """Check sample ``i``'s bytes in ``view`` (shard bytes from shard byte ``base`` on)
    against its xxh3-64.

    Args:
        view: shard bytes from shard byte ``base`` on.
        base: the shard offset ``view`` starts at.
        rows: the shard's manifest rows.
        i: the sample's position in the shard.
        shard_path: names the shard in errors.

    Raises:
        IntegrityError: the sample lies beyond ``view``, or its bytes fail the checksum.
    """
    start = int(rows.offset[i]) - base
    end = start + int(rows.size[i])
    if start < 0 or end > len(view):
        raise IntegrityError(f"sample {rows.key(i)!r} in {shard_path}: bytes [{start + base}, {end + base}) beyond the data")
    got = xxhash.xxh3_64_intdigest(view[start:end])
    if got != int(rows.checksum[i]):
        raise IntegrityError(f"sample {rows.key(i)!r} in {shard_path} fails its checksum (corrupt bytes)")


def verify_samples(view: memoryview, base: int, rows: ShardRows, positions: np.ndarray, shard_path: str) -> None:
    """Check the bytes of each sample of ``positions`` in ``view`` against its xxh3-64, in one
    tight loop (a segment's worth at a time).

    Args:
        view: shard bytes from shard byte ``base`` on.
        base: the shard offset ``view`` starts at.
        rows: the shard's manifest rows.
        positions: the samples' positions in the shard.
        shard_path: names the shard in errors.

    Raises:
        IntegrityError: naming the first sample of ``positions`` that lies beyond ``view`` or
            fails its checksum.
    """
    end = len(view)
    for i, start, size, want in zip(positions.tolist(), (rows.offset[positions] - base).tolist(),
                                    rows.size[positions].tolist(), rows.checksum[positions].tolist()):
        if start < 0 or start + size > end or xxhash.xxh3_64_intdigest(view[start:start + size]) != want:
            _verify_sample(view, base, rows, i, shard_path)  # raises, naming the sample


def _verify_blocks(view: memoryview, info: ShardInfo, rows: ShardRows, i: int) -> None:
    """Check sample ``i``'s block checksums, if it has them, against the whole shard's bytes.

    Args:
        view: the shard's bytes from byte 0.
        info: its row of shards.parquet.
        rows: its manifest rows.
        i: the sample's position in the shard.

    Raises:
        IntegrityError: a block fails its checksum.
        ManifestError: the block checksums disagree with the sample's size.
    """
    blocks = block_checksums(info, rows, i)
    if blocks is None:
        return
    start = int(rows.offset[i])
    bad = bad_blocks(np.frombuffer(view, np.uint8, int(rows.size[i]), start), 0, blocks[0], blocks[1])
    if bad:
        raise IntegrityError(f"sample {rows.key(i)!r} in {info.path}: block {bad[0]} fails its block checksum")


def missing_samples_files(store: Store, shards: Sequence[ShardInfo]) -> list[str]:
    """The samples files that shards.parquet names (or, in a manifest without
    ``samples_file``, the samples files at all) and storage lacks.

    Args:
        store: the dataset root.
        shards: the rows of its shards.parquet.

    Returns:
        One line per missing file.
    """
    named = sorted({s.samples_file for s in shards if s.num_samples and s.samples_file})
    if not named and any(s.num_samples for s in shards):
        if not store.glob("manifest/samples-*.parquet"):
            return [f"{store.url_of('manifest')} holds no samples-*.parquet"]
        return []
    return [f"{store.url_of(name)} is missing (shards.parquet names it)" for name in named
            if not store.exists(name)]


def verify_shards(store: Store, shards: Sequence[ShardInfo], rows_of: Callable[[int], ShardRows], deep: bool,
                  progress: Callable[[int], None] | None = None) -> tuple[list[str], set[str], int]:
    """Check every shard, also after one fails, so one run lists all that need repair.

    Args:
        store: the dataset root.
        shards: the rows of its shards.parquet.
        rows_of: a shard's manifest rows, their spans checked (:meth:`~shardkit.read.dataset.Dataset.shard_rows`).
        deep: check every byte (each sample's checksums and the shard's), not only the size
            and the manifest rows.
        progress: called with each shard's size once it is checked.

    Returns:
        (one line per failing shard, the field names of the samples seen (``deep`` only),
        the number of shards checked).
    """
    failed: list[str] = []
    fields: set[str] = set()
    checked = 0
    for info in shards:
        try:
            fields |= _verify_shard(store, info, rows_of, deep)
        except IntegrityError as exc:
            failed.append(str(exc))
        except ShardkitError as exc:  # its manifest rows are unreadable, or disagree with shards.parquet or the shard
            text, prefix = str(exc), f"shard {info.shard} ({info.path})"
            failed.append(text if text.startswith(prefix) else f"{prefix}: {text}")
        checked += 1
        if progress:
            progress(info.bytes)
    return failed, fields, checked


def _verify_shard(store: Store, info: ShardInfo, rows_of: Callable[[int], ShardRows], deep: bool) -> set[str]:
    """Check one shard; return the field names of its samples (deep only)."""
    # Deep: the bytes read give the size (no HEAD besides); the size is checked first, so a
    # truncated shard is named as such, not by its first sample past the end.
    data = b""
    try:
        if deep:
            data = store.read_bytes(info.path)
        size = len(data) if deep else store.size(info.path)
    except Exception as exc:  # noqa: BLE001 - a missing shard is an integrity failure
        raise IntegrityError(f"shard {info.shard} ({info.path}) is missing or unreadable: {exc}") from exc
    if size != info.bytes:
        raise IntegrityError(f"shard {info.shard} ({info.path}) is {size} bytes, manifest says {info.bytes}")
    rows = rows_of(info.shard)  # ManifestError unless num_samples rows, each sample and field inside its bytes
    if not deep:
        return set()
    view = memoryview(data)
    for i in range(len(rows)):
        _verify_sample(view, 0, rows, i, info.path)
        _verify_blocks(view, info, rows, i)
    check_shard_bytes(data, info)
    return rows.field_names


def raise_failures(manifest: list[str], failed: list[str], checked: int) -> None:
    """Raise one error for the faults a verify found, if any.

    Args:
        manifest: one line per manifest fault.
        failed: one line per failing shard.
        checked: the shards checked.

    Raises:
        IntegrityError: naming the first :data:`VERIFY_NAMED` faults in its one line, and
            counting them; ``.failures`` lists them all, one line each.
    """
    failures = manifest + failed
    if not failures:
        return
    named = "; ".join(failures[:VERIFY_NAMED])
    more = f"; and {len(failures) - VERIFY_NAMED} more" if len(failures) > VERIFY_NAMED else ""
    counts = ([f"{len(manifest)} manifest fault{'s' if len(manifest) > 1 else ''}"] if manifest else []) + \
        ([f"{len(failed)} of {checked} shards fail"] if failed else [])
    err = IntegrityError(f"{' and '.join(counts)}: {named}{more}" if len(failures) > 1 else failures[0])
    err.failures = failures  # type: ignore[attr-defined]
    raise err
