"""Side-by-side benchmarks: shardkit against its peers on one machine (``python -m benchmarks.run``)."""
