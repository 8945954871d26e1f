"""Samples into batches, without torch: collate, raw batches copied once from shard bytes
(raw, copying), zero-copy batches (map_warmer), the batch builders one reader runs (builders,
lookahead), the ring and buffer pool that hand batches over, and field decoders (codecs).
"""

__all__: list[str] = []
