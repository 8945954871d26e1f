"""Reading the documents a batch of token windows needs, without a cache, in few ranged GETs.

One ranged GET per document is slow for corpora of short documents (a window of 2,048 tokens
spans several). A :class:`TokenStream <shardkit.datasets.token_stream.TokenStream>` reading
without a cache hands the documents of its next windows to :func:`read_documents`, which groups
them by shard into runs of neighbouring samples (a gap of at most :data:`GAP_BYTES` is read
through rather than split on; a run holds at most :data:`RUN_BYTES`), reads each run with one
ranged read, and checks every document's sample checksum before use. A document whose bytes
fail their check is read once more alone, which tells corruption in transit from corruption at
rest (then an IntegrityError), as single-sample reads do (:mod:`shardkit.read.checked`).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from shardkit.datasets.random_access import ShardDataset
from shardkit.errors import IntegrityError
from shardkit.read.checked import read_sample
from shardkit.read.decode import npy_view
from shardkit.read.rows import ShardInfo, ShardRows
from shardkit.read.samples import sample_dict
from shardkit.storage.ranged import PartCallback, read_fully

__all__ = ["GAP_BYTES", "RUN_BYTES", "read_documents"]

GAP_BYTES = 256 << 10  # unneeded bytes between two needed samples read through, not a second GET
RUN_BYTES = 16 << 20  # the most bytes one run reads (bounds memory per run)


class _Held:
    """A range reader over bytes already read (``[base, base + len(buf))`` of the shard)."""

    parallel = False

    def __init__(self, buf: np.ndarray, base: int) -> None:
        self.buf, self.base = buf, base

    def read_into(self, start: int, out: memoryview, on_part: PartCallback | None = None) -> int:
        at = start - self.base
        n = max(0, min(len(out), len(self.buf) - at))
        out[:n] = self.buf.data[at:at + n]
        return n


def _runs(rows: ShardRows, positions: list[int]) -> list[list[int]]:
    """``positions`` (ascending) split into runs read with one GET each."""
    runs: list[list[int]] = []
    for p in positions:
        if runs:
            last = runs[-1]
            lo = int(rows.offset[last[0]])
            end = int(rows.offset[last[-1]]) + int(rows.size[last[-1]])
            if (int(rows.offset[p]) - end <= GAP_BYTES
                    and int(rows.offset[p]) + int(rows.size[p]) - lo <= RUN_BYTES):
                last.append(p)
                continue
        runs.append([p])
    return runs


def _tokens(buf: np.ndarray, base: int, rows: ShardRows, pos: int, index: int, info: ShardInfo,
            field: str) -> np.ndarray:
    sample = sample_dict(buf.data, base, rows, pos, index, info.path)
    if field not in sample:
        raise IntegrityError(f"sample {rows.key(pos)!r} (index {index}) in {info.path} has no {field} member")
    return np.array(npy_view(sample[field], native=True))  # a copy: the run's buffer is dropped next


def read_documents(reader: ShardDataset, docs: Iterable[int], field: str) -> dict[int, np.ndarray]:
    """The token arrays of documents ``docs``, read in runs (see the module docstring).

    Args:
        reader: the dataset's random-access reader (its storage, manifest rows and counters).
        docs: global sample indices.
        field: the token member (``tokens.npy``).

    Returns:
        Document -> its tokens, in native byte order (each a copy of its own).

    Raises:
        IntegrityError: a document's bytes fail their checksum twice, or hold no ``field``.
        ManifestError: the manifest places a sample outside its shard.
        StorageError: reading from storage failed.
    """
    by_shard: dict[int, list[int]] = {}
    for d in sorted(set(docs)):
        shard, pos = reader.locate(d)
        by_shard.setdefault(shard, []).append(pos)
    out: dict[int, np.ndarray] = {}
    for shard, positions in by_shard.items():
        info, rows = reader.ds.shard_list[shard], reader.ds.cached_rows(shard)
        first = int(reader.ds.first_samples[shard])
        source = reader._reader(info)  # counted in the reader's stats
        for run in _runs(rows, positions):
            lo = int(rows.offset[run[0]])
            hi = int(rows.offset[run[-1]]) + int(rows.size[run[-1]])
            buf = np.empty(max(0, hi - lo), dtype=np.uint8)
            if 0 <= lo and hi <= info.bytes:
                read_fully(source, lo, buf.data, info.path)
            held = _Held(buf, lo)
            for p in run:
                try:  # checks the checksum; the manifest's span is checked against the shard too
                    sample = read_sample(held, info, rows, p, first + p)
                except IntegrityError:  # maybe bad in transit: read this one alone from storage
                    sample = read_sample(source, info, rows, p, first + p)
                out[first + p] = _tokens(sample, int(rows.offset[p]), rows, p, first + p, info, field)
    return out
