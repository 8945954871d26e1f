"""The package type-checks: types live in the code (py.typed), and mypy is clean on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_mypy_is_clean_on_the_package() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", "shardkit"], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
