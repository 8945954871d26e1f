"""Small helpers with no shardkit dependencies: libc calls, process liveness and the one LRU map."""

__all__: list[str] = []
