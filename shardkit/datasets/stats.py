"""A stream's statistics: every reading process saves snapshots of its counters in the rank's
control directory, and ``StreamingDataset.stats()`` sums them.

DataLoader workers are separate processes that may be gone by the time the training loop asks,
so each writes its own counters to a file (about once a second while it reads, and at the end
of each epoch); the sum over the files is the rank's. The Prometheus exporter
(:mod:`shardkit.datasets.metrics`) reads the same files, so its series add up to ``stats()``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import time
from typing import Any, Iterator

from shardkit.cache.files import write_replace
from shardkit.read.shard_source import ShardSource
from shardkit.read.topology import Topology
from shardkit.storage.retry_counts import RETRY_KINDS, retry_counts

__all__ = ["COUNTS", "RETRY_COUNTS", "SNAPSHOT_EVERY", "StreamStats", "snapshots", "summed_stats"]

SNAPSHOT_EVERY = 1.0  # seconds between snapshots while iterating
#: Storage retries by kind (:mod:`shardkit.storage.retry_counts`), as counters of the stream.
RETRY_COUNTS = tuple(f"retries_{kind}" for kind in RETRY_KINDS)
#: The counters reported as integers; ``wait_seconds`` and ``cache_wait_seconds`` are seconds.
COUNTS = ("bytes_fetched", "bytes_served", "hits", "misses", "prefetched", "prefetch_skipped", "landed", "streamed",
          "evictions", "corrupt_refetches", "direct_reads", "uncached_reads", "samples", "retries") + RETRY_COUNTS

_SNAPSHOT = re.compile(r"stats-r(\d+)w(\d+)p(\d+)\.json$")


class StreamStats:
    """This process's counters of one stream, saved as snapshots into ``directory``.

    Counters of the epochs this process has finished are kept (``acc``) and the source of the
    epoch in progress is added to them at each snapshot. Picklable: a DataLoader worker gets a
    copy, and starts from zero (see :meth:`begin`).

    Args:
        directory: the rank's control directory, shared by its processes.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.acc: dict[str, float] = {}
        self.pid = os.getpid()
        self.samples = 0  # samples yielded since the last final snapshot
        self.served = 0  # the bytes of their fields
        self.next_at = 0.0
        self.retries_at: dict[str, int] = {}  # this process's retry counts when the epoch began

    def begin(self) -> None:
        """Start counting an epoch: a fresh worker process drops the counters it inherited."""
        if self.pid != os.getpid():
            self.acc, self.pid = {}, os.getpid()
        self.retries_at = retry_counts()
        self.next_at = time.monotonic() + SNAPSHOT_EVERY

    def count(self, samples: int, nbytes: int = 0) -> bool:
        """Count ``samples`` more yielded.

        Args:
            samples: samples just yielded.
            nbytes: the bytes of their fields.

        Returns:
            Whether a snapshot is due (the next one is then a second away).
        """
        self.samples += samples
        self.served += nbytes
        if time.monotonic() < self.next_at:
            return False
        self.next_at = time.monotonic() + SNAPSHOT_EVERY
        return True

    def _retries(self) -> dict[str, float]:
        """Storage retries of this process since the epoch began, by kind and in all."""
        now = retry_counts()
        out = {f"retries_{k}": float(now[k] - self.retries_at.get(k, 0)) for k in RETRY_KINDS}
        out["retries"] = sum(out.values())
        return out

    def save(self, source: ShardSource, topo: Topology, final: bool) -> None:
        """Write this process's counters so far (best effort: an OSError is ignored).

        Args:
            source: the shard source of the epoch in progress.
            topo: this process's place (rank and worker name its file).
            final: the epoch has ended: its counters join the kept ones.
        """
        now = source.stats()
        now["samples"] = float(self.samples)
        now["bytes_served"] = float(self.served)
        now.update(self._retries())
        total = {k: self.acc.get(k, 0.0) + v for k, v in now.items()}
        for k, v in self.acc.items():
            total.setdefault(k, v)
        if final:
            self.acc, self.samples, self.served = total, 0, 0
            self.retries_at = retry_counts()
        name = f"stats-r{topo.rank}w{topo.worker}p{os.getpid()}.json"
        path = os.path.join(self.directory, name)
        try:
            write_replace(path, json.dumps(total).encode())
        except OSError:
            pass  # statistics are best effort; never fail a training step over them
        except NameError:
            # An iterator left unfinished is closed at interpreter exit, after builtins such
            # as open are gone: Python would print this as "Exception ignored" in every log.
            if not final:
                raise


def snapshots(directory: str) -> Iterator[tuple[int, int, int, dict[str, float]]]:
    """The latest snapshot of every process that read for the rank of ``directory``.

    Args:
        directory: the rank's control directory.

    Yields:
        ``(rank, worker, pid, counters)`` per snapshot file readable now.
    """
    for path in sorted(glob.glob(os.path.join(directory, "stats-*.json"))):
        match = _SNAPSHOT.search(os.path.basename(path))
        if match is None:
            continue
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            yield int(match[1]), int(match[2]), int(match[3]), data


def summed_stats(directory: str) -> dict[str, Any]:
    """The counters of every process's latest snapshot in ``directory``, summed.

    Args:
        directory: the rank's control directory.

    Returns:
        Each counter summed (those of :data:`COUNTS` as ints, present even when zero),
        ``wait_seconds`` and ``cache_wait_seconds`` (floats), and ``wait_seconds_per_worker``
        (each snapshot's ``wait_seconds`` by ``r<rank>w<worker>p<pid>``).
    """
    total: dict[str, Any] = {}
    per_worker: dict[str, float] = {}
    for rank, worker, pid, data in snapshots(directory):
        for k, v in data.items():
            total[k] = total.get(k, 0) + v
        per_worker[f"r{rank}w{worker}p{pid}"] = data.get("wait_seconds", 0.0)
    for k in COUNTS:
        total[k] = int(total.get(k, 0))
    total.setdefault("wait_seconds", 0.0)
    total.setdefault("cache_wait_seconds", 0.0)
    total["wait_seconds_per_worker"] = per_worker
    return total
