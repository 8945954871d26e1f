"""The node cache across versions of one pack: a job on an appended version finds the shards of
the versions before already on the node and downloads only the new ones; a re-pack at the same
URL is another pack and downloads everything again. On a real S3 (SeaweedFS)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import shardkit
from shardkit import StreamingDataset
from shardkit.read.cache_refs import cache_namespace
from shardkit.read.manifest_copies import manifest_copies_dir
from textfolders import A, B, text_folder


def read_all(url: str, cache: Path, **kw: Any) -> tuple[list[str], dict[str, Any], StreamingDataset]:
    """Every key of one epoch (in this process) and the rank's cache counters."""
    stream = StreamingDataset(url, cache_dir=cache, prefetch=0, **kw)
    keys = [x["__key__"] for x in stream]
    return keys, stream.stats(), stream


def test_a_job_on_an_appended_version_downloads_only_the_new_shards_and_a_repack_everything(
        s3_env: Any, s3_bucket: str, tmp_path: Path) -> None:
    url = f"{s3_bucket}/ds"
    shardkit.pack(str(text_folder(tmp_path / "a", A, repeat=20)), url, shard_samples=3, progress=False)
    cache = tmp_path / "cache"
    keys, stats, first = read_all(url, cache)
    v1_bytes = sum(first.ds.shards.column("bytes").to_pylist())
    assert sorted(keys) == A and stats["bytes_fetched"] == v1_bytes and stats["misses"] == 4

    shardkit.pack(str(text_folder(tmp_path / "b", B, repeat=20)), url, shard_samples=3, progress=False, append=True)
    keys, stats, second = read_all(url, cache)
    assert second.ds.version == 2 and sorted(keys) == sorted(A + B)
    new = second.ds.shards.column("bytes").to_pylist()[4:]
    # Version 1's four shards came from the node cache; only version 2's two were downloaded.
    # (A shard read while it landed may be opened once more when published: a hit beyond those four.)
    assert (stats["misses"], stats["bytes_fetched"]) == (len(new), sum(new))
    assert 4 <= stats["hits"] <= 4 + stats["streamed"]
    v1, v2 = shardkit.open_dataset(url, version=1), shardkit.open_dataset(url, version=2)
    assert cache_namespace(v1) == cache_namespace(v2) == cache_namespace(first.ds)
    assert v1.identity != v2.identity  # what differs per version (a stored where= result) stays apart
    # The manifest copies are the pack's too: version 1's fragment copies serve version 2.
    copies = manifest_copies_dir(cache_namespace(v2))
    assert copies is not None and first.ds.manifest_cache == second.ds.manifest_cache == copies
    assert [x["__key__"] for x in shardkit.open_dataset(url, version=1).iter_samples()] == A

    # A re-pack at the URL (other bytes under the same shard names): a new namespace, every
    # shard downloaded again, and the new bytes read (never the old pack's cached files).
    shardkit.pack(str(text_folder(tmp_path / "a2", A, body="other", repeat=20)), url, shard_samples=3, progress=False,
                  overwrite=True)
    keys, stats, third = read_all(url, cache, decode=None)
    repacked = third.ds
    assert repacked.version == 1 and cache_namespace(repacked) != cache_namespace(v2)
    assert sorted(keys) == A and stats["misses"] == repacked.num_shards and stats["hits"] <= stats["streamed"]
    assert stats["bytes_fetched"] == sum(repacked.shards.column("bytes").to_pylist())
    assert {x["__key__"]: bytes(x["txt"]).decode()[:5] for x in StreamingDataset(url, cache_dir=cache)} == \
        {k: "other" for k in A}
