"""Smoke test of the one-command benchmark: it completes and writes what users read.

Runs ``python -m benchmarks.run --quick --no-peers`` on a few hundred images (SeaweedFS, the
shardkit rows, the naive baselines and the ceilings) and checks the JSON's shape and the PNG's
signature, never any speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # ~1 min: its own SeaweedFS, a few hundred images; runs by default

EXPECTED_ROWS = {
    "shardkit pack (local engine)", "S3 object per image: put_object x8 threads",
    "S3 object per image (boto3 get_object)", "local files, open+read per file",
    "local files, cv2.imread + crop per file",
    "shardkit per-sample dicts, cold", "shardkit per-sample dicts, warm", "shardkit per-sample dicts, decoded",
    "shardkit zero-copy views (num_workers=0), cold", "shardkit zero-copy views (num_workers=0), warm",
    "shardkit packed batches, 2 read threads (num_workers=0), cold",
    "shardkit packed batches, 2 read threads (num_workers=0), warm",
    "shardkit in-worker batches (ring handoff), cold", "shardkit in-worker batches (ring handoff), warm",
    "shardkit in-worker batches (copy handoff), cold", "shardkit in-worker batches (copy handoff), warm",
    "shardkit in-worker batches, decoded",
    "shardkit in-worker batches (ring handoff), warm, 3rd epoch of one loader (persistent workers)",
    "ceiling: S3 ranged GET x8 threads, same shards (best of 9)", "ceiling: cat of the cached shard files (best of 3)",
}


@pytest.mark.timeout(240)
def test_quick_benchmark_writes_json_and_png(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--no-peers", "--images", "300", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=230,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    data = json.loads((out / "latest.json").read_text())
    assert {"command", "machine", "versions", "settings", "headline", "rows"} <= set(data)
    assert data["machine"]["cpu_count"] >= 1 and data["settings"]["images"] == 300
    rows = {r["name"]: r for r in data["rows"]}
    assert EXPECTED_ROWS <= set(rows), EXPECTED_ROWS - set(rows)
    for r in data["rows"]:
        assert r["status"] in ("ok", "failed", "not available"), r
        assert {"group", "tool", "samples_per_s", "mb_per_s", "seconds"} <= set(r)
        if r["status"] == "ok":
            assert r["samples_per_s"] > 0 and r["seconds"] > 0, r
        else:
            assert r["reason"], r  # a failed row always says why
    # cv2 is optional in the test extra: that row may be "not available", never missing.
    assert rows["local files, cv2.imread + crop per file"]["status"] in ("ok", "not available")
    for name in EXPECTED_ROWS - {"local files, cv2.imread + crop per file"}:
        assert rows[name]["status"] == "ok", rows[name]

    png = (out / "latest.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
