"""``ray_jobs/pack.py`` with its source behind a :class:`gate.Gate` (configured by ``SK_GATE_*``).

Runs the real entry point (its arguments, the Ray engine by default) as ``ray job submit``
or a driver on the cluster does, with the loads held where a test needs them held.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gate  # noqa: E402

from ray_jobs.pack import main  # noqa: E402

__all__: list[str] = []

if __name__ == "__main__":
    gate.install_from_env()
    sys.exit(main())
