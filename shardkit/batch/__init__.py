"""Samples into batches: collate, raw batches assembled from shard bytes, the ring and buffer pool
that hand them over, and field decoders.
"""
