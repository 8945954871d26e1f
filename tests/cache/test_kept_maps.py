"""Maps of cache files kept from one epoch to the next (zero-copy reads; shardkit.cache.kept_maps)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit import StreamingDataset
from shardkit.cache import kept_maps as keptmaps
from shardkit.errors import ConfigError
from shardkit.cache.kept_maps import KEPT, KeptMaps


@pytest.fixture()
def kept() -> Any:
    KEPT.clear()
    yield KEPT
    KEPT.clear()


def _pack(tmp_path: Path, name: str, n: int = 120) -> tuple[str, int]:
    rng = np.random.default_rng(len(name))
    data = [{"__key__": f"{name}{i:04d}", "bin": rng.bytes(2000 + i)} for i in range(n)]
    url = str(tmp_path / name)
    shardkit.pack(iter(data), url, shard_bytes="64KB", progress=False)
    return url, sum(i.bytes for i in shardkit.open_dataset(url).shard_list)


def _addresses(sd: StreamingDataset) -> tuple[dict[str, int], list[Any]]:
    batches = list(sd)
    return {k: a.ctypes.data for b in batches for k, a in zip(b["__key__"], b["bin"])}, batches


@pytest.mark.parametrize("keep", [True, False])
def test_a_later_epoch_reads_through_the_maps_of_the_first(tmp_path: Path, kept: KeptMaps, keep: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKIT_KEEP_MAPS", "16GiB" if keep else "0")
    url, total = _pack(tmp_path, "a")
    sd = StreamingDataset(url, cache_dir=tmp_path / "cache", batch_size=16, zero_copy=True)
    first, hold_first = _addresses(sd)
    second, hold_second = _addresses(sd)
    assert first.keys() == second.keys()
    if keep:
        # The same bytes at the same addresses: the maps (and their filled page tables) stayed.
        assert first == second
        assert kept.kept_bytes() == total
    else:
        # The first epoch's views are still alive, so its maps are too: new maps, new addresses.
        assert all(first[k] != second[k] for k in first)
        assert kept.kept_bytes() == 0
    del hold_first, hold_second


def test_a_dataset_bigger_than_the_cache_keeps_no_maps(tmp_path: Path, kept: KeptMaps) -> None:
    url, total = _pack(tmp_path, "big")
    sd = StreamingDataset(url, cache_dir=tmp_path / "cache", cache_limit=total // 2, batch_size=16, zero_copy=True)
    assert sum(len(b["__key__"]) for b in sd) == 120
    assert kept.kept_bytes() == 0


def test_maps_of_files_the_cache_evicts_are_dropped(tmp_path: Path, kept: KeptMaps) -> None:
    # Each dataset fits in the cache alone, not both: reading the second evicts the first's
    # files (in this process), and no kept map may hold their disk space.
    url_a, total_a = _pack(tmp_path, "a")
    url_b, total_b = _pack(tmp_path, "b")
    limit = int(max(total_a, total_b) * 1.3)
    for url in (url_a, url_b):
        sd = StreamingDataset(url, cache_dir=tmp_path / "cache", cache_limit=limit, batch_size=16, zero_copy=True)
        assert sum(len(b["__key__"]) for b in sd) == 120
        assert sd.stats()["evictions"] > 0 or url == url_a
    assert 0 < kept.kept_bytes() <= limit
    assert all(os.path.exists(p) for p in kept._maps)


def test_a_replaced_or_deleted_file_loses_its_map_and_the_budget_holds(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    maps = KeptMaps()
    monkeypatch.setenv("SHARDKIT_KEEP_MAPS", "10KB")
    monkeypatch.setattr(keptmaps, "PRUNE_EVERY", 0.0)

    def get(name: str, fill: bytes = b"x") -> Any:
        path = tmp_path / name
        if not path.exists():
            path.write_bytes(fill * 4096)
        fd = os.open(path, os.O_RDONLY)
        try:
            return maps.get(str(path), fd, 4096)
        finally:
            os.close(fd)

    one = get("one")
    assert get("one") is one and one[:1] == b"x"
    tmp = tmp_path / "one.new"  # fetched again: a new file renamed over the old one
    tmp.write_bytes(b"y" * 4096)
    os.replace(tmp, tmp_path / "one")
    again = get("one")
    assert again is not one and again[:1] == b"y" and one.closed
    get("two")
    assert maps.kept_bytes() == 8192
    get("three")  # over 10 KB: the least recently used ("one") goes
    assert maps.kept_bytes() == 8192 and again.closed
    os.unlink(tmp_path / "two")  # evicted by another process
    get("three")
    assert maps.kept_bytes() == 4096
    maps.forget(str(tmp_path / "three"))
    assert maps.kept_bytes() == 0
    monkeypatch.setenv("SHARDKIT_KEEP_MAPS", "0")
    assert get("four") is None and maps.kept_bytes() == 0
    monkeypatch.setenv("SHARDKIT_KEEP_MAPS", "lots")
    with pytest.raises(ConfigError, match="SHARDKIT_KEEP_MAPS"):
        get("five")


def test_a_process_reading_other_data_lets_go_of_deleted_kept_files(tmp_path: Path, kept: KeptMaps,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # The kept files go away (evicted by another process; here the whole cache dir is
    # deleted) and this process goes on reading another dataset without zero-copy: the
    # cache's opens drop the stale maps, so their disk space is not held.
    monkeypatch.setattr(keptmaps, "PRUNE_EVERY", 0.0)
    url_a, _ = _pack(tmp_path, "a")
    url_b, _ = _pack(tmp_path, "b")
    assert sum(len(b["__key__"]) for b in StreamingDataset(url_a, cache_dir=tmp_path / "ca", batch_size=16,
                                                           zero_copy=True)) == 120
    assert kept.kept_bytes() > 0
    shutil.rmtree(tmp_path / "ca")
    assert sum(len(b["__key__"]) for b in StreamingDataset(url_b, cache_dir=tmp_path / "cb", batch_size=16)) == 120
    assert kept.kept_bytes() == 0
