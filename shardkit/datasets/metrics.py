"""Prometheus metrics of the streams on this node: the counters of ``StreamingDataset.stats()``,
per rank and DataLoader worker, served over HTTP for Prometheus to scrape.

Opt-in: ``StreamingDataset(..., metrics_port=9400)`` (or the ``SHARDKIT_METRICS_PORT``
variable) marks the stream for export and serves every marked stream of the node on that port
from the first process that gets it: on a node of several ranks one of them serves, and the
others' streams are in its answer. :func:`serve` starts a server by hand (in a launcher, say),
and :class:`ShardkitCollector` can join a registry the training script already serves.

The numbers come from one place: the snapshots every reading process (a rank's main process
or its DataLoader workers) saves in its rank's control directory
(:mod:`shardkit.datasets.stats`), which ``stats()`` sums too. A scrape therefore shows what a
``stats()`` call at the same moment would, split by ``rank`` and ``worker``; summed over the
workers of a rank, the series are that rank's ``stats()``. Workers save about once a second
and at the end of each epoch.

Series (counters are ``*_total``; labels ``dataset``, ``rank``, ``worker``):

- ``shardkit_samples_total``: samples yielded to the training loop;
- ``shardkit_served_bytes_total``: the bytes of those samples' fields;
- ``shardkit_fetched_bytes_total``: bytes read from storage (cache downloads, and reads around
  or without the cache);
- ``shardkit_cache_hits_total``, ``shardkit_cache_misses_total``, ``shardkit_cache_evictions_total``,
  ``shardkit_cache_prefetched_total``, ``shardkit_cache_prefetch_skipped_total``,
  ``shardkit_cache_landed_total``, ``shardkit_cache_streamed_total``,
  ``shardkit_cache_corrupt_refetches_total``;
- ``shardkit_direct_reads_total``: segments read without a cache;
- ``shardkit_uncached_fallbacks_total``: shards read around a cache that had no room;
- ``shardkit_wait_seconds_total``: time blocked on data; ``shardkit_cache_wait_seconds_total``:
  time the cache waited for another process's download or for room;
- ``shardkit_storage_retries_total`` (label ``kind``: ``reset``, ``short``, ``timeout``,
  ``connect``, ``throttle``, ``server``, ``other``): storage calls retried;
- gauges ``shardkit_cache_disk_bytes`` and ``shardkit_cache_limit_bytes`` (label ``cache_dir``):
  the disk the node cache's files take now (allocated blocks, as ``du`` counts them), and its bound.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import tempfile
import threading
from typing import TYPE_CHECKING, Any, Iterator

from shardkit.config import int_arg
from shardkit.datasets.stats import snapshots
from shardkit.errors import ConfigError
from shardkit.storage.retry_counts import RETRY_KINDS
from shardkit.util.procs import pid_alive

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["ENV_ADDR", "ENV_PORT", "METRICS", "MARKER", "ShardkitCollector", "cache_disk_bytes", "enable",
           "marked_streams", "port_from_env", "serve", "stop", "stream_metrics"]

log = logging.getLogger(__name__)

ENV_PORT = "SHARDKIT_METRICS_PORT"
ENV_ADDR = "SHARDKIT_METRICS_ADDR"
#: The file in a stream's control directory that marks it for export.
MARKER = "metrics.json"

#: Counter of ``stats()`` -> (metric family, help). Storage retries are one family by kind.
METRICS: dict[str, tuple[str, str]] = {
    "samples": ("shardkit_samples", "Samples yielded to the training loop"),
    "bytes_served": ("shardkit_served_bytes", "Bytes of the fields of the samples yielded to the training loop"),
    "bytes_fetched": ("shardkit_fetched_bytes", "Bytes read from storage (cache downloads, reads around or without the cache)"),
    "hits": ("shardkit_cache_hits", "Foreground cache opens that found the shard cached"),
    "misses": ("shardkit_cache_misses", "Foreground cache opens that downloaded the shard"),
    "evictions": ("shardkit_cache_evictions", "Shards evicted from the node cache by this process"),
    "prefetched": ("shardkit_cache_prefetched", "Shards downloaded into the cache ahead of need"),
    "prefetch_skipped": ("shardkit_cache_prefetch_skipped", "Prefetches skipped (no room, or being fetched elsewhere)"),
    "landed": ("shardkit_cache_landed", "Cache downloads through a landing buffer"),
    "streamed": ("shardkit_cache_streamed", "Cache opens that read a shard while it landed"),
    "corrupt_refetches": ("shardkit_cache_corrupt_refetches", "Cached shards that failed their checksum and were fetched again"),
    "direct_reads": ("shardkit_direct_reads", "Segments read from storage without a cache"),
    "uncached_reads": ("shardkit_uncached_fallbacks", "Shards read around a cache that had no room (cache_limit too small)"),
    "wait_seconds": ("shardkit_wait_seconds", "Seconds the reader was blocked on data"),
    "cache_wait_seconds": ("shardkit_cache_wait_seconds", "Seconds the cache waited for another process's download or for room"),
}
_RETRIES = ("shardkit_storage_retries", "Storage calls retried, by kind of fault")
_LABELS = ["dataset", "rank", "worker"]

_mu = threading.Lock()
_servers: dict[int, tuple[Any, threading.Thread]] = {}


def port_from_env() -> int | None:
    """The port ``SHARDKIT_METRICS_PORT`` names, if it is set.

    Returns:
        The port, or None when the variable is unset or empty.

    Raises:
        ConfigError: it is not a port number.
    """
    raw = os.environ.get(ENV_PORT, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{ENV_PORT}={raw!r} is not a port number (1-65535)") from None
    return int_arg(ENV_PORT, value, 1, 65535)


def stream_metrics(port: int | None, control_dir: str, *, url: str, cache_dir: str | None,
                   cache_limit: int) -> int | None:
    """A stream's ``metrics_port`` option: export it (see :func:`enable`) when asked to.

    Args:
        port: the option (None: ``SHARDKIT_METRICS_PORT``, if set).
        control_dir: the stream's control directory.
        url: the dataset's URL.
        cache_dir: the node cache, if any.
        cache_limit: the cache's bound in bytes.

    Returns:
        The port asked for, or None when metrics are off.

    Raises:
        ConfigError: a bad port, or prometheus_client is not installed.
    """
    port = port_from_env() if port is None else int_arg("metrics_port", port, 1, 65535)
    if port is not None:
        _prometheus()
        enable(control_dir, port, url=url, cache_dir=cache_dir, cache_limit=cache_limit)
    return port


def _prometheus() -> Any:
    """The prometheus_client module, or ConfigError saying how to install it."""
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("metrics_port / SHARDKIT_METRICS_PORT need prometheus_client: "
                          "pip install 'shardkit[metrics]'") from None
    return prometheus_client


def _dataset_name(url: str) -> str:
    """The dataset's label: the last component of its URL's path (no query, no credentials)."""
    path = url.split("?", 1)[0].split("#", 1)[0].rstrip("/")
    return path.rsplit("/", 1)[-1] or path


def enable(control_dir: str, port: int, *, url: str, cache_dir: str | None, cache_limit: int) -> int | None:
    """Mark a stream for export, and serve the node's marked streams on ``port`` unless a
    process on this node does already.

    Args:
        control_dir: the stream's control directory (its processes' snapshots).
        port: the port to serve on.
        url: the dataset's URL (its last path component is the ``dataset`` label).
        cache_dir: the node cache, if any.
        cache_limit: the cache's bound in bytes.

    Returns:
        The port this process now serves on, or None when the port was taken (by another
        process of this node, which serves this stream too).
    """
    meta = {"dataset": _dataset_name(url), "owner": os.getpid(), "cache_dir": cache_dir, "cache_limit": cache_limit}
    with open(os.path.join(control_dir, MARKER), "w") as f:
        json.dump(meta, f)
    try:
        return serve(port)
    except ConfigError as exc:
        log.info("%s: another process on this node serves the metrics (this stream's among them) if it is "
                 "a shardkit stream's", exc)
        return None


def marked_streams(temp_dir: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """The streams of this node marked for export, whose process is alive.

    Args:
        temp_dir: where control directories are made (default: the temp directory).

    Yields:
        ``(control directory, its marker)`` per stream.
    """
    root = temp_dir or tempfile.gettempdir()
    for path in sorted(glob.glob(os.path.join(root, "shardkit-stream-*", MARKER))):
        try:
            with open(path) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("owner"), int) and pid_alive(meta["owner"]):
            yield os.path.dirname(path), meta


def cache_disk_bytes(cache_dir: str) -> int:
    """Disk the files under ``cache_dir`` take now: their allocated blocks, as ``du`` counts them.

    Args:
        cache_dir: the node cache's directory.

    Returns:
        Bytes (0 when the directory is gone).
    """
    total = 0
    for root, _dirs, files in os.walk(cache_dir):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue  # evicted while we looked
    return total


class ShardkitCollector:
    """Collects the counters of every marked stream on this node at each scrape.

    Add it to a registry the training script serves already
    (``prometheus_client.REGISTRY.register(ShardkitCollector())``) instead of :func:`serve`.

    Args:
        temp_dir: where the streams' control directories are (default: the temp directory).
    """

    def __init__(self, temp_dir: str | None = None) -> None:
        self.temp_dir = temp_dir

    def collect(self) -> Iterator[Metric]:
        """The series of this moment (see the module's docstring).

        Yields:
            One metric family per counter, the retries by kind, and the cache gauges.
        """
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sums: dict[tuple[str, str, str], dict[str, float]] = {}
        caches: dict[str, int] = {}
        for directory, meta in marked_streams(self.temp_dir):
            if meta.get("cache_dir"):
                caches[str(meta["cache_dir"])] = int(meta.get("cache_limit") or 0)
            for rank, worker, _pid, data in snapshots(directory):
                acc = sums.setdefault((str(meta.get("dataset", "")), str(rank), str(worker)), {})
                for k, v in data.items():
                    if isinstance(v, (int, float)):
                        acc[k] = acc.get(k, 0.0) + v
        for key, (name, doc) in METRICS.items():
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            for labels, acc in sorted(sums.items()):
                family.add_metric(list(labels), acc.get(key, 0.0))
            yield family
        retries = CounterMetricFamily(*_RETRIES, labels=_LABELS + ["kind"])
        for labels, acc in sorted(sums.items()):
            for kind in RETRY_KINDS:
                retries.add_metric([*labels, kind], acc.get(f"retries_{kind}", 0.0))
        yield retries
        disk = GaugeMetricFamily("shardkit_cache_disk_bytes", "Disk the node cache's files take now (du)",
                                 labels=["cache_dir"])
        limit = GaugeMetricFamily("shardkit_cache_limit_bytes", "The node cache's bound (cache_limit)",
                                  labels=["cache_dir"])
        for cache_dir, bound in sorted(caches.items()):
            disk.add_metric([cache_dir], cache_disk_bytes(cache_dir))
            limit.add_metric([cache_dir], bound)
        yield disk
        yield limit


def serve(port: int, addr: str | None = None, temp_dir: str | None = None) -> int:
    """Serve the node's marked streams at ``http://<addr>:<port>/metrics`` from a daemon thread.

    Args:
        port: the port (0: any free one).
        addr: the address to listen on (default ``SHARDKIT_METRICS_ADDR``, else ``0.0.0.0``,
            where Prometheus on another host can reach it).
        temp_dir: where the streams' control directories are (default: the temp directory).

    Returns:
        The port served (the one chosen, for 0). A port this process serves already is
        served once.

    Raises:
        ConfigError: a bad port, or one that cannot be listened on (in use, say).
    """
    port = int_arg("metrics port", port, 0, 65535)
    prometheus = _prometheus()
    with _mu:
        if port and port in _servers:
            return port
        registry = prometheus.CollectorRegistry(auto_describe=False)
        registry.register(ShardkitCollector(temp_dir))
        where = addr or os.environ.get(ENV_ADDR) or "0.0.0.0"
        try:
            server, thread = prometheus.start_http_server(port, where, registry=registry)
        except OSError as exc:
            raise ConfigError(f"metrics port {port} on {where}: cannot listen ({exc.strerror or exc}); "
                              f"choose another port ({ENV_PORT})") from None
        bound = int(server.server_port)
        _servers[bound] = (server, thread)
    return bound


def stop(port: int) -> None:
    """Stop serving on ``port`` (nothing happens if this process does not serve it).

    Args:
        port: a port :func:`serve` returned.
    """
    with _mu:
        held = _servers.pop(port, None)
    if held is not None:
        server, thread = held
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
