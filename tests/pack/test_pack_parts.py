"""Sources of N parts (``shardkit.Parts``, a list of iterables): exact round trip, the same
dataset from the local and Ray engines, a killed driver's rerun redoing only the parts not
done, and bad parts refused in one line. Real processes, real SIGKILL, real Ray and SeaweedFS.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.errors import SourceError

from test_pack_ray import compare_datasets

REPO = Path(__file__).resolve().parents[2]


def make_part(i: int) -> list[dict[str, Any]]:
    """Part ``i``: samples of every value type, some keyed, some not."""
    rng = np.random.default_rng(i)
    out: list[dict[str, Any]] = []
    for j in range(7):
        sample: dict[str, Any] = {"bin": rng.bytes(int(rng.integers(1, 3000))), "txt": f"part {i} item {j}",
                                  "cls": j % 3, "arr": rng.standard_normal((j + 1, 2)).astype(np.float32)}
        if j % 2:
            sample["__key__"] = f"p{i}-k{j}"
        out.append(sample)
    return out


def _encoded(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, np.ndarray):
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return buf.getvalue()
    return str(value).encode()


def expected_samples(parts: list[list[dict[str, Any]]]) -> dict[str, dict[str, bytes]]:
    """key -> field -> bytes, as the pack must store them (default key ``PPPPP-IIIIIIIII``)."""
    out = {}
    for i, part in enumerate(parts):
        for j, s in enumerate(part):
            out[s.get("__key__", f"{i:05d}-{j:09d}")] = {k: _encoded(v) for k, v in s.items() if k != "__key__"}
    return out


def stored_samples(url: str, opts: dict[str, Any] | None = None) -> dict[str, dict[str, bytes]]:
    ds = shardkit.open_dataset(url, storage_options=opts)
    out = {}
    for s in ds.iter_samples():
        out[s["__key__"]] = {k: v for k, v in s.items() if not k.startswith("__")}
    assert len(out) == ds.num_samples
    return out


def test_parts_round_trip_exactly(tmp_path):
    parts = [make_part(i) for i in range(4)]
    info = shardkit.pack(shardkit.Parts(make_part, 4), str(tmp_path / "ds"), shard_samples=3, progress=False)
    assert info["tasks"] == 4 and info["reused_tasks"] == 0 and info["num_samples"] == 28
    assert info["source"]["type"] == "parts" and info["source"]["parts"] == 4
    ds = shardkit.open_dataset(str(tmp_path / "ds"))
    # Shard names come from the part index; global shard numbers are 0..n-1 in part order.
    paths = ds.shards.column("path").to_pylist()
    assert paths == sorted(paths) and paths[0] == "shards/part-00000-000000.tar" and paths[-1].startswith(
        "shards/part-00003-")
    assert stored_samples(str(tmp_path / "ds")) == expected_samples(parts)
    ds.verify(deep=True)
    # A list of the parts' lists packs the same samples into the same shards.
    shardkit.pack(parts, str(tmp_path / "list"), shard_samples=3, progress=False)
    compare_datasets(str(tmp_path / "ds"), str(tmp_path / "list"), ignore_info=("created", "pack", "source"))


def test_empty_parts_are_kept_out_and_all_empty_refused(tmp_path):
    info = shardkit.pack([[], [{"x": 1}], []], str(tmp_path / "ds"), progress=False)
    assert info["num_samples"] == 1 and info["tasks"] == 3
    with pytest.raises(SourceError, match="no part yielded a sample"):
        shardkit.pack([[], []], str(tmp_path / "none"), progress=False)


def test_duplicate_key_across_parts_refused_in_one_line(tmp_path):
    parts = [[{"__key__": "a", "x": 1}, {"__key__": "b", "x": 2}], [{"__key__": "c", "x": 3}],
             [{"__key__": "b", "x": 4}]]
    with pytest.raises(SourceError) as err:
        shardkit.pack(parts, str(tmp_path / "ds"), progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "duplicate key 'b'" in msg and "part 0 and part 2" in msg, msg
    assert not (tmp_path / "ds" / "dataset.json").exists()


def fails_in_part_2(i: int) -> Any:
    for j in range(5):
        if i == 2 and j == 3:
            raise ValueError("camera offline\nsecond line")
        yield {"x": j}


def test_part_error_names_part_and_item(tmp_path):
    with pytest.raises(SourceError) as err:
        shardkit.pack(shardkit.Parts(fails_in_part_2, 4), str(tmp_path / "ds"), progress=False)
    msg = str(err.value)
    assert msg == "part 2: item 3 (after key '00002-000000002') raised ValueError: camera offline", msg
    with pytest.raises(SourceError, match=r"^part 1: sample '00001-000000000': field 'x' has unsupported type object$"):
        shardkit.pack([[{"x": 1}], [{"x": object()}]], str(tmp_path / "bad"), progress=False)


def test_bad_sample_skipped_is_listed_by_part(tmp_path):
    parts = [[{"x": 1}], [{"x": 2}, {"x": object()}, {"x": 3}]]
    info = shardkit.pack(parts, str(tmp_path / "ds"), on_error="skip", progress=False)
    assert info["num_samples"] == 3
    assert [(s["ref"], s["key"]) for s in info["skipped"]] == [("part 1 item 1", "00001-000000001")]
    assert "unsupported type object" in info["skipped"][0]["reason"]


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.ray
def test_parts_ray_equals_local(ray_local, s3_server, s3_bucket):
    ray_local.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    opts = s3_server.storage_options()
    kw: dict[str, Any] = {"shard_samples": 3, "storage_options": opts, "progress": False}
    ray_info = shardkit.pack(shardkit.Parts(make_part, 5), f"{s3_bucket}/ray", engine="ray", **kw)
    local_info = shardkit.pack(shardkit.Parts(make_part, 5), f"{s3_bucket}/local", engine="local", **kw)
    assert ray_info["pack"]["engine"] == "ray" and local_info["pack"]["engine"] == "local"
    assert ray_info["tasks"] == 5 and ray_info["num_samples"] == 35
    compare_datasets(f"{s3_bucket}/ray", f"{s3_bucket}/local", opts)
    assert stored_samples(f"{s3_bucket}/ray", opts) == expected_samples([make_part(i) for i in range(5)])
    # A part's own error comes back from its Ray task as the same one line.
    with pytest.raises(SourceError) as err:
        shardkit.pack(shardkit.Parts(fails_in_part_2, 3), f"{s3_bucket}/bad", engine="ray", **kw)
    assert str(err.value) == "part 2: item 3 (after key '00002-000000002') raised ValueError: camera offline"


_SCRIPT = """
import json, os, sys, time
import shardkit

