"""Ray Data into shardkit: ``shardkit.pack(ds, url)`` and ``ds.write_datasink(shardkit.ray.Datasink(url))``
round-trip exactly onto SeaweedFS, a write task killed mid-write and retried adds no sample, a
failed job commits nothing, and ``shardkit.ray`` imports without Ray. Real local Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.errors import SourceError

from test_pack_parts import expected_samples, stored_samples

pytestmark = [pytest.mark.s3, pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]


def _items(n: int = 24) -> list[dict[str, Any]]:
    rng = np.random.default_rng(7)
    return [{"__key__": f"s{i:03d}", "jpg": rng.bytes(int(rng.integers(10, 4000))), "txt": f"caption {i}",
             "cls": i % 5, "emb": rng.standard_normal(4).astype(np.float32)} for i in range(n)]


def _shard_objects(fs: Any, url: str) -> list[str]:
    return sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{url[5:]}/shards", refresh=True))


@pytest.mark.slow
def test_pack_ray_dataset_round_trips(ray_local, s3_server, s3_bucket):
    opts = s3_server.storage_options()
    items = _items()
    ds = ray_local.data.from_items(items, override_num_blocks=4)
    info = shardkit.pack(ds, f"{s3_bucket}/items", engine="ray", shard_samples=4, storage_options=opts,
                         progress=False)
    assert info["tasks"] == 4 and info["num_samples"] == len(items) and info["pack"]["engine"] == "ray"
    assert stored_samples(f"{s3_bucket}/items", opts) == expected_samples([items])
    # The same dataset with the local engine (parts fetched into this process): the same bytes.
    shardkit.pack(ds, f"{s3_bucket}/items-local", shard_samples=4, storage_options=opts, progress=False)
    from test_pack_ray import compare_datasets

    compare_datasets(f"{s3_bucket}/items", f"{s3_bucket}/items-local", opts)

    rng = ray_local.data.range(50, override_num_blocks=3)
    info = shardkit.pack(rng, f"{s3_bucket}/range", engine="ray", storage_options=opts, progress=False)
    assert info["tasks"] >= 3 and info["fields"] == ["id"]  # a part per block (Ray may split more)
    got = stored_samples(f"{s3_bucket}/range", opts)
    assert sorted(int(s["id"]) for s in got.values()) == list(range(50))
    assert {int(k.split("-")[0]) for k in got} == set(range(info["tasks"]))  # default keys: <block>-<row>


@pytest.mark.slow
def test_write_datasink_round_trips_and_commits_once(ray_local, s3_server, s3_bucket):
    opts = s3_server.storage_options()
    items = _items()
    sink = shardkit.ray.Datasink(f"{s3_bucket}/sink", shard_samples=3, storage_options=opts)
    ray_local.data.from_items(items, override_num_blocks=3).write_datasink(sink)
    assert sink.result is not None and sink.result["num_samples"] == len(items)
    assert sink.result["source"] == {"type": "ray_datasink"} and sink.result["pack"]["engine"] == "ray_data"
    assert stored_samples(f"{s3_bucket}/sink", opts) == expected_samples([items])
    ds = shardkit.open_dataset(f"{s3_bucket}/sink", storage_options=opts)
    ds.verify(deep=True)
    fs = s3_server.filesystem()
    assert _shard_objects(fs, f"{s3_bucket}/sink") == sorted(p.rsplit("/", 1)[1] for p in ds.shards.column("path")
                                                               .to_pylist())
    # Nothing staged is left (SeaweedFS may keep the emptied _pack folder itself as an entry).
    assert [p for p in fs.find(f"{s3_bucket[5:]}/sink/_pack") if "/_pack/" in p] == []

    sink = shardkit.ray.Datasink(f"{s3_bucket}/range", storage_options=opts)
    ray_local.data.range(30, override_num_blocks=2).write_datasink(sink)
    got = stored_samples(f"{s3_bucket}/range", opts)
    assert sorted(int(s["id"]) for s in got.values()) == list(range(30))


class DieOnce:
    """A transform that kills its worker at sample ``victim``, the first time only (a marker
    file makes it once), after the task's earlier shards are stored: Ray retries the task."""

    def __init__(self, victim: str, marker: str) -> None:
        self.victim = victim
        self.marker = marker

    def __call__(self, sample: Any) -> Any:
        if sample.key == self.victim and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os._exit(1)
        return sample


@pytest.mark.slow
def test_retried_write_task_adds_no_sample(tmp_path, ray_local, s3_server, s3_bucket):
    ray_local.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    opts = s3_server.storage_options()
    items = _items()
    marker = tmp_path / "died"
    sink = shardkit.ray.Datasink(f"{s3_bucket}/retry", shard_samples=2, storage_options=opts,
                                 transform=DieOnce("s006", str(marker)))
    ray_local.data.from_items(items, override_num_blocks=2).write_datasink(sink)
    assert marker.exists()  # the first attempt died mid-task (after shards of s000..s005 were stored)
    assert stored_samples(f"{s3_bucket}/retry", opts) == expected_samples([items])
    ds = shardkit.open_dataset(f"{s3_bucket}/retry", storage_options=opts)
    assert ds.num_samples == len(items)
    ds.verify(deep=True)
    assert len(_shard_objects(s3_server.filesystem(), f"{s3_bucket}/retry")) == ds.num_shards


class FailAt:
    """A transform that refuses sample ``victim`` (a bad input)."""

    def __init__(self, victim: str) -> None:
        self.victim = victim

    def __call__(self, sample: Any) -> Any:
        if sample.key == self.victim:
            raise SourceError(f"sample {sample.key!r} is corrupt")
        return sample


@pytest.mark.slow
def test_failed_job_commits_nothing(ray_local, s3_server, s3_bucket):
    ray_local.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    opts = s3_server.storage_options()
    url = f"{s3_bucket}/failed"
    sink = shardkit.ray.Datasink(url, shard_samples=2, storage_options=opts, transform=FailAt("s010"))
    with pytest.raises(Exception, match="sample 's010' is corrupt"):
        ray_local.data.from_items(_items(), override_num_blocks=3).write_datasink(sink)
    fs = s3_server.filesystem()
    assert not fs.exists(f"{url[5:]}/dataset.json")
    with pytest.raises(shardkit.errors.DatasetNotFoundError):
        shardkit.open_dataset(url, storage_options=opts)
    # The failed job marked its claim ended: a rerun in this same (live) process goes ahead at once.
    sink = shardkit.ray.Datasink(url, shard_samples=2, storage_options=opts)
    ray_local.data.from_items(_items(), override_num_blocks=3).write_datasink(sink)
    assert stored_samples(url, opts) == expected_samples([_items()])


def test_shardkit_ray_imports_without_ray():
    code = ("import sys; sys.modules['ray'] = None\n"  # as if Ray were not installed
            "import shardkit, shardkit.ray\n"
            "from shardkit.errors import ConfigError\n"
            "try:\n    shardkit.ray.Datasink\nexcept ConfigError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "shardkit.ray.Datasink needs Ray Data: pip install 'shardkit[ray]'"
