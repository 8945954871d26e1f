"""The shared-memory batch ring behind StreamingDataLoader's default handoff: the same bytes
as the copy path, slots never reused while a batch still refers to them, no stall when the
training loop keeps batches, and clean fallbacks."""

from __future__ import annotations

import gc
import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.batch.collate import unpack
from shardkit.errors import ConfigError
from shardkit.batch.ring import BatchRing

pytestmark = pytest.mark.timeout(120)
N = 400


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    rng = np.random.default_rng(3)
    data = [{"__key__": f"k{i:04d}", "bin": rng.bytes(int(rng.integers(100, 9000))), "cls": b"%d" % (i % 5)}
            for i in range(N)]
    url = str(tmp_path_factory.mktemp("ring") / "ds")
    shardkit.pack(iter(data), url, shard_bytes="200KB", progress=False)
    return url, {d["__key__"]: d["bin"] for d in data}


def contents(batch: dict[str, Any]) -> list[tuple[str, bytes]]:
    return [(k, bytes(b)) for k, b in zip(batch["__key__"], unpack(batch, "bin"))]


def test_ring_gives_the_copy_paths_batches(ds_url: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, content = ds_url
    runs = {}
    for handoff in ("ring", "copy"):
        loader = StreamingDataLoader(StreamingDataset(url, cache_dir=tmp_path, batch_size=32, shuffle=True, seed=1),
                                     num_workers=2, handoff=handoff)
        runs[handoff] = [contents(b) for b in loader]
        assert (loader._ring is not None) == (handoff == "ring")
    assert runs["ring"] == runs["copy"]
    flat = [kv for batch in runs["ring"] for kv in batch]
    assert dict(flat) == content and len(flat) == N


def test_kept_batches_stay_intact_and_the_loader_never_stalls(ds_url: tuple[str, dict[str, bytes]],
                                                             tmp_path: Path) -> None:
    # A loop that keeps every batch holds every slot: workers must fall back to ordinary
    # batches instead of waiting, and no kept batch may be overwritten by a later one.
    url, content = ds_url
    loader = StreamingDataLoader(StreamingDataset(url, cache_dir=tmp_path, batch_size=16), num_workers=2)
    kept = list(loader)
    ring = loader._ring
    assert ring is not None and ring.busy() == ring.workers * ring.per_worker  # every slot held
    got = [kv for b in kept for kv in contents(b)]
    assert dict(got) == content and len(got) == N
    del kept, got
    gc.collect()
    assert ring.busy() == 0  # dropping the batches frees their slots


def test_slots_are_reused_across_epochs_and_after_an_early_break(ds_url: tuple[str, dict[str, bytes]],
                                                                 tmp_path: Path) -> None:
    url, content = ds_url
    for persistent in (False, True):
        ds = StreamingDataset(url, cache_dir=tmp_path, batch_size=16, shuffle=True)
        loader = StreamingDataLoader(ds, num_workers=2, persistent_workers=persistent)
        for epoch in range(3):
            ds.set_epoch(epoch)
            got = []
            for i, b in enumerate(loader):
                got += contents(b)
                if epoch == 1 and i == 3:
                    break  # abandon the epoch: its queued batches must not leak slots
            if epoch != 1:
                assert dict(got) == content and len(got) == N
        del b
        gc.collect()
        assert loader._ring is not None and loader._ring.busy() == 0


def test_ring_fallbacks_and_errors(ds_url: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, content = ds_url
    decoded = StreamingDataset(url, cache_dir=tmp_path, batch_size=8, decode=lambda s: s)
    with pytest.raises(ConfigError, match="handoff='ring'.*decode=None"):
        StreamingDataLoader(decoded, num_workers=2, handoff="ring")
    spawn = StreamingDataset(url, cache_dir=tmp_path, batch_size=8)
    with pytest.raises(ConfigError, match="forked workers"):
        StreamingDataLoader(spawn, num_workers=1, handoff="ring", multiprocessing_context=mp.get_context("spawn"))
    auto = StreamingDataLoader(StreamingDataset(url, cache_dir=tmp_path, batch_size=8), num_workers=0)
    got = [kv for b in auto for kv in contents(b)]  # no workers: no ring, same data
    assert auto._ring is None and dict(got) == content


def test_ring_slot_arrays_free_the_slot_only_when_all_views_die() -> None:
    ring = BatchRing(workers=1, slots_per_worker=2, slot_bytes=4096)
    slot = ring.acquire(0)
    assert slot is not None
    outs = ring.fields(slot, [100, 7])
    assert outs is not None
    outs[0][:] = 1
    outs[1][:] = 2
    rb = ring.batch(slot, [100, 7], ["a", "b"], {"__key__": ["x"], "a": None, "b": None})
    import pickle

    arrived = pickle.loads(pickle.dumps(rb))  # as the main process receives it
    batch = arrived.to_dict()
    view = batch["a"][10:20]
    del arrived, batch, outs
    gc.collect()
    assert ring.busy() == 1 and bytes(view) == b"\x01" * 10
    del view
    gc.collect()
    assert ring.busy() == 0
    dropped = pickle.loads(pickle.dumps(ring.batch(ring.acquire(0) or 0, [1], ["a"], {"a": None})))
    assert ring.busy() == 1
    del dropped  # a descriptor discarded unread (a reset epoch) frees its slot too
    gc.collect()
    assert ring.busy() == 0
    assert ring.fields(0, [ring.slot_bytes + 1]) is None  # too big: the caller sends it the usual way


def test_a_finished_loaders_ring_serves_the_next_loader_only_when_its_workers_are_gone(
        ds_url: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, content = ds_url

    def loader() -> StreamingDataLoader:
        return StreamingDataLoader(StreamingDataset(url, cache_dir=tmp_path, batch_size=16), num_workers=2)

    first = loader()
    assert len([kv for b in first for kv in contents(b)]) == N
    ring_id = first._ring.id if first._ring is not None else None
    del first
    gc.collect()
    second = loader()
    got = [kv for b in second for kv in contents(b)]
    assert second._ring is not None and second._ring.id == ring_id and dict(got) == content
    it = iter(second)
    next(it)  # abandoned mid-epoch: its workers may still be writing
    del second
    gc.collect()
    third = loader()
    got = [kv for b in third for kv in contents(b)]
    assert third._ring is not None and third._ring.id != ring_id and dict(got) == content
    del it
