"""``shardkit index`` takes the claim a pack takes: of two runs racing on one folder exactly one
commits, the other fails in one line having deleted nothing (before, the loser's cleanup deleted
the winner's manifest under its committed dataset.json). Real processes, local and SeaweedFS."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import shardkit
from shardkit.errors import DatasetExistsError
from shardkit.packing.claim import CLAIM, INDEX_PLAN, Claim
from shardkit.packing.index import index_tars
from shardkit.storage.store import Store

from test_index import _put, _tarfile_bytes
from test_pack_ray import image_folder

REPO = Path(__file__).resolve().parents[2]
TARS = 40
PER_TAR = 60

_RUNNER = """
import sys, time
import shardkit.packing.index  # imported before the start line: both runs start alike
from shardkit.cli import main
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
sys.exit(main(["index", sys.argv[2], "--quiet"]))
"""


def _tars() -> dict[str, bytes]:
    return {f"shards/t-{t:03d}.tar": _tarfile_bytes([(f"t{t:03d}s{i:03d}.{ext}", bytes([i % 251]) * (300 + i))
                                                     for i in range(PER_TAR) for ext in ("bin", "txt")])
            for t in range(TARS)}


def _race(dest: str) -> list[subprocess.CompletedProcess[str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.time() + 5  # both processes imported by then, on a loaded machine too
    procs = [subprocess.Popen([sys.executable, "-c", _RUNNER, str(start), dest], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _check_one_won(runs: list[subprocess.CompletedProcess[str]], dest: str, opts: dict[str, Any] | None) -> None:
    codes = sorted(r.returncode for r in runs)
    assert codes == [0, 1], [(r.returncode, r.stderr) for r in runs]
    ds = shardkit.open_dataset(dest, storage_options=opts)  # the winner's dataset, whole
    assert ds.num_samples == TARS * PER_TAR and ds.num_shards == TARS
    ds.verify(deep=True)
    assert sum(1 for _ in ds.iter_samples()) == TARS * PER_TAR
    loser = next(r for r in runs if r.returncode == 1)
    lines = loser.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardkit: error: "), loser.stderr
    assert "being indexed by another `shardkit index`" in lines[0] or "already holds a dataset" in lines[0], lines[0]
    assert not Store(dest, opts).exists(CLAIM)


def test_two_index_processes_racing_on_a_local_folder(tmp_path):
    _put(str(tmp_path / "wds"), _tars())
    _check_one_won(_race(str(tmp_path / "wds")), str(tmp_path / "wds"), None)


@pytest.mark.s3
def test_two_index_processes_racing_on_s3(s3_server, s3_bucket, s3_env):
    opts = s3_server.storage_options()
    _put(f"{s3_bucket}/wds", _tars(), opts)
    _check_one_won(_race(f"{s3_bucket}/wds"), f"{s3_bucket}/wds", opts)


def test_index_refuses_a_running_pack_and_a_pack_refuses_a_running_index(tmp_path):
    _put(str(tmp_path / "wds"), {k: v for k, v in list(_tars().items())[:2]})
    store = Store(str(tmp_path / "wds"))
    pack_claim = Claim(store, "0123456789abcdef", {"source": {"type": "folder"}})
    pack_claim.take(overwrite=False)
    try:
        with pytest.raises(DatasetExistsError, match="holds an unfinished pack .*before indexing there"):
            index_tars(str(tmp_path / "wds"), progress=False)
        assert store.exists(CLAIM) and not store.exists("manifest")
    finally:
        pack_claim.drop()
    index_claim = Claim(store, INDEX_PLAN, {"type": "index"}, kind="index")
    index_claim.take(overwrite=False)
    try:
        src = image_folder(tmp_path / "imgs", count=4, side=16)
        for overwrite in (False, True):  # the tars are the user's: --overwrite never deletes them
            with pytest.raises(DatasetExistsError, match="being indexed by `shardkit index`.*pack to another prefix"):
                shardkit.pack(str(src), str(tmp_path / "wds"), labels_from_dirs=True, overwrite=overwrite,
                              progress=False)
        with pytest.raises(DatasetExistsError, match="being indexed by another `shardkit index`"):
            index_tars(str(tmp_path / "wds"), progress=False)
        assert sorted(os.listdir(tmp_path / "wds" / "shards")) == ["t-000.tar", "t-001.tar"]
    finally:
        index_claim.drop()


def test_index_after_a_killed_index_takes_its_claim_over(tmp_path):
    """A killed index leaves its claim and fragments: the rerun takes the claim over (its process
    is gone) and replaces what it left."""
    _put(str(tmp_path / "wds"), {k: v for k, v in list(_tars().items())[:3]})
    store = Store(str(tmp_path / "wds"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    claim = Claim(store, INDEX_PLAN, {"type": "index"}, kind="index")
    claim.take(overwrite=False)
    claim._stop_beat()
    body = claim._body().replace(f'"pid": {os.getpid()}'.encode(), f'"pid": {int(dead.stdout)}'.encode())
    store.put_bytes(CLAIM, body)
    store.put_bytes("manifest/samples-00000.parquet", b"what the killed index was writing")
    info = index_tars(str(tmp_path / "wds"), progress=False)
    assert info["num_samples"] == 3 * PER_TAR
    shardkit.open_dataset(str(tmp_path / "wds")).verify(deep=True)
    assert not store.exists("_pack")
