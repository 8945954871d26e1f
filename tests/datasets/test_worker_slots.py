"""Batches collated in DataLoader workers reach the main process through the workers' shared
slots (shardkit.batch.worker_slots) with the same bytes as by pickling; a plain DataLoader's
workers take turns in whole batches of its size, so it yields the rank's exact order."""

from __future__ import annotations

import gc
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shardkit
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.batch import worker_slots
from shardkit.batch.collate import collate, unpack

pytestmark = pytest.mark.timeout(120)
N = 240


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    # Samples of 20-60 KB: a batch of 16 is well over worker_slots.MIN_BYTES.
    rng = np.random.default_rng(5)
    data = [{"__key__": f"k{i:04d}", "bin": rng.bytes(int(rng.integers(20_000, 60_000))), "cls": b"%d" % (i % 7)}
            for i in range(N)]
    url = str(tmp_path_factory.mktemp("slots") / "ds")
    shardkit.pack(iter(data), url, shard_bytes="1MB", progress=False)
    return url, {d["__key__"]: d["bin"] for d in data}


def contents(batch: dict[str, Any]) -> list[tuple[str, bytes]]:
    return [(k, bytes(b)) for k, b in zip(batch["__key__"], unpack(batch, "bin"))]


def test_plain_dataloader_batches_arrive_in_shared_slots_in_the_ranks_order(
        ds_url: tuple[str, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, content = ds_url
    runs: dict[str, list[dict[str, Any]]] = {}
    for mode in ("slots", "pickled"):
        if mode == "pickled":
            monkeypatch.setenv(worker_slots.SLOTS_ENV, "0")
        loader = DataLoader(StreamingDataset(url, cache_dir=tmp_path), batch_size=16, num_workers=2,
                            collate_fn=collate)
        runs[mode] = []
        for b in loader:
            runs[mode].append({"shared": worker_slots.received(b), "items": contents(b),
                               "index": b["__index__"].copy()})
    assert all(b["shared"] == 2 for b in runs["slots"])  # "bin" and "cls", packed in one slot
    assert not any(b["shared"] for b in runs["pickled"])
    assert [b["items"] for b in runs["slots"]] == [b["items"] for b in runs["pickled"]]
    flat = [kv for b in runs["slots"] for kv in b["items"]]
    assert dict(flat) == content and len(flat) == N
    # The workers learned the loader's batch size: whole batches in turn, the rank's order.
    assert np.array_equal(np.concatenate([b["index"] for b in runs["slots"]]), np.arange(N))


def test_kept_batches_stay_intact_and_dropped_ones_free_their_slots(ds_url: tuple[str, dict[str, bytes]],
                                                                    tmp_path: Path) -> None:
    # A loop keeping every batch holds every slot: workers go on with pickled batches instead
    # of waiting, and no kept batch is overwritten; dropping them frees the slots.
    url, content = ds_url
    kept = list(DataLoader(StreamingDataset(url, cache_dir=tmp_path), batch_size=16, num_workers=2,
                           collate_fn=collate))
    shared = [worker_slots.received(b) > 0 for b in kept]
    assert sum(shared) == 2 * worker_slots.SLOTS and len(kept) > sum(shared)
    got = [kv for b in kept for kv in contents(b)]
    assert dict(got) == content and len(got) == N
    states = [np.frombuffer(m, np.uint8, count=1) for m in worker_slots._MAPS.values()]
    assert states and all(s[0] == 1 for s in states)
    del kept, got
    gc.collect()
    assert all(s[0] == 0 for s in states)  # the finalizers marked every slot free


def test_decoded_batches_of_streaming_dataloader_arrive_as_tensors(ds_url: tuple[str, dict[str, bytes]],
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    url, content = ds_url

    def decode(s: dict[str, Any]) -> dict[str, Any]:
        arr = np.frombuffer(s["bin"][:20_000], np.uint8).reshape(100, 200)
        return {"__key__": s["__key__"], "__index__": s["__index__"], "pix": arr, "cls": int(s["cls"])}

    runs = {}
    for mode in ("slots", "pickled"):
        if mode == "pickled":
            monkeypatch.setenv(worker_slots.SLOTS_ENV, "0")
        loader = StreamingDataLoader(StreamingDataset(url, cache_dir=tmp_path, batch_size=16, decode=decode),
                                     num_workers=2)
        batches = list(loader)
        assert all(isinstance(b["pix"], torch.Tensor) and tuple(b["pix"].shape[1:]) == (100, 200) for b in batches)
        runs[mode] = [(b["__key__"], b["pix"].numpy().copy(), b["cls"].tolist()) for b in batches]
        del batches
    assert len(runs["slots"]) == len(runs["pickled"]) == N // 16
    for (ka, pa, ca), (kb, pb, cb) in zip(runs["slots"], runs["pickled"]):
        assert ka == kb and ca == cb and np.array_equal(pa, pb)
    for keys, pix, _ in runs["slots"]:
        for k, row in zip(keys, pix):
            assert row.tobytes() == content[k][:20_000]


def test_a_slot_array_pickles_as_a_reference_and_frees_its_slot() -> None:
    slots = worker_slots.WorkerSlots(slots=1, smallest=1)
    data, sizes = slots.take([((1000,), np.uint8), ((10, 4), np.int64)])  # type: ignore[misc]
    data[:] = np.arange(1000) % 251
    sizes[:] = 7
    blob = pickle.dumps({"data": data, "sizes": sizes, "view": data[10:20]})
    assert len(blob) < 1000  # references, and the view's own ten bytes
    assert slots.take([((10,), np.uint8)]) is None  # its one slot is in flight
    got = pickle.loads(blob)
    assert not isinstance(got["data"], worker_slots.SlotArray)
    assert np.array_equal(got["data"], np.arange(1000) % 251) and (got["sizes"] == 7).all()
    assert np.array_equal(got["view"], data[10:20])
    del data, sizes, blob
    gc.collect()
    assert slots.busy() == 1  # sent: the receiver's arrays hold it
    del got
    gc.collect()
    assert slots.busy() == 0
    unsent = slots.take([((64,), np.uint8)])
    assert unsent is not None and slots.busy() == 1
    del unsent
    gc.collect()
    assert slots.busy() == 0  # dropped without being sent: freed by the worker itself
    slots.close()
