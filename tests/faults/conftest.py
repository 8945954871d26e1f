"""Fixtures of the fault matrix: a started :class:`~faultproxy.FaultProxy` in front of the
session's SeaweedFS server (stopped at the end of the test), the schedule's seed, and an
optional record of each test's outcome for ``matrix_table.py``.

``SHARDKIT_FAULT_SEED`` sets the seed of every proxy's schedule (default 0);
``SHARDKIT_MATRIX_RESULTS`` names a JSON-lines file that gets one line per test of this folder
(node id, outcome, seed), which ``tests/faults/matrix_table.py`` turns into the docs' table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from faultproxy import FaultProxy


def fault_seed() -> int:
    """The seed of the proxies' schedules in this run (``SHARDKIT_FAULT_SEED``, default 0)."""
    return int(os.environ.get("SHARDKIT_FAULT_SEED", "0"))


@pytest.fixture
def fault_proxy(s3_server: Any) -> Iterator[FaultProxy]:
    """A started fault proxy in front of ``s3_server``, with no rules yet (``set_rules`` adds
    them); ``fault_proxy.stats()`` counts the faults injected. Stopped at the end."""
    proxy = FaultProxy(s3_server.endpoint, seed=fault_seed()).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Append this test's outcome to ``SHARDKIT_MATRIX_RESULTS`` (when set)."""
    path = os.environ.get("SHARDKIT_MATRIX_RESULTS")
    if not path:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        if hasattr(report, "wasxfail"):
            outcome = "xpassed" if report.outcome == "passed" else "xfailed"
        else:
            outcome = report.outcome if report.when == "call" else ("error" if report.failed else report.outcome)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "outcome": outcome, "seed": fault_seed(),
                                "seconds": round(report.duration, 2)}) + "\n")
