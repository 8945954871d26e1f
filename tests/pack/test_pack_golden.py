"""Packing output is pinned: a fixed input gives the shard bytes and manifest rows recorded here.

The digests were taken with the writer as it was before its speed work (main at e11b790: one
upload thread, every sample framed piece by piece); the writer must keep producing exactly
these bytes whatever its internals (how parts are filled, hashed, and uploaded side by side).
A change of the format itself must change these digests on purpose.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

import shardkit
from shardkit.packing import tar_shard
from shardkit.packing.sample import PackSample, StreamedField
from shardkit.packing.writer import ShardWriter
from shardkit.storage.store import Store

# sha256 of the shards' bytes and of their manifest rows (see _digest), by the writer before
# its speed work.
WRITER_DIGEST = "837394cc1cdf8c3fee430a768d2d88d80cfbe7e0e3e829f0cf79d81baf4f6dcc"
PACK_DIGEST = "50cb8f193a9c36414c4976557d11c6dba6909fa9873155c00887e12c12212917"


def _body(tag: str, size: int) -> bytes:
    """Deterministic bytes on every platform and Python version."""
    return hashlib.shake_256(tag.encode()).digest(size)


def _chunked(data: bytes, step: int) -> StreamedField:
    return StreamedField(len(data), lambda: (data[i:i + step] for i in range(0, len(data), step)))


def _samples() -> list[PackSample]:
    """Bodies of 0 to ~150 KB (some cross part boundaries), a third field now and then, a
    sample over 1 MiB (block checksums), a streamed one in odd chunks, a key needing a pax
    header."""
    out = []
    for i in range(240):
        fields = {"jpg": _body(f"img{i}", (i * 7919) % 150_000), "cls": str(i % 10).encode()}
        if i % 7 == 0:
            fields["json"] = json.dumps({"i": i}).encode()
        out.append(PackSample(f"s{i:05d}", fields, {"label": i % 10}))
    big = _body("big", 2 * 2**20 + 12_345)
    out.insert(50, PackSample("big-bytes", {"bin": big}, {"label": -1}))
    out.insert(120, PackSample("big-stream", {"npy": _chunked(big[::-1], 300_001), "txt": b"x"}, {"label": -2}))
    out.insert(200, PackSample("k" * 140, {"txt": b"a long key"}, {"label": -3}))
    return out


def _digest(shards: list[tuple[str, bytes]], rows: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for name, data in shards:
        h.update(f"{name}:{len(data)}:{hashlib.sha256(data).hexdigest()}\n".encode())
    h.update(json.dumps(rows, sort_keys=True, default=str).encode())
    return h.hexdigest()


def test_shard_writer_output_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ShardWriter to local disk, with small parts so that many samples straddle two."""
    monkeypatch.setattr(tar_shard, "PART_BYTES", 256 * 2**10)
    store = Store(str(tmp_path / "w"))
    with ShardWriter(store, shard_bytes=3_000_000) as w:
        for s in _samples():
            w.write(s)
    assert len(w.shards) >= 4
    r = w.rows
    rows = [{"key": r.key[i], "shard": r.shard[i], "offset": r.offset[i], "size": r.size[i], "fields": r.fields[i],
             "checksum": r.checksum[i], "blocks": r.blocks[i], "meta": r.meta[i]} for i in range(len(r))]
    shards = [(f"{rec.path}:{rec.num_samples}:{rec.checksum}", store.read_bytes(rec.path)) for rec in w.shards]
    assert _digest(shards, rows) == WRITER_DIGEST


def _folder(root: Path) -> Path:
    """A keyed folder: 160 samples of ~0-200 KB (.bin, .cls, sometimes .json)."""
    for i in range(160):
        (root / f"{i:04d}.bin").parent.mkdir(parents=True, exist_ok=True)
        (root / f"{i:04d}.bin").write_bytes(_body(f"file{i}", (i * 104_729) % 200_000))
        (root / f"{i:04d}.cls").write_bytes(str(i % 5).encode())
        if i % 9 == 0:
            (root / f"{i:04d}.json").write_bytes(json.dumps({"n": i}).encode())
    return root


def _packed(store: Store) -> tuple[list[tuple[str, bytes]], list[dict[str, Any]]]:
    shards = [(p, store.read_bytes(p)) for p in sorted(store.glob("shards/*.tar"))]
    rows = []
    for frag in sorted(store.glob("manifest/samples-*.parquet")):
        rows += pq.read_table(store.path(frag), filesystem=store.fs).to_pylist()
    return shards, sorted(rows, key=lambda row: (row["shard"], row["offset"]))


def test_pack_output_is_unchanged_locally_and_on_s3(tmp_path: Path, s3_server: Any, s3_bucket: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``shardkit.pack`` of a folder (local engine): the digest recorded before, and on S3, whose
    shards go up as multipart uploads of parts side by side, the same bytes."""
    monkeypatch.setattr(tar_shard, "PART_BYTES", 5 * 2**20)  # the S3 minimum: shards of several parts
    src = _folder(tmp_path / "src")
    local = Store(str(tmp_path / "out"))
    shardkit.pack(str(src), local.url, shard_bytes="12MB", progress=False)
    shards, rows = _packed(local)
    assert len(shards) >= 2 and max(len(data) for _, data in shards) > 2 * 5 * 2**20
    assert _digest(shards, rows) == PACK_DIGEST
    opts = s3_server.storage_options()
    shardkit.pack(str(src), f"{s3_bucket}/ds", shard_bytes="12MB", storage_options=opts, progress=False)
    assert _packed(Store(f"{s3_bucket}/ds", opts)) == (shards, rows)
