"""shardkit: sharded WebDataset storage on object storage, packed with Ray, streamed into DDP.

Public API::

    shardkit.pack(source, "s3://bucket/ds", shard_bytes="512MB", engine="local" | "ray")
    ds = shardkit.open_dataset("s3://bucket/ds")
    stream = shardkit.StreamingDataset("s3://bucket/ds", cache_dir="/nvme/shardkit", shuffle=True)
    mix = shardkit.StreamingDataset([shardkit.Stream("s3://b/web", weight=0.7), shardkit.Stream("s3://b/cur", weight=0.3)])
    loader = shardkit.StreamingDataLoader(stream, num_workers=8)      # exact resume
    ra = shardkit.ShardDataset("s3://bucket/ds")                      # random access
    tokens = shardkit.TokenStream("s3://bucket/tokens", block_size=2048)  # LLM pre-training windows
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it. Imported on first use so `import shardkit` stays cheap
# (no torch, no pyarrow) until something is used.
_LAZY = {
    "pack": ".packing.pack",
    "open_dataset": ".read.dataset",
    "Dataset": ".read.dataset",
    "StreamingDataset": ".datasets.streaming",
    "StreamingDataLoader": ".datasets.loader",
    "ShardDataset": ".datasets.random_access",
    "wds_shards": ".datasets.wds",
    "ShardWriter": ".packing.writer",
    "CenterCrop": ".batch.codecs",
    "index_tars": ".packing.index",
    "annotate": ".packing.annotate",
    "unpack": ".batch.collate",
    "collate": ".batch.collate",
    "Stream": ".read.stream",
    "Parts": ".packing.sources.parts",
    "TokenStream": ".datasets.token_stream",
}

__all__ = [*_LAZY, "errors", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("errors", "ray"):  # shardkit.ray imports Ray only when its Datasink is used
        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
