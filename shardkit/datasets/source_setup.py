"""How a stream's reader opens its shard source: prefetch depth, the pins one process may hold in
the node cache, read threads, and the warning when the cache is too small for the node's readers.

Every reading process on a node (ranks x DataLoader workers) pins the shards it holds open, and
pins count against ``cache_limit``; the budget here keeps pins alone from ever filling the cache.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from shardkit.cache.shard_cache import ShardCache
from shardkit.config import human_bytes, keep_maps_budget, room_wait
from shardkit.read.dataset import Dataset
from shardkit.read.cache_refs import cache_namespace
from shardkit.read.shard_source import ShardSource
from shardkit.read.topology import Topology

__all__ = ["default_prefetch", "fill_threads", "open_source", "pin_budget", "readers_per_node"]

log = logging.getLogger(__name__)
_warned_small_cache = False  # the small-cache warning is given once per process


def readers_per_node(topo: Topology, loader_workers: int) -> int:
    """Reading processes on this node.

    Args:
        topo: this process's place.
        loader_workers: the DataLoader's ``num_workers`` when known (0: unknown).

    Returns:
        Local ranks (``LOCAL_WORLD_SIZE``, else the world size) x workers per rank.
    """
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    local_world = int(raw) if raw.isdigit() and int(raw) > 0 else topo.world_size
    return local_world * (loader_workers or topo.num_workers)


def default_prefetch(prefetch: int | None, topo: Topology, cached: bool) -> int:
    """Shards (or, without a cache, segments) to fetch ahead of need.

    By default 4 where one process reads all of its shards from a cache (``num_workers=0``),
    else 2 per reader. Such a process also downloads its prefetched shards at once
    (``ShardSource.at_once``): one at a time left the GETs idle while each shard's last part,
    hash and rename finished, and four at a time beat two on cold epochs. DataLoader workers
    keep one download each: two workers already download two shards at once, and a second
    thread each was slower (see benchmarks/RESULTS.md).

    Args:
        prefetch: the stream's ``prefetch`` option (``None``: the default).
        topo: this process's place.
        cached: the stream reads through a node cache.

    Returns:
        The prefetch depth.
    """
    if prefetch is not None:
        return prefetch
    return 4 if topo.num_workers == 1 and cached else 2


def pin_budget(ds: Dataset, cache_limit: int, readers: int) -> int:
    """Shards one process may keep open in the cache.

    Every reading process on the node pins what it holds; with a small cache_limit a process
    holds one shard at a time, so that pins alone can never fill the cache.

    Args:
        ds: the dataset read.
        cache_limit: the cache's bound in bytes.
        readers: reading processes on the node (:func:`readers_per_node`).

    Returns:
        The budget (below 1: the cache has no room for every reader to keep a shard).
    """
    biggest = max((i.bytes for i in ds.shard_list), default=1) or 1
    return int(cache_limit // (biggest * readers) - 1)


def fill_threads(read_threads: int, source: ShardSource, budget: int) -> int:
    """Threads to fill raw batches with (0: fill each batch when asked for it).

    Args:
        read_threads: the stream's ``read_threads`` (callers pass 0 where threads do not
            apply: decoded batches, single samples, DataLoader workers).
        source: the reader's source (threads need its cache).
        budget: the process's :func:`pin_budget`.

    Returns:
        ``read_threads``, or 0 without a cache or without room to pin the batches in flight.
    """
    if not (read_threads and source.cache):
        return 0
    # Batches in flight keep their shards pinned: with less room than that (plus one
    # download) a fill could wait for space that only the waiting loop would free.
    in_flight = 2 * read_threads
    return read_threads if budget >= source.max_open + in_flight + 1 else 0


def open_source(ds: Dataset, topo: Topology, *, cache_dir: str | None, cache_limit: int, prefetch: int,
                verify: bool, shuffle: bool, shuffle_block: int, readers: int, zero_copy: bool, landing: bool,
                say_once: Callable[[str], bool]) -> ShardSource:
    """The shard source one reader reads its share through.

    Args:
        ds: the dataset read.
        topo: this process's place.
        cache_dir: the node cache (``None``: ranged reads of segments, held in memory).
        cache_limit: the cache's bound in bytes.
        prefetch: the prefetch depth (:func:`default_prefetch`).
        verify: check shards against their manifest checksums.
        shuffle: the stream shuffles (a reader then holds a shuffle block's shards at once).
        shuffle_block: shards per shuffle block.
        readers: reading processes on the node (:func:`readers_per_node`).
        zero_copy: batches are views of the cached files (their maps may be kept).
        landing: raw batches are built from the fetched bytes (landing fills may serve them).
        say_once: True for the first reader of the rank to ask about a warning.

    Returns:
        The open source (close it when done).
    """
    window = shuffle_block + prefetch if shuffle else 2
    if cache_dir is None:
        source = ShardSource(ds, None, prefetch, max_open=window)
        source.verify = verify
        source.ahead_segments = window if shuffle else prefetch
    else:
        # room_wait: a reader never waits long for room other readers' pins hold (they may be
        # waiting for it, in a collective): it reads that shard around the cache instead.
        cache = ShardCache(cache_dir, cache_limit, namespace=cache_namespace(ds), verify=verify,
                           room_wait=room_wait())
        budget = pin_budget(ds, cache_limit, readers)
        fits = sum(i.bytes for i in ds.shard_list) <= cache_limit  # then nothing is fetched twice
        if not fits and not _warned_small_cache:
            _warn_if_cache_too_small(ds, cache_limit, readers, shuffle, shuffle_block, say_once)
        source = ShardSource(ds, cache, prefetch, max_open=max(1, min(window, budget)))
    # Kept maps pay off only if the files stay: a dataset bigger than the cache would
    # cycle through them, each kept map holding an evicted file's disk space.
    source.keep_maps = zero_copy and (sum(i.bytes for i in ds.shard_list) <= min(cache_limit, keep_maps_budget()))
    # Landing fills (see cache.landing) only where this process is the one reader of its shards:
    # DataLoader workers take turns in every shard, and a shard one worker landed would be
    # read back from disk by the others, where a fill through the page cache serves them all.
    source.landing = landing and not zero_copy and topo.num_workers == 1
    source.at_once = source.prefetch if topo.num_workers == 1 else 1
    # A cold shard's samples are read as they land (cache.streamed). Zero-copy batches too: a
    # view is made only of samples waited for, whose bytes in the landing file never change
    # again (a failed attempt's file is replaced by a new inode, never rewritten), and the map
    # of that file stays valid once it is published, or unlinked, while views of it live.
    source.stream = cache_dir is not None
    return source


def _warn_if_cache_too_small(ds: Dataset, cache_limit: int, readers: int, shuffle: bool, shuffle_block: int,
                             say_once: Callable[[str], bool]) -> None:
    """Say (once per rank) if readers will evict shards they still need: it works, within the
    limit, but shards come back, a cold epoch's traffic several times over.

    What they need at once: in order, a lone reader its shard; readers taking turns in a shard
    one each, and one more for the download that moves on (with less, two workers fetched
    shards more than once). Shuffled, each reader reads from a shuffle block's shards at once."""
    global _warned_small_cache
    biggest = max((i.bytes for i in ds.shard_list), default=0)
    if shuffle:
        need = (readers * shuffle_block + 1) * biggest
        what = f"shuffled, a shuffle block ({shuffle_block} shards) each, and a download"
    else:
        need = (readers + 1 if readers > 1 else 1) * biggest
        what = "in order, a shard each, and a download" if readers > 1 else "in order, one shard"
    if cache_limit >= need:
        return
    _warned_small_cache = True
    if not say_once("small-cache"):
        return
    log.warning("cache_limit %s is less than the %s that %d reading process(es) on this node (ranks x "
                "DataLoader workers) read from at once (%s, shards of up to %s): shards may be fetched "
                "several times per epoch; raise cache_limit to %s or more%s", human_bytes(cache_limit),
                human_bytes(need), readers, what, human_bytes(biggest), human_bytes(need),
                " (or lower shuffle_block)" if shuffle else "")
