"""The samples of the benchmark matrix: ~4 KB token arrays, ~100 KB JPEGs, ~2 MB arrays.

Every tool packs the same samples: sample ``i`` of a kind is ``{<field>: pool[i % len(pool)],
"cls": i % 10}`` with key ``%08d``. A pool holds a few hundred to a few thousand distinct
payloads (made here from a seed, or read from a folder of JPEGs the orchestrator made with
``shardkit.dev.sampledata``), so a dataset of any size costs no generation time; no tool here
compresses or deduplicates, so repeats read like any other bytes.

Needs numpy and the standard library only: the peers' venv imports it as well.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

__all__ = ["KINDS", "MODES", "Kind", "cell_samples", "load_pool", "sample_dict", "payload_bytes"]


@dataclass(frozen=True)
class Kind:
    """One sample size of the matrix.

    Attributes:
        name: ``tokens``, ``jpeg`` or ``arrays``.
        field: the field the payload is packed under (its extension says what it is).
        label: how tables and charts name it.
        batch: samples per batch for every loader (~25-32 MB batches for the larger kinds).
    """

    name: str
    field: str
    label: str
    batch: int


KINDS = {
    "tokens": Kind("tokens", "tokens.npy", "~4 KB tokens", 256),
    "jpeg": Kind("jpeg", "jpg", "~100 KB JPEG", 256),
    "arrays": Kind("arrays", "npy", "~2 MB arrays", 16),
}

#: shardkit's loader modes (benchmarks/matrix_rows.py), as tables and charts name them.
MODES = {
    "per_sample": "plain DataLoader, per-sample dicts (2 workers, shardkit.collate)",
    "workers": "StreamingDataLoader, 2 workers",
    "threads": "num_workers=0, read threads",
    "zero_copy": "zero-copy views (num_workers=0)",
    "nocache": "no cache: StreamingDataLoader, 2 workers",
}


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def load_pool(kind: str, jpeg_dir: str | None = None, quick: bool = False) -> list[bytes]:
    """The distinct payloads of ``kind``, the same in every process for the same arguments.

    Args:
        kind: a key of :data:`KINDS`.
        jpeg_dir: for ``jpeg``, the folder of ``*.jpg`` files to read (sorted by path).
        quick: fewer distinct payloads (a smoke run).

    Returns:
        The payloads, in order.

    Raises:
        FileNotFoundError: ``jpeg`` without a folder holding JPEGs.
    """
    rng = np.random.default_rng(22)
    if kind == "tokens":  # ~4 KB: 1,900-2,100 uint16 tokens as .npy
        return [_npy(rng.integers(0, 50_000, int(rng.integers(1900, 2101)), dtype=np.uint16))
                for _ in range(256 if quick else 4096)]
    if kind == "arrays":  # 2 MiB of float32 (512 x 1024) as .npy
        return [_npy(rng.random((512, 1024), dtype=np.float32)) for _ in range(4 if quick else 24)]
    if kind == "jpeg":
        files = sorted(Path(jpeg_dir or "").rglob("*.jpg")) if jpeg_dir else []
        if not files:
            raise FileNotFoundError(f"no JPEGs under {jpeg_dir!r} for the jpeg pool")
        return [f.read_bytes() for f in files]
    raise ValueError(f"unknown sample kind {kind!r}; expected one of {sorted(KINDS)}")


def sample_dict(kind: str, pool: list[bytes], i: int) -> dict[str, Any]:
    """Sample ``i`` as a WebDataset-style dict (``__key__``, the payload field, ``cls``)."""
    return {"__key__": f"{i:08d}", KINDS[kind].field: pool[i % len(pool)], "cls": i % 10}


def cell_samples(kind: str, pool: list[bytes], count: int) -> Iterator[dict[str, Any]]:
    """Samples 0..count-1 of ``kind`` (see :func:`sample_dict`)."""
    for i in range(count):
        yield sample_dict(kind, pool, i)


def payload_bytes(pool: list[bytes], count: int) -> int:
    """Payload bytes of samples 0..count-1 (the ``cls`` labels left out)."""
    sizes = np.fromiter((len(p) for p in pool), dtype=np.int64, count=len(pool))
    full, rest = divmod(count, len(pool))
    return int(full * sizes.sum() + sizes[:rest].sum())
