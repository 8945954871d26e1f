"""A transform's identity is stable across processes, so a pack with a plain-function transform
resumes after a kill (its plan id held ``repr(fn)``, a memory address, and the identical rerun was
refused as "other settings")."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import shardkit
from shardkit.errors import ConfigError
from shardkit.packing.sample import PackSample
from shardkit.packing.sources import ImageFolderSource
from shardkit.packing.transforms import ImageTransform, describe_transform, named_transform

from test_pack_ray import compare_datasets, image_folder

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def tag(sample: PackSample) -> PackSample:
    """Adds a field; at the key SHARDKIT_TEST_KILL_AT names, kills its own process (SIGKILL) once
    the file SHARDKIT_TEST_KILL_AFTER names exists (earlier tasks' uploads are done)."""
    if sample.key == os.environ.get("SHARDKIT_TEST_KILL_AT"):
        deadline = time.monotonic() + 60
        while not os.path.exists(os.environ["SHARDKIT_TEST_KILL_AFTER"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    return PackSample(sample.key, {**sample.fields, "tag": b"tagged"}, sample.meta)


def make_scale(k: int) -> Any:
    def scale(sample: PackSample) -> PackSample:
        return PackSample(sample.key, {**sample.fields, "k": str(k).encode()}, sample.meta)
    return scale


class Stamp:
    def __init__(self, text: str) -> None:
        self.text = text

    def __call__(self, sample: PackSample) -> PackSample:
        return PackSample(sample.key, {**sample.fields, "stamp": self.text.encode()}, sample.meta)


def _describe_in_new_process() -> dict[str, Any]:
    code = ("import json, functools, test_transform_identity as t\n"
            "from shardkit.packing.transforms import describe_transform as d\n"
            "print(json.dumps([d(t.tag), d(t.make_scale(3)), d(t.Stamp('a')), d(lambda s: s),"
            " d(functools.partial(t.make_scale, 2))]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_identity_is_the_same_in_every_process_and_holds_no_address():
    first, second = _describe_in_new_process(), _describe_in_new_process()
    assert first == second
    assert "0x" not in json.dumps(first)
    assert first[0] == {"callable": "test_transform_identity.tag", "code": first[0]["code"]}
    # here too (a third process, imported as the same module)
    assert describe_transform(tag) == first[0]
    assert describe_transform(make_scale(3)) == first[1]
    assert describe_transform(Stamp("a")) == first[2]


def test_identity_changes_with_the_code_and_the_values_it_uses():
    assert describe_transform(make_scale(3)) != describe_transform(make_scale(4))
    assert describe_transform(Stamp("a")) != describe_transform(Stamp("b"))
    assert describe_transform(lambda s: s) != describe_transform(lambda s: PackSample(s.key, {}, s.meta))
    assert describe_transform(functools.partial(make_scale, 2)) != describe_transform(functools.partial(make_scale, 3))
    assert describe_transform(named_transform("resize-v2", tag)) == {"name": "resize-v2"}
    assert describe_transform(ImageTransform(resize=8)) == {"resize": 8}
    assert describe_transform(None) == {}
    with pytest.raises(ConfigError, match="not callable"):
        describe_transform(42)
    with pytest.raises(ConfigError, match="non-empty"):
        named_transform("", tag)


_PACK = """
import json, sys
import shardkit, test_transform_identity as t
info = shardkit.pack(sys.argv[1], sys.argv[2], shard_bytes="6KB", labels_from_dirs=True, transform=t.tag,
                     progress=False)
print(json.dumps({"reused_tasks": info["reused_tasks"], "tasks": info["tasks"]}))
"""


def test_pack_with_a_function_transform_resumes_after_a_kill(tmp_path):
    src = image_folder(tmp_path / "imgs", count=40, side=24)
    keys = [it.key for it in ImageFolderSource(src).list_items()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}
    dest = tmp_path / "ds"
    killed = subprocess.run([sys.executable, "-c", _PACK, str(src), str(dest)], capture_output=True, text=True,
                            timeout=120, env={**env, "SHARDKIT_TEST_KILL_AT": keys[32],
                                                     "SHARDKIT_TEST_KILL_AFTER": str(dest / "manifest" / "samples-00004.parquet")})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (dest / "_pack" / "plan.json").exists()
    rerun = subprocess.run([sys.executable, "-c", _PACK, str(src), str(dest)], capture_output=True, text=True,
                           timeout=120, env=env)
    assert rerun.returncode == 0, rerun.stderr  # was: "holds an unfinished pack ... with other settings: transform"
    done = json.loads(rerun.stdout)
    assert 0 < done["reused_tasks"] < done["tasks"], done
    shardkit.pack(str(src), str(tmp_path / "clean"), shard_bytes="6KB", labels_from_dirs=True, transform=tag,
                  progress=False)
    compare_datasets(str(dest), str(tmp_path / "clean"))
    assert shardkit.open_dataset(str(dest)).info["pack"]["transform"] == describe_transform(tag)
