"""Create-only writes (the commit's dataset.json, a pack's claim) recognise their own success.

A lost answer: the fault proxy (tests/faultproxy.py) on 127.0.0.1 in front of SeaweedFS forwards
a PUT, lets the server apply it, and then drops the connection before the answer; the client's retry
is refused (the object exists) and must be recognised as this writer's own success.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import shardkit
from shardkit.errors import DatasetExistsError
from shardkit.packing.create_once import create_once
from shardkit.packing.index import index_tars
from shardkit.storage.store import Store

from faultproxy import FaultProxy, Rule

from test_pack_ray import image_folder


@pytest.fixture
def drop_proxy(s3_server: Any) -> Iterator[Callable[..., FaultProxy]]:
    """Make fault proxies in front of ``s3_server`` whose rules drop answers: each names a
    method, a path suffix and how many of its requests (per object) the server applies while
    the client's connection is aborted instead of answered."""
    proxies: list[FaultProxy] = []

    def make(rules: list[tuple[str, str, int]]) -> FaultProxy:
        drops = [Rule("drop", methods=(method,), path=re.escape(suffix) + r"(\?|$)", per_path=True,
                      nth=tuple(range(1, count + 1))) for method, suffix, count in rules]
        proxies.append(FaultProxy(s3_server.endpoint, drops).start())
        return proxies[-1]

    yield make
    for p in proxies:
        p.stop()


def dropped(proxy: FaultProxy) -> list[tuple[str, str]]:
    """(method, path) of each answer the proxy dropped."""
    return [(method, target.split("?", 1)[0]) for fault, method, target in proxy.injected if fault == "drop"]


# --------------------------------------------------------------------------- lost answers


@pytest.mark.s3
@pytest.mark.parametrize("lost", ["dataset.json", "_pack/plan.json"])
def test_pack_whose_create_answer_is_lost_commits(tmp_path, s3_server, s3_bucket, drop_proxy, lost):
    """The PUT of dataset.json (or of the claim) is applied, its answer lost, the PUT retried:
    the pack commits its own dataset (it reported "another writer committed first", or refused
    itself for 150 s, before)."""
    src = image_folder(tmp_path / "imgs", count=12, side=32)
    proxy = drop_proxy([("PUT", "/" + lost, 1)])
    opts = proxy.storage_options(s3_server)
    dest = f"{s3_bucket}/ds"
    info = shardkit.pack(str(src), dest, shard_bytes="16KB", labels_from_dirs=True, storage_options=opts,
                         progress=False)
    assert dropped(proxy) == [("PUT", f"/{s3_bucket[5:]}/ds/{lost}")], proxy.injected
    assert info["num_samples"] == 12
    direct = s3_server.storage_options()
    ds = shardkit.open_dataset(dest, storage_options=direct)
    assert ds.info == {k: v for k, v in info.items() if k not in ("elapsed_seconds", "reused_tasks", "tasks")}
    ds.verify(deep=True)
    fs = s3_server.filesystem()
    assert not fs.exists(f"{dest[5:]}/_pack/plan.json")  # released, not left behind


@pytest.mark.s3
def test_index_whose_commit_answer_is_lost_commits(tmp_path, s3_server, s3_bucket, drop_proxy):
    src = image_folder(tmp_path / "imgs", count=8, side=32)
    direct = s3_server.storage_options()
    shardkit.pack(str(src), f"{s3_bucket}/packed", shard_bytes="16KB", labels_from_dirs=True,
                  storage_options=direct, progress=False)
    fs = s3_server.filesystem()
    for tar in fs.glob(f"{s3_bucket[5:]}/packed/shards/*.tar"):
        fs.copy(tar, f"{s3_bucket[5:]}/tars/{tar.rsplit('/', 1)[1]}")
    proxy = drop_proxy([("PUT", "/dataset.json", 1), ("PUT", "/_pack/plan.json", 1)])
    info = index_tars(f"{s3_bucket}/tars", progress=False, storage_options=proxy.storage_options(s3_server))
    assert len(dropped(proxy)) == 2, proxy.injected
    ds = shardkit.open_dataset(f"{s3_bucket}/tars", storage_options=direct)
    assert ds.info == info and ds.num_samples == 8
    ds.verify(deep=True)


def test_create_once_refuses_another_writers_object(tmp_path):
    store = Store(str(tmp_path))
    create_once(store, "x.json", b"mine")
    create_once(store, "x.json", b"mine")  # a retry that finds its own bytes: created
    with pytest.raises(DatasetExistsError, match="x.json already exists"):
        create_once(store, "x.json", b"theirs")
    assert (tmp_path / "x.json").read_bytes() == b"mine"
