"""Run the fault matrix (``tests/faults/test_matrix.py``) and print it as a markdown table with
pass counts per cell, for ``docs/faults.md``.

    PYTHONPATH=. python tests/faults/matrix_table.py --seeds 0 1 2      # runs pytest once per seed
    PYTHONPATH=. python tests/faults/matrix_table.py --results run.jsonl # a table from earlier runs

Each run appends one JSON line per cell to a results file (the ``SHARDKIT_MATRIX_RESULTS`` hook
of ``tests/faults/conftest.py``): node id, outcome, seed and seconds. A cell reads ``3/3`` when
it passed in each of 3 runs; a cell failing by a known fault (strict xfail) reads
``xfail 0/3`` with the fault in the notes under the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

_CELL = re.compile(r"test_cell\[(?P<fault>[a-z0-9_]+)-(?P<path>[a-z_]+)\]")


def run(seeds: list[int], results: Path, extra: list[str]) -> None:
    """Run the matrix once per seed, appending each cell's outcome to ``results``."""
    for seed in seeds:
        env = {**os.environ, "SHARDKIT_FAULT_SEED": str(seed), "SHARDKIT_MATRIX_RESULTS": str(results)}
        cmd = [sys.executable, "-m", "pytest", str(HERE / "test_matrix.py"), "-q", "-p", "no:cacheprovider", *extra]
        subprocess.run(cmd, cwd=ROOT, env=env, check=False)


def table(results: Path) -> str:
    """The markdown table of ``results``: faults down, paths across, ``passed/runs`` per cell."""
    from test_matrix import KNOWN, MATRIX_FAULTS, PATHS

    runs: dict[tuple[str, str], list[str]] = defaultdict(list)
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    seeds = set()
    for line in results.read_text().splitlines():
        rec = json.loads(line)
        m = _CELL.search(rec["nodeid"])
        if m:
            runs[(m["fault"], m["path"])].append(rec["outcome"])
            seconds[(m["fault"], m["path"])] = max(seconds[(m["fault"], m["path"])], rec["seconds"])
            seeds.add(rec["seed"])
    notes: dict[str, int] = {}
    lines = ["| fault | " + " | ".join(f"`{p}`" for p in PATHS) + " |",
             "|---|" + "---|" * len(PATHS)]
    for fault in MATRIX_FAULTS:
        row = [f"`{fault}`"]
        for path in PATHS:
            outcomes = runs.get((fault, path))
            if not outcomes:
                row.append("n/a")
                continue
            passed = outcomes.count("passed")
            cell = f"{passed}/{len(outcomes)}"
            if (fault, path) in KNOWN:
                reason = KNOWN[(fault, path)][0]
                n = notes.setdefault(reason, len(notes) + 1)
                cell = f"xfail {cell} [{n}]" if all(o == "xfailed" for o in outcomes) else f"{cell} (xfail [{n}]: {'/'.join(sorted(set(outcomes)))})"
            elif passed != len(outcomes):
                cell += " **" + "/".join(sorted(set(o for o in outcomes if o != "passed"))) + "**"
            row.append(cell)
        lines.append("| " + " | ".join(row) + " |")
    out = "\n".join(lines) + "\n"
    if notes:
        out += "\n" + "\n".join(f"[{n}] {reason}" for reason, n in notes.items()) + "\n"
    total = sum(len(v) for v in runs.values())
    slowest = max(seconds.values(), default=0.0)
    out += f"\n{total} cell runs over seed(s) {', '.join(map(str, sorted(seeds)))}; slowest cell {slowest:.0f} s.\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0], help="run the matrix once per seed")
    parser.add_argument("--results", type=Path, help="a results file: read it (and, with --run, add to it)")
    parser.add_argument("--run", action="store_true", help="with --results: run the matrix too")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.results is None or args.run:
        results = args.results or Path(tempfile.mkstemp(prefix="fault-matrix-", suffix=".jsonl")[1])
        run(args.seeds, results, args.pytest_args)
    else:
        results = args.results
    print(table(results), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
