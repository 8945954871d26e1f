"""The Prometheus exporter (shardkit.datasets.metrics): its series are the counters of
``StreamingDataset.stats()``, per rank and worker, in one process and across DDP ranks with
DataLoader workers; the Grafana dashboard in infra/ names only series that exist."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.datasets import metrics
from shardkit.datasets.stats import COUNTS
from shardkit.errors import ConfigError
from shardkit.storage.retry import ShortRead
from shardkit.storage.retry_counts import RETRY_KINDS, retry_kind

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RANK = Path(__file__).resolve().parent / "metrics_rank.py"
GRAFANA = REPO / "infra" / "grafana-shardkit.json"
N = 480


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _data(n: int = N) -> list[dict[str, Any]]:
    rng = np.random.default_rng(7)
    return [{"__key__": f"m{i:05d}", "bin": rng.bytes(int(rng.integers(200, 3000)))} for i in range(n)]


def scrape_text(port: int) -> str:
    """What ``port`` (127.0.0.1) serves at /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def parse(text: str) -> dict[str, list[Any]]:
    """The samples of each family of an exposition."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def scrape(port: int) -> dict[str, list[Any]]:
    """The samples of each family served on ``port`` (127.0.0.1)."""
    return parse(scrape_text(port))


def per_rank(families: dict[str, list[Any]], family: str, dataset: str) -> dict[str, dict[str, float]]:
    """rank -> worker -> value of one counter family."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for s in families[family]:
        if s.name.endswith("_total") and s.labels.get("dataset") == dataset:
            out[s.labels["rank"]][s.labels["worker"]] = out[s.labels["rank"]].get(s.labels["worker"], 0.0) + s.value
    return out


def assert_adds_up(families: dict[str, list[Any]], dataset: str, rank: str, stats: dict[str, Any],
                   workers: set[str]) -> None:
    for key, (name, _) in metrics.METRICS.items():
        series = per_rank(families, name, dataset)[rank]
        assert set(series) == workers, (name, series)
        if key in COUNTS:
            assert sum(series.values()) == stats[key], (name, series, stats[key])
        else:
            assert sum(series.values()) == pytest.approx(stats[key], abs=1e-9), (name, series, stats[key])
    retries = per_rank(families, "shardkit_storage_retries", dataset)[rank]
    assert sum(retries.values()) == stats["retries"]
    kinds = {s.labels["kind"] for s in families["shardkit_storage_retries"] if s.labels["rank"] == rank}
    assert kinds == set(RETRY_KINDS)


def test_one_process_scrape_equals_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # control dirs: only this test's
    (tmp_path / "tmp").mkdir()
    url = str(tmp_path / "onep")
    shardkit.pack(iter(_data(200)), url, shard_bytes="40KB", progress=False)
    port = _free_port()
    monkeypatch.setenv(metrics.ENV_ADDR, "127.0.0.1")
    ds = shardkit.StreamingDataset(url, cache_dir=tmp_path / "cache", cache_limit="10MB", batch_size=10,
                                   metrics_port=port)
    try:
        assert sum(len(b["__key__"]) for b in ds) == 200
        families = scrape(port)
        stats = ds.stats()
        assert stats["samples"] == 200 and stats["misses"] + stats["prefetched"] + stats["hits"] > 0
        assert stats["bytes_served"] == sum(len(d["bin"]) for d in _data(200))  # the fields' bytes, once each
        assert_adds_up(families, "onep", "0", stats, {"0"})
        limit = [s for s in families["shardkit_cache_limit_bytes"]]
        assert [(s.labels["cache_dir"], s.value) for s in limit] == [(str(tmp_path / "cache"), 10_000_000)]
        disk = families["shardkit_cache_disk_bytes"][0].value
        assert 0 < disk <= 10_000_000
        # A second epoch: the counters go on from the first one's.
        assert sum(len(b["__key__"]) for b in ds) == 200
        assert per_rank(scrape(port), "shardkit_samples", "onep")["0"]["0"] == 400 == ds.stats()["samples"]
    finally:
        metrics.stop(port)
    with pytest.raises(OSError):  # stopped: nothing listens
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_metrics_options_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(metrics.ENV_PORT, "nine")
    with pytest.raises(ConfigError, match="SHARDKIT_METRICS_PORT='nine'"):
        metrics.port_from_env()
    monkeypatch.setenv(metrics.ENV_PORT, "70000")
    with pytest.raises(ConfigError, match="SHARDKIT_METRICS_PORT"):
        metrics.port_from_env()
    monkeypatch.delenv(metrics.ENV_PORT)
    assert metrics.port_from_env() is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"metrics port {port} on 127.0.0.1: cannot listen"):
            metrics.serve(port, addr="127.0.0.1")
        # A stream whose port another process holds is exported by that process: no error.
        control = tmp_path / "shardkit-stream-x"
        control.mkdir()
        assert metrics.enable(str(control), port, url="s3://b/some/ds?X=1", cache_dir=None, cache_limit=1) is None
        marker = json.loads((control / metrics.MARKER).read_text())
        assert marker["dataset"] == "ds" and marker["owner"] == os.getpid()
    assert [d for d, _ in metrics.marked_streams(str(tmp_path))] == [str(control)]


