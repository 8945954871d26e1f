"""Small packed datasets of random bodies, for reader tests (imported by test modules)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import shardkit


def pack_random(root: Path, *, n: int, max_body: int, classes: int, shard_bytes: str, seed: int,
                prefix: str) -> tuple[str, dict[str, bytes]]:
    """Pack ``n`` samples (``bin``: 1..max_body-1 random bytes, ``cls``: an ASCII class of
    ``classes``) under ``root``; return the URL and each key's ``bin`` body."""
    rng = np.random.default_rng(seed)
    data = [{"__key__": f"{prefix}{i:04d}", "bin": rng.bytes(int(rng.integers(1, max_body))),
             "cls": str(i % classes).encode()} for i in range(n)]
    url = str(root / "ds")
    shardkit.pack(iter(data), url, shard_bytes=shard_bytes, progress=False)
    return url, {d["__key__"]: d["bin"] for d in data}
