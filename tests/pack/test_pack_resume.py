"""Packing survives kills and races: a killed driver resumes, a killed Ray task is retried,
racing packs commit exactly once. Real SeaweedFS, real local Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import shardkit
from shardkit.errors import DatasetExistsError, SourceError
from shardkit.packing.sources import ImageFolderSource
from shardkit.packing.sources.base import SourceItem

from test_pack_ray import compare_datasets, image_folder

pytestmark = [pytest.mark.s3]

REPO = Path(__file__).resolve().parents[2]


def _keys(url: str, opts: dict[str, Any]) -> list[str]:
    return shardkit.open_dataset(url, storage_options=opts).samples.column("key").to_pylist()


def _source_keys(src: Path) -> list[str]:
    return sorted(it.key for it in ImageFolderSource(src).list_items())


def _wait_for_shards(fs: Any, prefix: str, count: int, proc: subprocess.Popen[bytes], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return -1
        try:
            n = len(fs.ls(f"{prefix}/shards", refresh=True))
        except FileNotFoundError:
            n = 0
        if n >= count:
            return n
        time.sleep(0.05)
    return 0


def _kill_after_shards(cmd: list[str], env: dict[str, str], fs: Any, dest: str, n: int) -> int:
    """Run the CLI pack ``cmd`` and SIGKILL it once ``n`` shards are in storage at ``dest``
    (an s3:// URL); returns the shards seen."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = _wait_for_shards(fs, dest[5:], n, proc, timeout=60)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert seen > 0, "the pack finished (or failed) before it could be killed: make the source slower"
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["local", "ray"])
def test_killed_driver_resumes(tmp_path, s3_server, s3_bucket, engine, request):
    """SIGKILL the CLI mid-pack, rerun: every sample once, shards identical, tasks reused. With
    Ray the driver is attached to a running cluster, as under ``ray job submit``: its tasks
    die with it, and the rerun is another job on the same cluster."""
    src = image_folder(tmp_path / "imgs", count=240, side=64)
    total = sum(p.stat().st_size for p in src.rglob("*.jpg"))
    shard = str(total // 100)  # ~100 shards in ~64 tasks
    dest = f"{s3_bucket}/ds-{engine}"
    env = {**os.environ, **s3_server.env(), "PYTHONPATH": str(REPO)}
    if engine == "ray":
        env["RAY_ADDRESS"] = request.getfixturevalue("ray_local").get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "shardkit.cli", "pack", str(src), dest, "--engine", engine, "--labels-from-dirs",
           "--shard-size", shard, "--quiet"]
    fs = s3_server.filesystem()
    _kill_after_shards(cmd, env, fs, dest, 12)
    assert not fs.exists(f"{dest[5:]}/dataset.json")
    with pytest.raises(shardkit.errors.DatasetNotFoundError):
        shardkit.open_dataset(dest, storage_options=s3_server.storage_options())

    rerun = subprocess.run(cmd + ["--json"], env=env, capture_output=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr.decode()
    import json

    info = json.loads(rerun.stdout)
    assert info["reused_tasks"] > 0 and info["reused_tasks"] < info["tasks"]
    opts = s3_server.storage_options()
    keys = _keys(dest, opts)
    assert len(keys) == len(set(keys)) and sorted(keys) == _source_keys(src)

    clean = shardkit.pack(str(src), f"{s3_bucket}/clean-{engine}", shard_bytes=int(shard), labels_from_dirs=True,
                          storage_options=opts, progress=False)
    assert clean["reused_tasks"] == 0
    a, _ = compare_datasets(dest, f"{s3_bucket}/clean-{engine}", opts)
    a.verify(deep=True)


class DiesOnce:
    """An ImageFolder whose load() kills its process on one item, the first time only.

    The marker file makes it once: a Ray retry (a fresh worker) then packs the item.
    """

    def __init__(self, root: str, victim: str, marker: str) -> None:
        self.inner = ImageFolderSource(root)
        self.victim = victim
        self.marker = marker

    def list_items(self) -> list[SourceItem]:
        return self.inner.list_items()

    def load(self, item: SourceItem) -> Any:
        if item.key == self.victim and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os._exit(1)
        return self.inner.load(item)

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()

    def labels(self) -> dict[str, int] | None:
        return self.inner.labels()


@pytest.mark.ray
def test_killed_ray_task_is_retried(tmp_path, ray_local, s3_server, s3_bucket):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    src = image_folder(tmp_path / "imgs", count=60, side=96)
    keys = _source_keys(src)
    marker = tmp_path / "died"
    total = sum(p.stat().st_size for p in src.rglob("*.jpg"))
    opts = s3_server.storage_options()
    info = shardkit.pack(DiesOnce(str(src), keys[len(keys) // 2], str(marker)), f"{s3_bucket}/ray",
                         shard_bytes=total // 10, engine="ray", storage_options=opts, progress=False)
    assert marker.exists() and int(marker.read_text()) != os.getpid()  # a worker really died
    assert info["num_samples"] == 60
    shardkit.pack(ImageFolderSource(src), f"{s3_bucket}/local", shard_bytes=total // 10, engine="local",
                  storage_options=opts, progress=False)
    a, _ = compare_datasets(f"{s3_bucket}/ray", f"{s3_bucket}/local", opts)
    assert sorted(a.samples.column("key").to_pylist()) == keys
    a.verify(deep=True)


class SlowSource:
    """Delays every load so a second pack can start while the first is running."""

    def __init__(self, root: str, delay: float) -> None:
        self.inner = ImageFolderSource(root)
        self.delay = delay

    def list_items(self) -> list[SourceItem]:
        return self.inner.list_items()

    def load(self, item: SourceItem) -> Any:
        time.sleep(self.delay)
        return self.inner.load(item)

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()

    def labels(self) -> dict[str, int] | None:
        return self.inner.labels()


def test_race_different_input_second_refused(tmp_path, s3_server, s3_bucket):
    first_src = image_folder(tmp_path / "a", count=30, side=64)
    image_folder(tmp_path / "b", count=20, side=64, seed=1)
    opts = s3_server.storage_options()
    dest = f"{s3_bucket}/ds"
    result: dict[str, Any] = {}

    def first() -> None:
        try:
            result["info"] = shardkit.pack(SlowSource(str(first_src), 0.02), dest, shard_bytes="20KB",
                                           storage_options=opts, progress=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            result["error"] = exc

    t = threading.Thread(target=first)
    t.start()
    try:
        fs = s3_server.filesystem()
        deadline = time.monotonic() + 30
        while not fs.exists(f"{dest[5:]}/_pack/plan.json") and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.02)
        with pytest.raises(DatasetExistsError, match="unfinished pack .* with other"):
            shardkit.pack(str(tmp_path / "b"), dest, shard_bytes="20KB", labels_from_dirs=True,
                          storage_options=opts, progress=False)
    finally:
        t.join(60)
    assert "error" not in result, result.get("error")
    ds = shardkit.open_dataset(dest, storage_options=opts)
    assert sorted(ds.samples.column("key").to_pylist()) == _source_keys(first_src)
    ds.verify(deep=True)
    # and once committed, a different input is refused as well
    with pytest.raises(DatasetExistsError, match="already holds a dataset"):
        shardkit.pack(str(tmp_path / "b"), dest, labels_from_dirs=True, storage_options=opts, progress=False)


def test_race_same_input_commits_once(tmp_path, s3_server, s3_bucket):
    src = image_folder(tmp_path / "imgs", count=40, side=64)
    opts = s3_server.storage_options()
    dest = f"{s3_bucket}/ds"
    barrier = threading.Barrier(2)
    outcomes: list[Any] = [None, None]

    def run(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = shardkit.pack(str(src), dest, shard_bytes="16KB", labels_from_dirs=True,
                                        storage_options=opts, progress=False)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    wins = [o for o in outcomes if isinstance(o, dict)]
    losses = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(wins) == 1 and len(losses) == 1, outcomes
    assert isinstance(losses[0], DatasetExistsError), repr(losses[0])
    ds = shardkit.open_dataset(dest, storage_options=opts)
    assert sorted(ds.samples.column("key").to_pylist()) == _source_keys(src)
    assert ds.info["created"] == wins[0]["created"]
    ds.verify(deep=True)


def test_failed_shard_upload_writes_no_fragment_and_resume_redoes_only_the_rest(tmp_path, s3_server, s3_bucket,
                                                                             monkeypatch):
    """Uploads run behind the framing thread, but a task's fragment is written only after its
    shards: a failed PUT leaves earlier tasks complete (reused by the rerun) and no later one."""
    from shardkit.config import DEFAULT_TASK_BYTES
    from shardkit.errors import StoragePermissionError
    from shardkit.format.manifest import fragment_name
    from shardkit.packing.plan import make_plan
    from shardkit.packing.sources import resolve_source
    from shardkit.storage.store import Store

    src = image_folder(tmp_path / "imgs", count=40, side=64)
    total = sum(p.stat().st_size for p in src.rglob("*.jpg"))
    shard = total // 10
    opts = s3_server.storage_options()
    dest = f"{s3_bucket}/ds"
    real = Store(dest, opts).boto3_client()

    class FailShard4:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def put_object(self, **kw: Any) -> Any:
            if kw["Key"].endswith("shard-000004.tar"):
                raise PermissionError("simulated denial")
            return real.put_object(**kw)

    with monkeypatch.context() as m:
        m.setattr(Store, "boto3_client", lambda self: FailShard4())
        with pytest.raises(StoragePermissionError, match="shard-000004.tar"):
            shardkit.pack(str(src), dest, shard_bytes=shard, labels_from_dirs=True, storage_options=opts,
                          progress=False)
    store = Store(dest, opts)
    plan = make_plan(resolve_source(str(src), labels_from_dirs=True).list_items(), shard_bytes=shard,
                     shard_samples=None, task_bytes=DEFAULT_TASK_BYTES, options={})
    failing = next(t.task for t in plan.tasks if any(s.shard == 4 for s in t.shards))
    assert failing >= 2, plan.tasks  # earlier tasks to reuse
    done = [t for t in range(len(plan.tasks)) if store.exists(fragment_name(t))]
    assert done == list(range(failing)), done  # the tasks before shard 4's finished, nothing after
    assert not store.exists("shards/shard-000004.tar") and not store.exists("dataset.json")

    info = shardkit.pack(str(src), dest, shard_bytes=shard, labels_from_dirs=True, storage_options=opts,
                         progress=False)
    assert info["reused_tasks"] == failing
    shardkit.pack(str(src), f"{s3_bucket}/clean", shard_bytes=shard, labels_from_dirs=True, storage_options=opts,
                  progress=False)
    a, _ = compare_datasets(dest, f"{s3_bucket}/clean", opts)
    a.verify(deep=True)


def test_rerun_with_other_settings_is_told_what_differs(tmp_path):
    # A pack that stopped at a bad input, rerun with on_error="skip": refused, saying which
    # setting differs and how to go on (not only "different input ... may still be running").
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"k{i}.bin").write_bytes(bytes([i]) * 100)
    (src / "k9.bin").symlink_to(tmp_path / "gone")  # dangling: fails when loaded
    dest = str(tmp_path / "ds")
    with pytest.raises(SourceError, match="k9"):
        shardkit.pack(str(src), dest, shard_samples=2, task_bytes="1", progress=False)
    with pytest.raises(DatasetExistsError) as err:
        shardkit.pack(str(src), dest, shard_samples=2, task_bytes="1", on_error="skip", progress=False)
    msg = str(err.value)
    assert "on_error 'raise' then, 'skip' now" in msg and "--overwrite" in msg and "\n" not in msg
    info = shardkit.pack(str(src), dest, shard_samples=2, task_bytes="1", on_error="skip", overwrite=True,
                         progress=False)
    assert info["num_samples"] == 6 and [s["key"] for s in info["skipped"]] == ["k9"]


# --------------------------------------------------------------------------- one pack at a time


def _pause_after_claim(monkeypatch: pytest.MonkeyPatch, thread_name: str) -> tuple[threading.Event, threading.Event]:
    """Hold the pack running in the thread ``thread_name`` right after it has claimed its
    destination (``sweep_temp`` is the next step of ``pack``), until ``go`` is set."""
    import shardkit.packing.pack as packer

    claimed, go = threading.Event(), threading.Event()
    real = packer.sweep_temp

    def hook(store: Any) -> None:
        if threading.current_thread().name == thread_name:
            claimed.set()
            go.wait(60)
        real(store)

    monkeypatch.setattr(packer, "sweep_temp", hook)
    return claimed, go


def _pack_in_thread(name: str, result: dict[str, Any], *args: Any, **kwargs: Any) -> threading.Thread:
    def run() -> None:
        try:
            result["info"] = shardkit.pack(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            result["error"] = exc

    t = threading.Thread(target=run, name=name)
    t.start()
    return t


def _objects(fs: Any, prefix: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p[len(prefix) + 1:] for p in fs.find(prefix))


def _dataset_objects(ds: Any) -> list[str]:
    return sorted({"dataset.json", "manifest/shards.parquet", *ds.shards.column("path").to_pylist(),
                   *ds.shards.column("samples_file").to_pylist()})


def test_race_overwrite_refused_while_another_pack_runs(tmp_path, s3_server, s3_bucket, monkeypatch):
    """Two ``pack --overwrite`` of different inputs at once on one prefix: the second used to
    overwrite the first's claim and write the same shard names, so the dataset one of them
    committed pointed at shards the other had replaced (every shard failed verify)."""
    a_src = image_folder(tmp_path / "a", count=30, side=64)
    b_src = image_folder(tmp_path / "b", count=20, side=64, seed=1)
    opts = s3_server.storage_options()
    dest = f"{s3_bucket}/ds"
    claimed, go = _pause_after_claim(monkeypatch, "pack-a")
    result: dict[str, Any] = {}
    t = _pack_in_thread("pack-a", result, str(a_src), dest, shard_bytes="20KB", labels_from_dirs=True,
                        overwrite=True, storage_options=opts, progress=False)
    try:
        assert claimed.wait(60), result
        with pytest.raises(DatasetExistsError) as err:
            shardkit.pack(str(b_src), dest, shard_bytes="20KB", labels_from_dirs=True, overwrite=True,
                          storage_options=opts, progress=False)
    finally:
        go.set()
        t.join(120)
    msg = str(err.value)
    assert dest in msg and "active" in msg and "ago" in msg and "\n" not in msg, msg
    assert "error" not in result, result.get("error")
    ds = shardkit.open_dataset(dest, storage_options=opts)
    assert sorted(ds.samples.column("key").to_pylist()) == _source_keys(a_src)
    ds.verify(deep=True)
    assert _objects(s3_server.filesystem(), dest[5:]) == _dataset_objects(ds)


def test_pack_whose_claim_was_taken_over_does_not_commit(tmp_path, s3_server, s3_bucket, monkeypatch):
    """A pack stalled so long that another ``--overwrite`` took its destination over (here:
    every claim counts as stale at once) stops without writing or committing anything more."""
    import shardkit.packing.claim

    a_src = image_folder(tmp_path / "a", count=30, side=64)
    b_src = image_folder(tmp_path / "b", count=20, side=64, seed=1)
    opts = s3_server.storage_options()
    dest = f"{s3_bucket}/ds"
    claimed, go = _pause_after_claim(monkeypatch, "pack-a")
    result: dict[str, Any] = {}
    t = _pack_in_thread("pack-a", result, str(a_src), dest, shard_bytes="20KB", labels_from_dirs=True,
                        storage_options=opts, progress=False)
    try:
        assert claimed.wait(60), result
        monkeypatch.setattr(shardkit.packing.claim, "STALE_SECONDS", 0.0)
        info = shardkit.pack(str(b_src), dest, shard_bytes="20KB", labels_from_dirs=True, overwrite=True,
                             storage_options=opts, progress=False)
    finally:
        go.set()
        t.join(120)
    assert isinstance(result.get("error"), DatasetExistsError), result
    assert "took over" in str(result["error"]) and dest in str(result["error"])
    ds = shardkit.open_dataset(dest, storage_options=opts)
    assert ds.info["created"] == info["created"]
    assert sorted(ds.samples.column("key").to_pylist()) == _source_keys(b_src)
    ds.verify(deep=True)
    assert _objects(s3_server.filesystem(), dest[5:]) == _dataset_objects(ds)


def test_overwrite_of_killed_pack_removes_everything_it_wrote(tmp_path, s3_server, s3_bucket):
    """A pack killed with SIGKILL (no dataset.json), then another input packed there with
    ``--overwrite``: the dead pack's extra shards used to stay under shards/, where
    ``shardkit index`` and outside WebDataset readers found them."""
    src = image_folder(tmp_path / "imgs", count=120, side=64)
    total = sum(p.stat().st_size for p in src.rglob("*.jpg"))
    dest = f"{s3_bucket}/ds"
    env = {**os.environ, **s3_server.env(), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "shardkit.cli", "pack", str(src), dest, "--labels-from-dirs",
           "--shard-size", str(total // 60), "--quiet"]
    fs = s3_server.filesystem()
    _kill_after_shards(cmd, env, fs, dest, 8)
    other = image_folder(tmp_path / "other", count=12, side=64, seed=2)
    opts = s3_server.storage_options()
    with pytest.raises(DatasetExistsError, match="--overwrite"):
        shardkit.pack(str(other), dest, shard_samples=5, labels_from_dirs=True, storage_options=opts, progress=False)
    info = shardkit.pack(str(other), dest, shard_samples=5, labels_from_dirs=True, overwrite=True,
                         storage_options=opts, progress=False)
    assert info["num_shards"] == 3
    ds = shardkit.open_dataset(dest, storage_options=opts)
    assert _objects(fs, dest[5:]) == _dataset_objects(ds)
    ds.verify(deep=True)


def _small_folder(root: Path, n: int = 6) -> Path:
    root.mkdir()
    for i in range(n):
        (root / f"k{i}.bin").write_bytes(bytes([i]) * 100)
    return root


def test_claim_held_elsewhere_is_refused_while_fresh_and_taken_over_when_stale(tmp_path):
    """A claim written by a pack on another machine: only its heartbeat tells whether it runs."""
    import json

    import shardkit.packing.claim

    src = _small_folder(tmp_path / "src")
    dest = tmp_path / "ds"
    (dest / "_pack").mkdir(parents=True)
    (dest / "shards").mkdir()
    (dest / "shards" / "shard-000042.tar").write_bytes(b"left by the other pack")
    claim = {"plan_id": "elsewhere-plan", "token": "t0", "started": time.time() - 600, "heartbeat": time.time() - 5,
             "ended": None, "host": "otherhost", "pid": 1, "machine": "another-machine", "settings": {}}
    (dest / "_pack" / "plan.json").write_text(json.dumps(claim))
    for overwrite, hint in ((True, "rerun in"), (False, "wait for it to finish")):
        with pytest.raises(DatasetExistsError) as err:
            shardkit.pack(str(src), str(dest), shard_samples=2, overwrite=overwrite, progress=False)
        msg = str(err.value)
        assert str(dest) in msg and "last active 5s ago on otherhost, pid 1" in msg and hint in msg, msg
        assert "\n" not in msg
    assert (dest / "shards" / "shard-000042.tar").exists()
    claim["heartbeat"] = time.time() - shardkit.packing.claim.STALE_SECONDS - 1
    (dest / "_pack" / "plan.json").write_text(json.dumps(claim))
    with pytest.raises(DatasetExistsError, match="--overwrite"):
        shardkit.pack(str(src), str(dest), shard_samples=2, progress=False)
    info = shardkit.pack(str(src), str(dest), shard_samples=2, overwrite=True, progress=False)
    assert info["num_shards"] == 3
    left = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert left == ["dataset.json", "manifest/samples-00000.parquet", "manifest/shards.parquet",
                    "shards/shard-000000.tar", "shards/shard-000001.tar", "shards/shard-000002.tar"], left


def test_committed_dataset_holds_only_its_own_shards(tmp_path):
    """Objects under shards/ and manifest/ that are not the pack's own are removed before it
    commits: outside WebDataset readers and ``shardkit index`` take every tar there. Without
    a claim of an earlier pack they are not shardkit's: only ``overwrite`` removes them."""
    src = _small_folder(tmp_path / "src")
    dest = tmp_path / "ds"
    (dest / "shards").mkdir(parents=True)
    (dest / "manifest").mkdir()
    (dest / "shards" / "shard-000099.tar").write_bytes(b"stray")
    (dest / "manifest" / "samples-00077.parquet").write_bytes(b"stray")
    with pytest.raises(DatasetExistsError, match="--overwrite"):
        shardkit.pack(str(src), str(dest), shard_samples=3, progress=False)
    assert (dest / "shards" / "shard-000099.tar").exists() and not (dest / "_pack" / "plan.json").exists()
    shardkit.pack(str(src), str(dest), shard_samples=3, overwrite=True, progress=False)
    ds = shardkit.open_dataset(str(dest))
    left = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert left == _dataset_objects(ds), left
    for iterable in (False, True):  # an iterable pack, and a pack replacing a dataset, as well
        (dest / "shards" / "shard-000099.tar").write_bytes(b"stray")
        items = [{"__key__": f"x{i}", "txt": "y"} for i in range(4)]
        shardkit.pack(items if iterable else str(src), str(dest), shard_samples=3, overwrite=True, progress=False)
        ds = shardkit.open_dataset(str(dest))
        assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == _dataset_objects(ds)


def test_claim_heartbeat_and_release(tmp_path, monkeypatch):
    """The holder refreshes its heartbeat; a claim marked ended (its pack failed) is free at once;
    a holder sees when its claim was taken."""
    import json

    import shardkit.packing.claim
    from shardkit.packing.claim import CLAIM, Claim
    from shardkit.storage.store import Store

    monkeypatch.setattr(shardkit.packing.claim, "HEARTBEAT_SECONDS", 0.05)
    store = Store(str(tmp_path / "ds"))
    a = Claim(store, "plan-a", {"x": 1})
    a.take(overwrite=False)
    first = json.loads(store.read_bytes(CLAIM))["heartbeat"]
    deadline = time.monotonic() + 10
    while json.loads(store.read_bytes(CLAIM))["heartbeat"] == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert json.loads(store.read_bytes(CLAIM))["heartbeat"] > first
    b = Claim(store, "plan-b", {"x": 2})
    with pytest.raises(DatasetExistsError, match="being packed by another pack"):
        b.take(overwrite=True)
    a.release(ended=True)
    b.take(overwrite=True)
    assert not b.resumed and json.loads(store.read_bytes(CLAIM))["token"] == b.token
    with pytest.raises(DatasetExistsError, match="took over"):
        a.check()
    b.check()
    b.release(ended=False)


def test_pack_never_deletes_objects_it_did_not_write(tmp_path, s3_server, s3_bucket):
    """A prefix holding someone's own WebDataset (shards/train-000.tar) and notes under
    manifest/, with no dataset.json and no claim of an earlier pack: the commit's sweep of
    strays used to delete them. The pack (and the iterable pack) now refuses, naming the prefix
    and one object, and leaves everything as it was."""
    fs = s3_server.filesystem()
    opts = s3_server.storage_options()
    dest = f"{s3_bucket}/wds"
    mine = {"shards/train-000.tar": b"\0" * 10240, "manifest/notes.txt": b"mine", "README": b"mine"}
    for rel, data in mine.items():
        fs.pipe_file(f"{dest[5:]}/{rel}", data)
    src = _small_folder(tmp_path / "src")
    for source in (str(src), [{"__key__": "x", "txt": "y"}]):
        with pytest.raises(DatasetExistsError) as err:
            shardkit.pack(source, dest, shard_samples=3, storage_options=opts, progress=False)
        msg = str(err.value)
        assert dest in msg and f"{dest}/shards/train-000.tar and 1 more" in msg and "--overwrite" in msg and "empty prefix" in msg
        assert "\n" not in msg
        assert _objects(fs, dest[5:]) == sorted(mine)  # nothing deleted, no claim left behind
    env = {**os.environ, **s3_server.env(), "PYTHONPATH": str(REPO)}
    cli = subprocess.run([sys.executable, "-m", "shardkit.cli", "pack", str(src), dest, "--quiet"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1 and cli.stderr.count("\n") == 1 and "choose an empty prefix" in cli.stderr, cli.stderr
    assert _objects(fs, dest[5:]) == sorted(mine)
    # Told to, it replaces what is under shards/ and manifest/ (and keeps the rest).
    info = shardkit.pack(str(src), dest, shard_samples=3, overwrite=True, storage_options=opts, progress=False)
    ds = shardkit.open_dataset(dest, storage_options=opts)
    assert info["num_samples"] == 6 and _objects(fs, dest[5:]) == sorted([*_dataset_objects(ds), "README"])


def test_rerun_of_a_failed_pack_still_sweeps_its_leftovers(tmp_path, monkeypatch):
    """An earlier pack's claim (_pack/plan.json) says what is under shards/ is shardkit's: the
    rerun resumes and removes what is not part of the dataset, as before."""
    import shardkit.packing.engines.local as packer

    src = _small_folder(tmp_path / "src")
    dest = tmp_path / "ds"
    real = packer.run_task

    def fails_on_task_1(store: Any, source: Any, plan: Any, *args: Any, **kwargs: Any) -> Any:
        if plan.task == 1:
            raise SourceError("task 1 fails this time")
        return real(store, source, plan, *args, **kwargs)

    monkeypatch.setattr(packer, "run_task", fails_on_task_1)
    with pytest.raises(SourceError, match="task 1"):
        shardkit.pack(str(src), str(dest), shard_bytes=200, progress=False)
    monkeypatch.setattr(packer, "run_task", real)
    assert (dest / "_pack" / "plan.json").exists()
    (dest / "shards" / "shard-000099.tar").write_bytes(b"left by a pack of more shards")
    info = shardkit.pack(str(src), str(dest), shard_bytes=200, progress=False)
    assert info["reused_tasks"] >= 1
    ds = shardkit.open_dataset(str(dest))
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == _dataset_objects(ds)


def _start_upload(fs: Any, path: str) -> None:
    """An incomplete multipart upload of ``path`` (bucket/key) with one part, as a pack killed
    while uploading a shard leaves it."""
    bucket, key = path.split("/", 1)
    up = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"x" * 1024)


def _uploads(fs: Any, bucket: str) -> list[str]:
    return sorted(u["Key"] for u in fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads") or [])


def test_unfinished_multipart_uploads_are_aborted_at_commit_and_overwrite(tmp_path, s3_server, s3_bucket):
    """A pack killed mid-upload left an incomplete multipart upload (parts billed, invisible in
    listings) that neither a successful rerun nor --overwrite removed. The commit, and the
    clearing of an --overwrite, abort those under the dataset's shards/ and manifest/; uploads
    elsewhere (beside the dataset, in another prefix) are not the pack's and stay."""
    fs = s3_server.filesystem()
    opts = s3_server.storage_options()
    bucket = s3_bucket[5:]
    dest = f"{s3_bucket}/ds"
    src = _small_folder(tmp_path / "src")
    stay = [f"{bucket}/ds/other/mine.bin", f"{bucket}/ds2/shards/shard-000001.tar", f"{bucket}/ds-shards.tar"]
    for path in [f"{bucket}/ds/shards/shard-000001.tar", f"{bucket}/ds/manifest/samples-00000.parquet", *stay]:
        _start_upload(fs, path)
    assert len(_uploads(fs, bucket)) == 5
    shardkit.pack(str(src), dest, shard_samples=3, storage_options=opts, progress=False)
    assert _uploads(fs, bucket) == sorted(p.split("/", 1)[1] for p in stay)

    _start_upload(fs, f"{bucket}/ds/shards/shard-000007.tar")

    def boom(sample: Any) -> Any:
        raise SourceError(f"{sample.key}: transform fails")

    with pytest.raises(SourceError, match="transform fails"):
        shardkit.pack(str(src), dest, shard_samples=3, overwrite=True, transform=boom, storage_options=opts,
                      progress=False)
    assert _uploads(fs, bucket) == sorted(p.split("/", 1)[1] for p in stay)


def test_multipart_uploads_not_listable_only_warn(tmp_path, s3_server, s3_bucket, monkeypatch, caplog):
    """A store that cannot list multipart uploads (no permission, not implemented) must not
    fail a pack that is otherwise complete: it is said in a warning."""
    from shardkit.errors import StoragePermissionError
    from shardkit.storage.store import Store

    def denied(self: Any, folders: Any) -> list[str]:
        raise StoragePermissionError("access denied to shards/ (multipart uploads): check credentials (AccessDenied)")

    monkeypatch.setattr(Store, "abort_uploads", denied)
    src = _small_folder(tmp_path / "src")
    with caplog.at_level("WARNING", logger="shardkit.packing.destination"):
        info = shardkit.pack(str(src), f"{s3_bucket}/ds", shard_samples=3, storage_options=s3_server.storage_options(),
                             progress=False)
    assert info["num_samples"] == 6
    assert "could not list or abort unfinished multipart uploads" in caplog.text


def _intact(dest: str, info: dict[str, Any], opts: dict[str, Any] | None = None) -> None:
    ds = shardkit.open_dataset(dest, storage_options=opts)
    assert ds.info["created"] == info["created"] and ds.num_samples == info["num_samples"]
    ds.verify(deep=True)


def test_overwrite_that_cannot_start_leaves_the_old_dataset(tmp_path, s3_server, s3_bucket, monkeypatch):
    """--overwrite removes the old dataset when the pack starts: only once everything that can
    be checked first was (options, source, its listing, the plan, the claim, Ray)."""
    import shardkit.packing.engines.ray
    from shardkit.errors import ConfigError, ShardkitError, SourceNotFoundError

    def unreachable(address: str | None) -> None:
        # As ensure_ray fails on an address nothing answers at; the real one would use the
        # session's local Ray whatever the address if an earlier test started it.
        raise ShardkitError(f"cannot reach Ray at {address}: nothing answers")

    monkeypatch.setattr(shardkit.packing.engines.ray, "ensure_ray", unreachable)
    opts = s3_server.storage_options()
    dest = f"{s3_bucket}/ds"
    src = _small_folder(tmp_path / "src")
    (tmp_path / "empty").mkdir()
    info = shardkit.pack(str(src), dest, shard_samples=3, storage_options=opts, progress=False)
    bad: list[tuple[type[Exception], str, dict[str, Any]]] = [
        (SourceNotFoundError, "does not exist", {"source": str(tmp_path / "missing")}),
        (SourceError, "holds no files", {"source": str(tmp_path / "empty")}),
        (ConfigError, "shard_bytes", {"shard_bytes": "12XB"}),
        (ConfigError, "on_error", {"on_error": "ignore"}),
        (ConfigError, "hdf5_rows", {"hdf5_rows": "x"}),
        (ShardkitError, "cannot reach Ray at 127.0.0.1:1", {"engine": "ray", "ray_address": "127.0.0.1:1"}),
    ]
    for kind, match, kwargs in bad:
        args: dict[str, Any] = {"source": str(src), "shard_samples": 3, **kwargs}
        with pytest.raises(kind, match=match):
            shardkit.pack(args.pop("source"), dest, overwrite=True, storage_options=opts, progress=False, **args)
        _intact(dest, info, opts)
    env = {**os.environ, **s3_server.env(), "PYTHONPATH": str(REPO)}
    for argv in ([str(tmp_path / "missing"), dest], [str(src), dest, "--reencode", "gif:200"]):
        r = subprocess.run([sys.executable, "-m", "shardkit.cli", "pack", *argv, "--overwrite", "--quiet"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "removed" not in r.stderr, r.stderr
        _intact(dest, info, opts)


def test_overwrite_that_fails_later_says_the_old_dataset_was_removed(tmp_path):
    """What cannot be checked before (a bad input met while packing) fails the pack after the
    old dataset is gone: the error says so, and only then."""
    src = _small_folder(tmp_path / "src")
    dest = str(tmp_path / "ds")

    def boom(sample: Any) -> Any:
        if sample.key == "k4":
            raise SourceError("k4: cannot be transformed")
        return sample

    shardkit.pack(str(src), dest, shard_samples=3, progress=False)
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(src), dest, shard_samples=3, overwrite=True, transform=boom, progress=False)
    msg = str(err.value)
    assert (f"k4: cannot be transformed (--on-error skip, on_error='skip', packs the rest and lists such inputs "
            f"in dataset.json); the old dataset at {dest} was removed when this --overwrite pack started") in msg, msg
    assert "\n" not in msg
    # Nothing was committed there now: a failing rerun (even with --overwrite) removes no dataset.
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(src), dest, shard_samples=3, overwrite=True, transform=boom, progress=False)
    assert "was removed" not in str(err.value)
    items = [{"__key__": "a", "txt": "x"}, {"__key__": "a", "txt": "again"}]  # a repeated key fails the pack
    shardkit.pack(str(src), dest, shard_samples=3, overwrite=True, progress=False)
    with pytest.raises(shardkit.errors.ShardkitError, match=f"the old dataset at {dest} was removed"):
        shardkit.pack(items, dest, overwrite=True, progress=False)


def test_pack_never_replaces_an_index_of_the_users_own_tars(tmp_path):
    """``shardkit index`` wrote only a manifest beside someone's tars: a pack there, even with
    --overwrite, would delete the tars under shards/ (their only copy) and is refused."""
    import io
    import tarfile

    from shardkit.cli import main as cli_main

    indexed = tmp_path / "collection"
    (indexed / "shards").mkdir(parents=True)
    tar_path = indexed / "shards" / "my-only-copy-000.tar"
    with tarfile.open(tar_path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(3):
            body = f"sample {i}".encode()
            member = tarfile.TarInfo(f"{i:04d}.txt")
            member.size = len(body)
            tf.addfile(member, io.BytesIO(body))
    original = tar_path.read_bytes()
    info = shardkit.index_tars(str(indexed), progress=False)
    src = _small_folder(tmp_path / "src")
    for overwrite in (False, True):
        with pytest.raises(DatasetExistsError, match="is an index of existing WebDataset tars") as err:
            shardkit.pack(str(src), str(indexed), overwrite=overwrite, progress=False)
        assert "\n" not in str(err.value)
        with pytest.raises(DatasetExistsError, match="is an index of existing WebDataset tars"):
            shardkit.pack([{"__key__": "a", "txt": "x"}], str(indexed), overwrite=overwrite, progress=False)
    assert cli_main(["pack", str(src), str(indexed), "--overwrite", "--quiet"]) == 1
    assert tar_path.read_bytes() == original
    assert sorted(p.name for p in (indexed / "shards").iterdir()) == ["my-only-copy-000.tar"]
    _intact(str(indexed), info)
