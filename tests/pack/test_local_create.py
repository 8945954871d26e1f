"""A create-only write to a local (or NFS) path is exclusive and atomic: two real processes
create the same file at the same moment, round after round (fsspec's local create is
exists-then-write: both "won" some rounds, and a loser read a half-written file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_ROUNDS = 150
REPO = Path(__file__).resolve().parents[2]
_WORKER = r"""
import json, sys
from pathlib import Path
from shardkit.errors import DatasetExistsError
from shardkit.storage.store import Store
root, me, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = Store(root)
mine = json.dumps({"writer": me, "pad": "x" * (1 << 20)}).encode()
won, partial = [], []
for i in range(rounds):
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(3)
    try:
        store.put_create(f"r/{i}.json", mine)
        won.append(i)
    except DatasetExistsError:
        try:
            json.loads((Path(root) / "r" / f"{i}.json").read_bytes())
        except ValueError:
            partial.append(i)
print(json.dumps({"won": won, "partial": partial}), flush=True)
"""


def test_local_create_is_exclusive_and_atomic_between_processes(tmp_path):
    """fsspec's local create is exists-then-write: both racers "won" some rounds and a loser read
    a half-written file. Now exactly one process wins each round and what is seen is complete.
    Each round, both processes (1 MiB to write) are released together by this one."""
    root = tmp_path / "dest"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(root), str(me), str(_ROUNDS)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for me in range(2)]
    try:
        for _ in range(_ROUNDS):
            for p in procs:
                assert p.stdout.readline() == "ready\n", p.stderr.read()  # type: ignore[union-attr]
            for p in procs:
                p.stdin.write("go\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
        results = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        for p in procs:
            assert p.wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    both = sorted(set(results[0]["won"]) & set(results[1]["won"]))
    assert both == [], f"both processes created the file in rounds {both[:10]}"
    assert sorted(results[0]["won"] + results[1]["won"]) == list(range(_ROUNDS))
    assert results[0]["partial"] + results[1]["partial"] == []
    for i in range(_ROUNDS):
        writer = json.loads((root / "r" / f"{i}.json").read_bytes())["writer"]
        assert i in results[writer]["won"]
    assert [n for n in os.listdir(root / "r") if n.startswith(".")] == []  # no temp file left
