"""Soak: many epochs over a small dataset on SeaweedFS through a tiny node cache, read by 2
ranks x 2 persistent DataLoader workers (4 reading processes) sharing the cache directory.

While they read, the test samples the cache directory's disk use (as ``du`` does) every few
milliseconds. It checks: every epoch reads every sample exactly once over the ranks; the
cache never holds more than ``cache_limit`` on disk; each process's RSS, threads and open fds
stay flat over the epochs; nothing is left behind (processes, shared memory, temp dirs).
The readers reach SeaweedFS through a :class:`~faultproxy.FaultProxy` that resets, cuts,
flips and fails a few percent of their GETs at random, all along: every sample must still
arrive once per epoch with its exact bytes, and each kind of fault must have been injected.
Bounded: the readers are killed (and the test fails) after ``DEADLINE`` seconds. Run it with
``-s`` to see its figures (docs/metrics.md quotes them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

import shardkit
from cachewalk import cache_files, limited
from faultproxy import FaultProxy, Rule

REPO = Path(__file__).resolve().parents[2]
READER = Path(__file__).resolve().parent / "soak_reader.py"
N = 400
EPOCHS = 30
DEADLINE = 150.0
# RSS growth allowed between the early epochs (after warm-up) and the last ones, per process.
RSS_SLACK_KB = 12 * 1024
# The share of the readers' GETs (manifest and shard reads alike) each kind of fault hits. A
# flip is rarer: the cache refuses a shard whose download fails its checksum twice in a row
# (IntegrityError, by design: loud, never silent), which 2% flips made likely over 30 epochs.
SOAK_FAULTS = {"reset_mid": 0.015, "truncate": 0.015, "error500": 0.015, "flip": 0.005}


def _disk(cache_dir: Path) -> tuple[int, int, int, list[tuple[str, int]], list[int]]:
    """At one moment (:func:`cache_files`) under ``cache_dir``: (bytes of the files' sizes, bytes
    of their allocated blocks, how many files have blocks, the files of non-zero size), which
    ``cache_limit`` bounds (but for lock files' owner notes, a pid each); and the sizes of the progress files of downloads in flight
    (``.locks/<file>.landed``, counted in the first figures too)."""
    stats = cache_files(cache_dir)
    size = sum(st.st_size for _, st in limited(stats))
    blocks = sum(st.st_blocks * 512 for _, st in stats)
    allocated = sum(st.st_blocks > 0 for _, st in stats)
    progress = [st.st_size for rel, st in stats if rel.endswith(".landed")]
    return size, blocks, allocated, [(rel, st.st_size) for rel, st in stats if st.st_size], progress


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _flat(series: list[int], warm: int = 2) -> tuple[int, int]:
    """(level after warm-up, level at the end): the max of epochs warm..warm+4 and of the last 5."""
    return max(series[warm:warm + 5]), max(series[-5:])


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(DEADLINE + 60)
def test_soak_tiny_cache_many_epochs_through_faults(s3_env: Any, s3_bucket: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    data = [{"__key__": f"q{i:05d}", "bin": rng.bytes(int(rng.integers(500, 3500)))} for i in range(N)]
    url = f"{s3_bucket}/soak"
    shardkit.pack(iter(data), url, shard_bytes="24KB", progress=False)
    ds = shardkit.open_dataset(url)
    biggest = max(s.bytes for s in ds.shard_list)
    limit = 6 * biggest  # a fraction of the dataset: every epoch evicts and downloads again
    total = sum(s.bytes for s in ds.shard_list)
    cache = tmp_path / "cache"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    shm_before = _shm()
    peak: dict[str, Any] = {"size": 0, "blocks": 0, "rounded": 0, "samples": 0, "files": [], "progress": []}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            size, blocks, allocated, files, progress = _disk(cache)
            if size > peak["size"]:
                peak["size"], peak["files"] = size, files
            if sum(progress) > sum(peak["progress"]):
                peak["progress"] = progress
            peak["blocks"] = max(peak["blocks"], blocks)
            # Allocated blocks less what rounding each file up to whole 4 KiB blocks can add.
            peak["rounded"] = max(peak["rounded"], blocks - 4096 * allocated)
            peak["samples"] += 1
            stop.wait(0.01)

    proxy = FaultProxy(s3_env.endpoint, [Rule(f, methods=("GET",), prob=p) for f, p in SOAK_FAULTS.items()],
                       seed=11).start()
    sampler = threading.Thread(target=sample, name="soak-du")
    sampler.start()
    procs, outs = [], []
    started = time.monotonic()
    try:
        for rank in range(2):
            out = tmp_path / f"soak-{rank}.jsonl"
            cfg = {"url": url, "cache_dir": str(cache), "cache_limit": limit, "rank": rank, "epochs": EPOCHS,
                   "out": str(out)}
            env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp), "SHARDKIT_ROOM_WAIT": "0.5",
                   "AWS_ENDPOINT_URL": proxy.endpoint}
            procs.append(subprocess.Popen([sys.executable, str(READER), json.dumps(cfg)], env=env))
            outs.append(out)
        for p in procs:
            assert p.wait(timeout=max(1.0, DEADLINE - (time.monotonic() - started))) == 0
    finally:
        stop.set()
        sampler.join()
        proxy.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = time.monotonic() - started
    lines = [[json.loads(line) for line in o.read_text().splitlines()] for o in outs]
    epochs = [[r for r in rank if "epoch" in r] for rank in lines]
    stats = [rank[-1]["stats"] for rank in lines]
    assert [len(e) for e in epochs] == [EPOCHS, EPOCHS]
    keys = Counter(d["__key__"] for d in data)
    want = {d["__key__"]: xxhash.xxh3_64_hexdigest(d["bin"]) for d in data}
    for e in range(EPOCHS):
        assert Counter(k for rank in epochs for k in rank[e]["keys"]) == keys, f"epoch {e}"
        for rank in epochs:
            bad = [k for k, h in zip(rank[e]["keys"], rank[e]["digests"]) if want[k] != h]
            assert not bad, f"epoch {e}: wrong bytes for {bad[:3]}"
    faults = proxy.stats()
    assert all(faults[f] > 0 for f in SOAK_FAULTS), faults

    print(f"\nsoak: {N} samples, {len(ds.shard_list)} shards, {total} bytes; cache_limit {limit} bytes "
          f"({limit / total:.0%} of the dataset); 2 ranks x 2 workers; {EPOCHS} epochs in {elapsed:.0f} s")
    print(f"  through the fault proxy: {faults['requests']} requests, faults injected "
          f"{ {f: faults[f] for f in SOAK_FAULTS} }")
    print(f"  cache on disk, sampled {peak['samples']} times under the cache's lock: peak {peak['size']} bytes of "
          f"files in {len(peak['files'])} files ({peak['blocks']} allocated, as du counts), limit {limit}; "
          f"progress files of downloads in flight at most {sum(peak['progress'])} bytes")
    for rank, rows in enumerate(epochs):
        rss = [r["rss_kb"] for r in rows]
        wrss = [sum(r["worker_rss_kb"]) for r in rows]
        print(f"  rank {rank}: main RSS MiB by epoch {[round(x / 1024, 1) for x in rss[::3]]} (every 3rd); "
              f"workers' RSS MiB {[round(x / 1024, 1) for x in wrss[::3]]}; threads {rows[1]['threads']}->"
              f"{rows[-1]['threads']}; fds {rows[1]['fds']}->{rows[-1]['fds']}; "
              f"deleted-but-mapped cache bytes max {max(r['deleted_mapped'] for r in rows)}")
        s = stats[rank]
        print(f"    stats: samples {s['samples']}, misses {s['misses']}, prefetched {s['prefetched']}, "
              f"hits {s['hits']}, evictions {s['evictions']}, uncached_reads {s['uncached_reads']}, "
              f"bytes_fetched {s['bytes_fetched']}, wait_seconds {s['wait_seconds']:.1f}")

    # The bound holds on disk, not only in the cache's count: the files' sizes (what the cache
    # counts) never pass it; their allocated blocks (du: downloads' reserved blocks included)
    # pass it, at any one moment, only by the rounding of each file to whole filesystem blocks
    # (< 4 KiB per file: 4% here with 23 KB shards, nothing with real ones).
    assert peak["samples"] > 10 and peak["size"] <= limit, peak
    assert peak["rounded"] <= limit, peak
    # Progress files, inside the limit (docs/guide/cache.md, "Layout"): a 128-byte header and a
    # byte per sample each while a download is in flight, emptied when it ends.
    most_samples = max(s.num_samples for s in ds.shard_list)
    assert all(n <= 128 + most_samples for n in peak["progress"]), peak["progress"]
    left = _disk(cache)[4]
    assert not any(left), left
    for rank, rows in enumerate(epochs):
        for what in ("rss_kb", "threads", "fds"):
            early, late = _flat([r[what] for r in rows])
            slack = RSS_SLACK_KB if what == "rss_kb" else 0
            assert late <= early + slack, f"rank {rank} {what}: {early} after warm-up, {late} at the end"
        early, late = _flat([sum(r["worker_rss_kb"]) for r in rows])
        assert late <= early + 2 * RSS_SLACK_KB, f"rank {rank} workers' RSS: {early} kB -> {late} kB"
        assert {len(r["children"]) for r in rows} == {2}, "persistent workers: 2 children all along"
        assert stats[rank]["samples"] == EPOCHS * N // 2
    # Nothing left behind: temp dirs (the control dirs; the manifest copies are kept by design,
    # for the next reader of the node), shared memory.
    assert sorted(os.listdir(tmp)) == [f"shardkit-manifests-{os.getuid()}"]
    pids = {str(p.pid) for p in procs} | {str(c) for rows in epochs for r in rows for c in r["children"]}
    leaked = [n for n in _shm() - shm_before if "shardkit" in n or any(pid in n for pid in pids)]
    assert not leaked, leaked
