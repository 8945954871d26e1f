"""Smoke tests of the benchmark matrix (benchmarks/matrix.py): its rows run each in their own
forked process, so a row that raises, dies or hangs fails alone; and a tiny run of every loader
mode writes the JSON, the table and a chart per axis. No speed is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.matrix import Forker  # noqa: E402

ROWS = textwrap.dedent('''
    import os, signal, time

    def fine(args):
        return {"twice": args["n"] * 2, "pid": os.getpid()}

    def raises(args):
        raise ValueError("row went wrong")

    def dies(args):
        os.kill(os.getpid(), signal.SIGKILL)

    def hangs(args):
        time.sleep(60)
''')


@pytest.mark.timeout(60)
def test_a_row_that_raises_dies_or_hangs_fails_alone(tmp_path: Path) -> None:
    (tmp_path / "rowfns.py").write_text(ROWS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    server = Forker(sys.executable, ["rowfns"], env, tmp_path / "server.log")
    try:
        def run(fn: str, timeout: float = 20.0) -> dict:
            return server.run(f"rowfns:{fn}", {"n": 21}, {"ROW_ENV": "1"}, timeout, tmp_path / f"{fn}.log")

        first = run("fine")
        assert first["status"] == "ok" and first["result"]["twice"] == 42
        raised = run("raises")
        assert raised["status"] == "failed" and "ValueError: row went wrong" in raised["reason"]
        assert "row went wrong" in (tmp_path / "raises.log").read_text()  # the traceback is in the row's log
        died = run("dies")
        assert died["status"] == "failed" and "signal 9" in died["reason"]
        hung = run("hangs", timeout=1.0)
        assert hung["status"] == "failed" and "timed out" in hung["reason"]
        again = run("fine")  # the same server still serves, each row in a new process
        assert again["status"] == "ok" and again["result"]["pid"] != first["result"]["pid"]
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_matrix_writes_json_table_and_charts(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.matrix", "--quick", "--no-peers", "--kinds", "tokens", "--shards", "1MB",
         "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=230,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((out / "matrix.json").read_text())
    assert {"command", "machine", "settings", "cells", "rows", "load_avg_start"} <= set(data)
    (cell,) = data["cells"]
    assert cell["pack"]["num_shards"] >= 2 and cell["count"] == cell["pack"]["num_samples"]
    assert cell["ceiling"]["get_seconds"] > 0 and cell["ceiling"]["first_batch_get_s"] > 0
    assert cell["cat"]["seconds"] > 0
    modes = {r["mode"]: r for r in data["rows"] if r["tool"] == "shardkit"}
    assert set(modes) == {"per_sample", "workers", "threads", "zero_copy", "nocache"}
    for mode, r in modes.items():
        assert r["status"] == "ok", r
        phases = ("cold",) if mode == "nocache" else ("cold", "warm")
        for p in phases:
            assert r[p]["samples"] == cell["count"] and r[p]["samples_per_s"] > 0 and r[p]["first_batch_s"] > 0
            assert r[p]["touched"] >= cell["payload_bytes"]  # the consumer read every payload byte
        assert r["rss"]["main_hwm_mb"] > 0
        if mode in ("per_sample", "workers", "nocache"):
            assert r["rss"]["worker_hwm_mb"], r["rss"]  # the DataLoader workers were seen
    table = (out / "matrix.md").read_text()
    assert "first batch cold" in table and "shardkit zero-copy views" in table
    for name in ("shard-size", "sample-size", "mode", "cold-warm", "first-batch"):
        assert (out / f"matrix-{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
