"""A reader holds a bounded part of the sample manifest: fragments beyond
``shardkit.reader.FRAGMENT_BYTES`` are closed least recently used first, and reopened (from the
node's local copy, as a memory map, or from storage) when needed again."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

import shardkit
from shardkit import reader
from shardkit.storage import Store


@pytest.fixture(scope="module")
def many_fragments(tmp_path_factory: pytest.TempPathFactory) -> str:
    src = tmp_path_factory.mktemp("src")
    for i in range(60):
        (src / f"s{i:03d}.bin").write_bytes(bytes([i]) * (1000 + 37 * i))
    dest = str(tmp_path_factory.mktemp("ds") / "ds")
    shardkit.pack(str(src), dest, shard_bytes="6KB", task_bytes="12KB", progress=False)
    return dest


def all_rows(ds: shardkit.Dataset) -> list[pa.Table]:
    return [ds.shard_samples(s) for s in range(ds.num_shards)]


def test_open_fragments_stay_within_their_byte_budget(many_fragments: str, monkeypatch: pytest.MonkeyPatch) -> None:
    want = all_rows(shardkit.open_dataset(many_fragments))  # everything open: the default budget
    files = {i.samples_file for i in shardkit.open_dataset(many_fragments).shard_list}
    assert len(files) >= 5
    sizes = sorted(len(Store(many_fragments).read_bytes(f)) for f in files)
    budget = sizes[0] + sizes[1]
    monkeypatch.setattr(reader, "FRAGMENT_BYTES", budget)
    ds = shardkit.open_dataset(many_fragments)
    for rows, expected in zip(all_rows(ds), want):
        assert rows.equals(expected)
        held = [n for _, n in ds._fragments.values()]
        assert sum(held) <= budget or len(held) == 1  # the one in use always stays
    assert 1 <= len(ds._fragments) <= 2 < len(files)
    monkeypatch.setattr(reader, "FRAGMENT_BYTES", 0)  # below any fragment: only the last one used
    assert [r.equals(e) for r, e in zip(all_rows(ds), want)] == [True] * len(want)
    assert len(ds._fragments) == 1


def test_closed_fragments_reopen_from_the_local_copy(many_fragments: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    want = all_rows(shardkit.open_dataset(many_fragments))
    monkeypatch.setattr(reader, "FRAGMENT_BYTES", 0)
    ds = shardkit.open_dataset(many_fragments)
    ds.manifest_cache = str(tmp_path / "copies")
    assert [r.equals(e) for r, e in zip(all_rows(ds), want)] == [True] * len(want)  # copies made
    read: list[str] = []
    real = Store.read_bytes
    monkeypatch.setattr(Store, "read_bytes", lambda self, rel: read.append(rel) or real(self, rel))
    assert [r.equals(e) for r, e in zip(all_rows(ds), want)] == [True] * len(want)
    assert read == []  # every fragment reopened from its copy, none fetched again
    (_, size), = ds._fragments.values()
    assert size == Path(ds._local_path(next(iter(ds._fragments)))).stat().st_size
