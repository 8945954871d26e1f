"""The node's shard cache on local disk: cached files and their locks, landing buffers for cold
fills, maps kept between epochs.
"""
