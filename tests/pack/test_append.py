"""``pack(..., append=True)``: versions appended beside the old files, committed once with a
create-only marker, keys unique across versions, idempotent reruns, a killed append resumed.
Local directories, and real SeaweedFS for the racing appends and the create-only marker."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

import shardkit
from shardkit.cli import main
from shardkit.errors import DatasetExistsError, SourceError
from shardkit.packing.sources.base import SourceItem
from shardkit.packing.claim import _machine
from shardkit.packing.sources.files import FolderSource
from shardkit.packing.version_commit import put_version
from shardkit.read.versions import list_versions
from shardkit.storage.store import Store

REPO = Path(__file__).resolve().parents[2]


def folder(root: Path, keys: list[str]) -> Path:
    """A folder of ``<key>.txt`` / ``<key>.cls`` samples."""
    root.mkdir(parents=True, exist_ok=True)
    for k in keys:
        (root / f"{k}.txt").write_text(f"text of {k} " * 20)
        (root / f"{k}.cls").write_text(str(len(k) % 3))
    return root


def keys_of(url: str, version: int | None = None, opts: dict[str, Any] | None = None) -> list[str]:
    ds = shardkit.open_dataset(url, storage_options=opts, version=version)
    return [s["__key__"] for s in ds.iter_samples()]


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``root``: its mtime (ns) and sha256."""
    return {p.relative_to(root).as_posix(): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in root.rglob("*") if p.is_file()}


def test_append_twice_reads_every_version(tmp_path):
    a = folder(tmp_path / "a", [f"a{i:03d}" for i in range(10)])
    b = folder(tmp_path / "b", [f"b{i:03d}" for i in range(7)])
    c = folder(tmp_path / "c", [f"c{i:03d}" for i in range(5)])
    url = str(tmp_path / "ds")
    shardkit.pack(str(a), url, shard_samples=4, progress=False)
    before = snapshot(Path(url))
    v2 = shardkit.pack(str(b), url, shard_samples=4, progress=False, append=True)
    v3 = shardkit.pack(str(c), url, shard_samples=4, progress=False, append=True)
    assert (v2["dataset_version"], v2["num_samples"], v3["dataset_version"], v3["num_samples"]) == (2, 17, 3, 22)
    after = snapshot(Path(url))
    # Old shards and fragments are never rewritten: same bytes, same mtime.
    for rel in before:
        if rel.startswith(("shards/", "manifest/samples-")):
            assert after[rel] == before[rel], rel
    assert list_versions(Store(url)) == [1, 2, 3]
    want = {1: [f"a{i:03d}" for i in range(10)], 2: [f"b{i:03d}" for i in range(7)], 3: [f"c{i:03d}" for i in range(5)]}
    for version in (1, 2, 3):
        expected = [k for v in range(1, version + 1) for k in want[v]]
        assert keys_of(url, version) == expected
        shardkit.open_dataset(url, version=version).verify(deep=True)
    assert keys_of(url) == keys_of(url, 3)
    # The root files are the latest version's, readable without shardkit: what older readers open.
    root = json.loads((Path(url) / "dataset.json").read_text())
    table = pq.read_table(Path(url) / "manifest" / "shards.parquet")
    assert root["dataset_version"] == 3 and root["num_samples"] == 22 and table.num_rows == root["num_shards"]
    names = []
    for rel in table.column("path").to_pylist():
        with tarfile.open(Path(url) / rel) as tar:
            names += [m.name.split(".", 1)[0] for m in tar.getmembers() if m.name.endswith(".txt")]
    assert names == keys_of(url, 3)