RUNS, ENGINE = sys.argv[2], sys.argv[3]

def part(i):
    with open(RUNS, "a") as f:  # one line per part run, in whichever process runs it
        f.write(f"{i}\\n")
    for j in range(4):
        yield {"txt": f"{i}:{j}", "pad": bytes([i]) * (500 + j)}
    time.sleep(0.15)  # slow enough to be killed between parts

info = shardkit.pack(shardkit.Parts(part, 12), sys.argv[1], shard_samples=2, engine=ENGINE, progress=False)
print(json.dumps({k: info[k] for k in ("tasks", "reused_tasks", "num_samples")}))
"""


def _run(script: Path, dest: Path, runs: Path, env: dict[str, str], engine: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(script), str(dest), str(runs), engine], env=env, capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


def _runs(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["local", "ray"])
def test_killed_driver_rerun_redoes_only_the_parts_not_done(tmp_path, engine, request):
    """SIGKILL the driver once 4 of 12 parts are staged; the rerun packs only the others. With
    Ray the driver is attached to a running cluster (as under ``ray job submit``): its tasks
    die with it, and the rerun is another job on the same cluster."""
    script = tmp_path / "pack_parts.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    dest, runs = tmp_path / "ds", tmp_path / "runs.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if engine == "ray":
        env["RAY_ADDRESS"] = request.getfixturevalue("ray_local").get_runtime_context().gcs_address
    proc = subprocess.Popen([sys.executable, str(script), str(dest), str(runs), engine], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    staged = dest / "_pack" / "parts"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            if staged.exists() and len(list(staged.glob("samples-*.parquet"))) >= 4:
                break
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()
    time.sleep(0.5 if engine == "ray" else 0)  # a Ray task of the dead driver may still be stopping
    finished = len(list(staged.glob("samples-*.parquet")))
    assert 4 <= finished < 12 and not (dest / "dataset.json").exists()
    first = _runs(runs)
    runs.unlink()

    info = _run(script, dest, runs, env, engine)
    again = _runs(runs)
    # Only the parts without a staged fragment ran again; every part ran to the end once in all.
    assert info["tasks"] == 12 and info["num_samples"] == 48 and info["reused_tasks"] == finished
    assert len(again) == 12 - finished and sorted(set(first) | set(again)) == list(range(12))

    # Uninterrupted, on the local engine (the engines write the same bytes: test_parts_ray_equals_local).
    assert _run(script, tmp_path / "clean", tmp_path / "clean.txt", env, "local")["reused_tasks"] == 0
    a, _ = compare_datasets(str(dest), str(tmp_path / "clean"))
    a.verify(deep=True)
    assert not (dest / "_pack").exists()
