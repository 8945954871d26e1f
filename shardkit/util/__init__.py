"""Small helpers with no shardkit dependencies: libc calls and the one LRU map."""