def test_info_lists_versions(tmp_path, capsys):
    url = str(tmp_path / "ds")
    shardkit.pack(str(folder(tmp_path / "a", ["a0", "a1", "a2"])), url, progress=False)
    shardkit.pack(str(folder(tmp_path / "b", ["b0", "b1"])), url, progress=False, append=True)
    assert main(["info", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "versions  2 (latest 2):" in lines
    assert any(line.startswith("  v1  3 samples  1 shards") for line in lines), lines
    assert any(line.startswith("  v2  5 samples  2 shards") for line in lines), lines
    assert main(["info", url, "--json"]) == 0
    assert [v["num_samples"] for v in json.loads(capsys.readouterr().out)["versions"]] == [3, 5]


def test_duplicate_key_refused_then_skipped(tmp_path):
    url = str(tmp_path / "ds")
    shardkit.pack(str(folder(tmp_path / "a", ["k0", "k1", "k2"])), url, progress=False)
    mixed = folder(tmp_path / "b", ["k1", "n0", "n1"])
    before = snapshot(Path(url))
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(mixed), url, progress=False, append=True)
    msg = str(err.value)
    assert "\n" not in msg and "key 'k1' is already in" in msg and "--on-error skip" in msg
    assert snapshot(Path(url)) == before  # refused before writing anything
    info = shardkit.pack(str(mixed), url, progress=False, append=True, on_error="skip")
    assert info["dataset_version"] == 2 and info["num_samples"] == 5
    assert [s["key"] for s in info["skipped"]] == ["k1"] and "already in version 1" in info["skipped"][0]["reason"]
    assert keys_of(url) == ["k0", "k1", "k2", "n0", "n1"]


def test_rerun_up_to_date_writes_nothing(tmp_path, capsys):
    a = folder(tmp_path / "a", [f"a{i}" for i in range(6)])
    b = folder(tmp_path / "b", [f"b{i}" for i in range(4)])
    url = str(tmp_path / "ds")

    def cli(*args: str) -> tuple[int, str, str]:
        code = main(["pack", *args, "--quiet"])
        out = capsys.readouterr()
        return code, out.out, out.err

    assert cli(str(a), url, "--shard-samples", "2")[0] == 0
    before = snapshot(Path(url))
    code, out, err = cli(str(a), url, "--shard-samples", "2")
    assert code == 0 and out.startswith("up to date:"), out + err
    assert snapshot(Path(url)) == before
    code, out, err = cli(str(a), url, "--shard-samples", "3")  # other options: refused as before
    assert code == 1 and "already holds a dataset" in err
    assert cli(str(b), url, "--shard-samples", "2", "--append")[0] == 0
    before = snapshot(Path(url))
    for args in ((str(b), url, "--shard-samples", "2", "--append"), (str(a), url, "--shard-samples", "2")):
        code, out, err = cli(*args)
        assert code == 0 and "up to date" in out, out + err
    assert snapshot(Path(url)) == before


_KILLED_APPEND = """
import sys, time
import shardkit
from shardkit.packing.claim import _machine
from shardkit.packing.sources.files import FolderSource

class Slow(FolderSource):
    def load(self, item):
        time.sleep(0.05)
        return super().load(item)

shardkit.pack(Slow(sys.argv[1]), sys.argv[2], shard_samples=2, progress=False, append=True)
"""


@pytest.mark.slow
def test_killed_append_leaves_version_intact_and_rerun_completes(tmp_path):
    url = str(tmp_path / "ds")
    a_keys = [f"a{i:02d}" for i in range(8)]
    b_keys = [f"b{i:02d}" for i in range(40)]
    shardkit.pack(str(folder(tmp_path / "a", a_keys)), url, shard_samples=2, progress=False)
    b = folder(tmp_path / "b", b_keys)
    cmd = [sys.executable, "-c", _KILLED_APPEND, str(b), url]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(list((Path(url) / "shards").glob("*.tar"))) < 4 + 5 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert len(list((Path(url) / "shards").glob("*.tar"))) > 4  # it had appended shards when it died
    assert list_versions(Store(url)) == []  # no version 2 committed
    assert keys_of(url) == a_keys  # version 1 intact and readable
    shardkit.open_dataset(url).verify(deep=True)

    rerun = subprocess.run(cmd[:-2] + [str(b), url], env=env, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    ds = shardkit.open_dataset(url)
    assert ds.version == 2 and keys_of(url) == a_keys + b_keys
    ds.verify(deep=True)
    assert keys_of(url, 1) == a_keys
    assert not (Path(url) / "_pack").exists()


class SlowFolder(FolderSource):
    """A folder source whose loads take a while, so two appends overlap."""

    def load(self, item: SourceItem) -> Any:
        time.sleep(0.03)
        return super().load(item)


@pytest.mark.s3
@pytest.mark.slow
def test_racing_appends_exactly_one_commits(tmp_path, s3_server, s3_bucket):
    opts = s3_server.storage_options()
    url = f"{s3_bucket}/ds"
    shardkit.pack(str(folder(tmp_path / "a", ["a0", "a1", "a2", "a3"])), url, shard_samples=2, storage_options=opts,
                  progress=False)
    sources = {"b": folder(tmp_path / "b", [f"b{i}" for i in range(12)]),
               "c": folder(tmp_path / "c", [f"c{i}" for i in range(12)])}
    results: dict[str, Any] = {}
    start = threading.Barrier(2)

    def append(name: str) -> None:
        start.wait()
        try:
            results[name] = shardkit.pack(SlowFolder(str(sources[name])), url, shard_samples=2, storage_options=opts,
                                          progress=False, append=True)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            results[name] = exc

    threads = [threading.Thread(target=append, args=(n,)) for n in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    won = [n for n, r in results.items() if isinstance(r, dict)]
    lost = [n for n, r in results.items() if isinstance(r, BaseException)]
    assert len(won) == 1 and len(lost) == 1, results
    error = results[lost[0]]
    assert isinstance(error, DatasetExistsError) and "\n" not in str(error)
    # Refused by the other append's claim while it packs, or by its marker if it committed first.
    assert "wait for it to finish" in str(error) or "committed by another pack" in str(error), error
    assert list_versions(Store(url, opts)) == [1, 2]
    assert keys_of(url, 2, opts) == ["a0", "a1", "a2", "a3"] + sorted(f"{won[0]}{i}" for i in range(12))
    # The loser reruns and appends on top, as version 3.
    v3 = shardkit.pack(str(sources[lost[0]]), url, shard_samples=2, storage_options=opts, progress=False, append=True)
    assert v3["dataset_version"] == 3
    for version, n in ((1, 4), (2, 16), (3, 28)):
        ds = shardkit.open_dataset(url, storage_options=opts, version=version)
        assert ds.num_samples == n
        ds.verify(deep=True)
    # A rerun of either append writes nothing: every object keeps its ETag and modification time.
    fs = s3_server.filesystem()

    def objects() -> dict[str, tuple[str, Any]]:
        fs.invalidate_cache()
        return {p: (i["ETag"], i["LastModified"]) for p, i in fs.find(url[5:], detail=True).items()}

    before = objects()
    for name in sources:
        again = shardkit.pack(str(sources[name]), url, shard_samples=2, storage_options=opts, progress=False,
                              append=True)
        assert again["up_to_date"] is True
    assert objects() == before


@pytest.mark.s3
def test_version_marker_is_create_only(s3_server, s3_bucket):
    """Two writers committing the same version number with other content: exactly one marker
    lands (S3 If-None-Match on SeaweedFS), the other gets the one-line refusal."""
    store = Store(f"{s3_bucket}/ds", s3_server.storage_options())
    outcomes: list[Any] = []
    start = threading.Barrier(4)

    def commit(i: int) -> None:
        start.wait()
        try:
            put_version(store, 2, {"format": "shardkit", "version": 1, "num_samples": i, "num_shards": 0,
                                   "total_bytes": 0, "fields": []}, f"table {i}".encode())
            outcomes.append(i)
        except DatasetExistsError as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [o for o in outcomes if isinstance(o, int)]
    assert len(winners) == 1, outcomes
    assert all(o.endswith("version 2 was committed by another pack; rerun to append on top")
               for o in outcomes if isinstance(o, str))
    marker = json.loads(store.read_bytes("versions/v000002.json"))
    assert marker["num_samples"] == winners[0]
    assert store.read_bytes(marker["shards_file"]) == f"table {winners[0]}".encode()


def test_overwrite_removes_every_version(tmp_path):
    url = str(tmp_path / "ds")
    shardkit.pack(str(folder(tmp_path / "a", ["a0", "a1"])), url, progress=False)
    shardkit.pack(str(folder(tmp_path / "b", ["b0"])), url, progress=False, append=True)
    info = shardkit.pack(str(folder(tmp_path / "c", ["c0", "c1", "c2"])), url, progress=False, overwrite=True)
    assert info["num_samples"] == 3 and not (Path(url) / "versions").exists()
    ds = shardkit.open_dataset(url)
    assert ds.version == 1 and keys_of(url) == ["c0", "c1", "c2"]


def test_append_refused_when_another_commits_between_look_and_claim(tmp_path, monkeypatch):
    """Another append commits after this one read the latest version but before it claimed the
    destination: this one must not number its shards on from the old version."""
    import shardkit.packing.append as append_mod

    url = str(tmp_path / "ds")
    shardkit.pack(str(folder(tmp_path / "a", ["a0", "a1"])), url, progress=False)
    other = folder(tmp_path / "c", ["c0", "c1"])
    real = append_mod.known_keys
    calls = []

    def known_keys_then_other_commits(*args: Any) -> set[str]:
        found = real(*args)
        if not calls:
            calls.append(1)
            shardkit.pack(str(other), url, progress=False, append=True)
        return found

    monkeypatch.setattr(append_mod, "known_keys", known_keys_then_other_commits)
    with pytest.raises(DatasetExistsError) as err:
        shardkit.pack(str(folder(tmp_path / "b", ["b0"])), url, progress=False, append=True)
    assert str(err.value).endswith("version 2 was committed by another pack; rerun to append on top")
    assert keys_of(url) == ["a0", "a1", "c0", "c1"] and not (Path(url) / "_pack" / "plan.json").exists()
    monkeypatch.setattr(append_mod, "known_keys", real)
    assert shardkit.pack(str(tmp_path / "b"), url, progress=False, append=True)["dataset_version"] == 3


def test_rerun_after_kill_between_commit_and_root_finishes(tmp_path):
    """An append killed after its marker (the commit) but before the root files moved and its
    claim went: the rerun says up to date, moves the root on and removes the claim."""
    url = Path(tmp_path / "ds")
    shardkit.pack(str(folder(tmp_path / "a", ["a0", "a1"])), str(url), progress=False)
    old_root = {rel: (url / rel).read_bytes() for rel in ("dataset.json", "manifest/shards.parquet")}
    b = folder(tmp_path / "b", ["b0"])
    shardkit.pack(str(b), str(url), progress=False, append=True)
    marker = json.loads((url / "versions" / "v000002.json").read_text())
    for rel, data in old_root.items():  # as the kill left it: root still at version 1, claim there
        (url / rel).write_bytes(data)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid on this machine whose process is gone, as after a SIGKILL
    (url / "_pack").mkdir()
    (url / "_pack" / "plan.json").write_text(json.dumps({
        "plan_id": marker["pack"]["plan_id"], "token": "killed", "started": time.time(), "heartbeat": time.time(),
        "ended": None, "host": "here", "pid": dead.pid, "machine": _machine(), "settings": {}}))
    again = shardkit.pack(str(b), str(url), progress=False, append=True)
    assert again["up_to_date"] is True and again["dataset_version"] == 2
    assert json.loads((url / "dataset.json").read_text())["dataset_version"] == 2
    assert (url / "manifest" / "shards.parquet").read_bytes() == (url / marker["shards_file"]).read_bytes()
    assert not (url / "_pack").exists()
    # Nothing is left in the way of the next append.
    assert shardkit.pack(str(folder(tmp_path / "c", ["c0"])), str(url), progress=False,
                         append=True)["dataset_version"] == 3
