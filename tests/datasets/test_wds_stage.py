"""wds_shards as the first stage of a webdataset pipeline."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from torch.utils.data import DataLoader

import shardkit
from shardkit import wds_shards
from shardkit.errors import ConfigError


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    from PIL import Image
    import io

    rng = np.random.default_rng(0)
    data = []
    for i in range(120):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(buf, "PNG")
        data.append({"__key__": f"w{i:04d}", "png": buf.getvalue(), "cls": str(i % 3).encode()})
    url = str(tmp_path_factory.mktemp("wds") / "ds")
    shardkit.pack(iter(data), url, shard_bytes="8KB", progress=False)
    return url


def test_pipeline_matches_shardkit_iterator(ds_url: str, tmp_path: Path) -> None:
    pipe = wds.DataPipeline(wds_shards(ds_url, cache_dir=tmp_path, shuffle=False),
                            wds.tarfile_to_samples(), wds.decode("pil"), wds.batched(16))
    got = [(k, np.asarray(img).tobytes(), c) for b in pipe for k, img, c in zip(b["__key__"], b["png"], b["cls"])]
    ref = [(s["__key__"], np.asarray(s["png"]).tobytes(), s["cls"])
           for s in shardkit.StreamingDataset(ds_url, cache_dir=tmp_path, decode="pil")]
    assert got == ref


def test_shuffled_pipeline_runs(ds_url: str, tmp_path: Path) -> None:
    pipe = wds.DataPipeline(wds_shards(ds_url, cache_dir=tmp_path, shuffle=True, seed=1),
                            wds.tarfile_to_samples(), wds.shuffle(100), wds.decode("pil"), wds.batched(16))
    keys = [k for b in pipe for k in b["__key__"]]
    assert Counter(keys) == Counter(f"w{i:04d}" for i in range(120))


def test_two_ranks_two_workers_cover_shards_once(ds_url: str, tmp_path: Path) -> None:
    n_shards = shardkit.open_dataset(ds_url).num_shards
    urls: list[str] = []
    keys: list[str] = []
    for rank in range(2):
        stage = wds_shards(ds_url, cache_dir=tmp_path, shuffle=True, seed=3, rank=rank, world_size=2)
        pipe = wds.DataPipeline(stage, wds.tarfile_to_samples())
        for s in DataLoader(pipe, batch_size=None, num_workers=2):
            keys.append(s["__key__"])
            urls.append(s["__url__"])
    assert len(set(urls)) == n_shards
    assert Counter(keys) == Counter(f"w{i:04d}" for i in range(120))


def test_persistent_workers_follow_set_epoch(ds_url: str, tmp_path: Path) -> None:
    # Persistent workers keep the stage they were started with: set_epoch in the main
    # process must still reach them, as with workers made anew each epoch.
    orders: dict[bool, list[list[str]]] = {}
    for persistent in (False, True):
        stage = wds_shards(ds_url, cache_dir=tmp_path, shuffle=True, seed=5)
        loader = DataLoader(wds.DataPipeline(stage, wds.tarfile_to_samples()), batch_size=None, num_workers=2,
                            persistent_workers=persistent)
        orders[persistent] = []
        for epoch in range(3):
            stage.set_epoch(epoch)
            orders[persistent].append([s["__key__"] for s in loader])
        del loader  # persistent workers end with their loader
    assert orders[True] == orders[False]
    assert len({tuple(o) for o in orders[True]}) == 3
    assert all(sorted(o) == [f"w{i:04d}" for i in range(120)] for o in orders[True])


def test_numeric_options_are_checked_up_front(ds_url: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^prefetch must be >= 0, got -1$"):
        wds_shards(ds_url, cache_dir=tmp_path, prefetch=-1)
    with pytest.raises(ConfigError, match=r"^seed must be an integer, got '1'$"):
        wds_shards(ds_url, cache_dir=tmp_path, seed="1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^epoch must be an integer, got 1.5$"):
        wds_shards(ds_url, cache_dir=tmp_path).set_epoch(1.5)  # type: ignore[arg-type]


def test_readers_get_whole_shards_round_robin_without_padding(ds_url: str, tmp_path: Path) -> None:
    # As README says: shard counts differ by one where they do not divide evenly; no repeats.
    n = shardkit.open_dataset(ds_url).num_shards
    world = next(w for w in range(3, n) if n % w)
    got = [wds_shards(ds_url, cache_dir=tmp_path, shuffle=True, rank=r, world_size=world).shards()
           for r in range(world)]
    assert sorted(s for g in got for s in g) == list(range(n))
    assert {len(g) for g in got} == {n // world, n // world + 1}


def test_workers_sharing_a_cache_too_small_for_both_read_around_it(ds_url: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Room for 1.5 shards and 2 workers taking turns: each keeps its shard open while the
    # loader waits on the other, which waited for that room (600 s) before. After the room
    # wait, a shard is read into memory and opened by the pipeline as a shardkit-mem URL.
    monkeypatch.setenv("SHARDKIT_ROOM_WAIT", "0.3")
    biggest = max(i.bytes for i in shardkit.open_dataset(ds_url).shard_list)
    stage = wds_shards(ds_url, cache_dir=tmp_path, cache_limit=int(biggest * 1.5), prefetch=0)
    pipe = wds.DataPipeline(stage, wds.tarfile_to_samples(), wds.decode("pil"), wds.batched(4))
    urls: list[str] = []
    got: dict[str, bytes] = {}
    for b in DataLoader(pipe, batch_size=None, num_workers=2, timeout=60):
        urls += b["__url__"]
        got.update((k, np.asarray(img).tobytes()) for k, img in zip(b["__key__"], b["png"]))
    assert len(got) == 120 and len(urls) == 120  # every sample once
    assert any(u.startswith("shardkit-mem://") for u in urls) and any(u.startswith(str(tmp_path)) for u in urls)
    ref = {s["__key__"]: np.asarray(s["png"]).tobytes() for s in shardkit.StreamingDataset(ds_url, decode="pil")}
    assert got == ref


def test_an_in_memory_shard_url_opens_once() -> None:
    from shardkit.datasets import wds as wds_stage

    url = wds_stage._hold_in_memory(memoryview(b"abc" * 5000), "shards/x.tar")
    with wds.gopen(url) as stream:
        assert stream.read() == b"abc" * 5000
    with pytest.raises(FileNotFoundError, match="opens once"):
        wds.gopen(url)