def test_retry_kinds() -> None:
    assert retry_kind(ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")) == "reset"
    assert retry_kind(ShortRead("body ended at 10 of 20 bytes")) == "short"
    assert retry_kind(TimeoutError("read timed out")) == "timeout"
    assert retry_kind(ConnectionRefusedError(errno.ECONNREFUSED, "refused")) == "connect"
    assert retry_kind(OSError("An error occurred (SlowDown) when calling GetObject: 503")) == "throttle"
    assert retry_kind(OSError("An error occurred (InternalError) ... 500")) == "server"
    assert retry_kind(ValueError("odd")) == "other"


def test_grafana_dashboard_names_existing_series() -> None:
    board = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    known = {name + "_total" for name, _ in metrics.METRICS.values()} | {"shardkit_storage_retries_total",
                                                                         "shardkit_cache_disk_bytes",
                                                                         "shardkit_cache_limit_bytes"}
    used = {m for e in exprs for m in re.findall(r"\bshardkit_[a-z_]+", e)}
    assert used and used <= known, used - known
    # Every family the exporter serves is on the dashboard.
    assert known <= used, known - used


@pytest.mark.ddp
@pytest.mark.s3
@pytest.mark.slow
def test_ddp_two_ranks_two_workers_scrape_adds_up_to_stats(s3_env: Any, s3_bucket: str, tmp_path: Path) -> None:
    """2 ranks x 2 DataLoader workers (gloo, real processes), one node cache, one metrics port:
    one rank serves, the scrape shows both ranks' series, and each rank's adds up to its stats()."""
    pytest.importorskip("torch")
    data = _data()
    url = f"{s3_bucket}/metricsds"
    shardkit.pack(iter(data), url, shard_bytes="50KB", progress=False)
    tmp = tmp_path / "tmp"  # the ranks' temp dir: their control dirs, and only theirs
    tmp.mkdir()
    port, master = _free_port(), _free_port()
    cfg = {"url": url, "cache_dir": str(tmp_path / "cache"), "cache_limit": "8MB", "port": port,
           "ready": str(tmp_path / "ready-"), "scraped": str(tmp_path / "scraped"), "wait": 120}
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(master), "LOCAL_WORLD_SIZE": "2", "PYTHONPATH": str(REPO), "TMPDIR": str(tmp),
               metrics.ENV_ADDR: "127.0.0.1"}
        procs.append(subprocess.Popen([sys.executable, str(RANK), json.dumps(cfg)], env=env))
    try:
        deadline = time.monotonic() + 180
        ready = [Path(f"{cfg['ready']}{r}") for r in range(2)]
        while not all(p.exists() for p in ready):
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            assert time.monotonic() < deadline, "the ranks did not finish their epoch in 180 s"
            time.sleep(0.1)
        text = scrape_text(port)
        Path(cfg["scraped"]).write_text("done")
        for p in procs:
            assert p.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    families = parse(text)
    res = sorted((json.loads(p.read_text()) for p in ready), key=lambda r: r["rank"])
    print("\nthe scrape (some of its series):")
    for line in text.splitlines():
        if line.startswith(("shardkit_samples_total", "shardkit_fetched_bytes_total", "shardkit_cache_misses_total",
                            "shardkit_cache_limit_bytes", "shardkit_cache_disk_bytes")):
            print("  " + line)
    assert Counter(k for r in res for k in r["keys"]) == Counter(d["__key__"] for d in data)
    samples = per_rank(families, "shardkit_samples", "metricsds")
    print("\nscrape during the DDP run (2 ranks x 2 workers), against each rank's stats():")
    for r in res:
        rank = str(r["rank"])
        assert_adds_up(families, "metricsds", rank, r["stats"], {"0", "1"})
        print(f"  rank {rank}: shardkit_samples_total by worker {samples[rank]} = {sum(samples[rank].values()):.0f}, "
              f"stats()['samples'] = {r['stats']['samples']}; fetched_bytes "
              f"{sum(per_rank(families, 'shardkit_fetched_bytes', 'metricsds')[rank].values()):.0f} = "
              f"{r['stats']['bytes_fetched']}; misses+prefetched "
              f"{sum(per_rank(families, 'shardkit_cache_misses', 'metricsds')[rank].values()) + sum(per_rank(families, 'shardkit_cache_prefetched', 'metricsds')[rank].values()):.0f}"
              f" = {r['stats']['misses'] + r['stats']['prefetched']}")
    assert sum(sum(w.values()) for w in samples.values()) == N
    assert sorted(r["served"] for r in res) == [port, port]  # both asked; one got the port and served both
    assert [s.value for s in families["shardkit_cache_limit_bytes"]] == [8_000_000]
    assert not list(tmp.glob("shardkit-stream-*")), "control dirs left behind"


