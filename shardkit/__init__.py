"""shardkit: sharded WebDataset storage on object storage, packed with Ray, streamed into DDP.

Public API::

    shardkit.pack(source, "s3://bucket/ds", shard_bytes="512MB", engine="local" | "ray")
    ds = shardkit.open_dataset("s3://bucket/ds")
    stream = shardkit.StreamingDataset("s3://bucket/ds", cache_dir="/nvme/shardkit", shuffle=True)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "pack", "open_dataset", "Dataset", "StreamingDataset", "ShardDataset", "StreamingDataLoader", "wds_shards", "ShardWriter", "CenterCrop",
    "errors", "__version__",
]


def __getattr__(name: str) -> Any:
    # Lazy: `import shardkit` stays cheap (no torch, no pyarrow) until something is used.
    if name == "pack":
        from .packer import pack
        return pack
    if name in ("open_dataset", "Dataset"):
        from . import reader
        return getattr(reader, name)
    if name == "StreamingDataset":
        from .dataset import StreamingDataset
        return StreamingDataset
    if name == "StreamingDataLoader":
        from .loader import StreamingDataLoader
        return StreamingDataLoader
    if name == "wds_shards":
        from .wds_stage import wds_shards
        return wds_shards
    if name == "ShardDataset":
        from .random_access import ShardDataset
        return ShardDataset
    if name == "ShardWriter":
        from .writer import ShardWriter
        return ShardWriter
    if name == "CenterCrop":
        from .codecs import CenterCrop
        return CenterCrop
    if name == "errors":
        from . import errors
        return errors
    raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
