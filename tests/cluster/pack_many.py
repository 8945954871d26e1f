"""A driver on the cluster packing several sources with the Ray engine, one after the other, each
behind its own :class:`gate.Gate` (loads held until tasks on both nodes reached it), so that every
pack's tasks ran on both nodes. One driver (one Ray connection) for all of them: a driver's start
costs seconds on a loaded machine.

    python pack_many.py SPECS.json

``SPECS.json``: a list of ``{"source": ..., "dest": ..., "marks": <dir>, **pack keyword arguments}``.
Prints the packs' summaries (``tasks``, ``nodes``, ``num_samples``) as one JSON list on the last line.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gate  # noqa: E402

__all__: list[str] = []


def main(path: str) -> list[dict[str, Any]]:
    import shardkit
    import shardkit.packing.pack as packing

    real = packing.resolve_source
    out = []
    with open(path) as f:
        specs = json.load(f)
    for spec in specs:
        marks = spec.pop("marks")
        packing.resolve_source = (  # type: ignore[assignment]
            lambda *a, _marks=marks, **kw: gate.Gate(real(*a, **kw), _marks, None, 2, 0))
        info = shardkit.pack(spec.pop("source"), spec.pop("dest"), engine="ray", progress=False, **spec)
        out.append({k: info.get(k) for k in ("tasks", "nodes", "num_samples", "reused_tasks")})
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