def test_retries_of_a_reader_reach_its_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A retry made while a reader reads (here the storage retry loop itself, through a call
    reset twice then answering) is counted under its kind in that reader's snapshot, and
    only retries after its epoch began."""
    from types import SimpleNamespace

    from shardkit.datasets.stats import StreamStats, summed_stats
    from shardkit.read.topology import Topology
    from shardkit.storage import retry

    monkeypatch.setattr(retry, "backoff_delay", lambda attempt: 0.0)
    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        return "ok"

    assert retry.retrying(flaky, "before", "test") == "ok"  # before the epoch: not the stream's
    calls["n"] = 0
    stats = StreamStats(str(tmp_path))
    stats.begin()
    assert retry.retrying(flaky, "shards/shard-000000.tar", "test") == "ok"
    source = SimpleNamespace(stats=lambda: {"wait_seconds": 0.0})
    stats.save(source, Topology(0, 1, 0, 1), final=True)  # type: ignore[arg-type]
    got = summed_stats(str(tmp_path))
    assert got["retries_reset"] == 2 and got["retries"] == 2
    assert all(got[f"retries_{k}"] == 0 for k in RETRY_KINDS if k != "reset")


@pytest.mark.parametrize("how", [
    {"batch_size": None},                                   # per sample
    {"batch_size": 16, "read_threads": 0},                  # raw batches
    {"batch_size": 16, "read_threads": 2},                  # raw batches filled by threads
    {"batch_size": 16, "zero_copy": True},                  # views into the cache's files
    {"batch_size": 16, "decode": lambda s: {**s, "n": len(s["bin"])}},  # decoded batches
])
def test_bytes_served_counts_each_yielded_samples_fields_once(tmp_path: Path, how: dict[str, Any]) -> None:
    data = _data(150)
    url = str(tmp_path / "served")
    shardkit.pack(iter(data), url, shard_bytes="40KB", progress=False)
    ds = shardkit.StreamingDataset(url, cache_dir=tmp_path / "cache", cache_limit="10MB", drop_last=True, **how)
    n = sum(1 if how["batch_size"] is None else len(b["__key__"]) for b in ds)
    keys = {d["__key__"]: len(d["bin"]) for d in data}
    stats = ds.stats()
    assert n == stats["samples"] == (150 if how["batch_size"] is None else 144)
    # drop_last leaves 6 samples out: served counts what was yielded, not what was read.
    order = sorted(keys)[:n]
    assert stats["bytes_served"] == sum(keys[k] for k in order)
