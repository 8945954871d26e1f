"""The README's quick-start job (`make demo`) runs end to end on a small image set."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_demo_packs_streams_and_prints_every_row(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "shardkit.dev.demo", "--images", "120", "--batch-size", "32",
                           "--workdir", str(tmp_path / "demo")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "made 120 JPEGs" in out and "packed into" in out
    for row in ("shardkit raw, cold cache", "shardkit raw, warm cache", "shardkit raw zero-copy, warm cache",
                "files raw (one open per image)", "shardkit decode+crop 224", "files decode+crop 224"):
        line = next((ln for ln in out.splitlines() if ln.startswith(row)), None)
        assert line is not None, row
        assert float(line[len(row):].split()[0]) > 0, line  # a rate was measured for the row
    assert "raw warm vs one-file-per-image" in out
