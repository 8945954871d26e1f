"""The node's shard cache on local disk (:class:`~shardkit.cache.shard_cache.ShardCache`): cached
files and their locks, room and eviction, fills from storage readers, landing buffers for cold
fills, maps kept between epochs.
"""

__all__: list[str] = []
