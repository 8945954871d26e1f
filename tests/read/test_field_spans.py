"""A samples manifest whose field spans were edited (pointing at another sample's body, before
the sample, at a negative offset, past the shard's end) is refused on every read path and by
``verify`` (also without ``--deep``), in one line naming the shard, the sample and the field,
instead of handing out another sample's bytes or a truncated field."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardkit
from randomds import pack_random
from shardkit import ShardDataset, StreamingDataset, wds_shards
from shardkit.batch.collate import unpack
from shardkit.errors import IntegrityError, ManifestError

POS = 2  # the sample of shard 0 whose field is edited


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    return pack_random(tmp_path_factory.mktemp("spans"), n=60, max_body=3000, classes=3, shard_bytes="24KB",
                       seed=4, prefix="f")


def _tamper(url: str, how: str) -> str:
    """Edit the ``bin`` span of sample POS of shard 0 in its samples fragment, row groups and
    schema metadata kept; return the sample's key."""
    info = shardkit.open_dataset(url).shard_list[0]
    path = Path(url) / info.samples_file
    pf = pq.ParquetFile(path)
    groups = [pf.read_row_group(g) for g in range(pf.num_row_groups)]
    table = groups[info.samples_row_group]
    fields = table.column("fields").to_pylist()
    mine = next(f for f in fields[POS] if f["name"] == "bin")
    if how == "other_sample":
        mine["offset"] = next(f for f in fields[POS + 1] if f["name"] == "bin")["offset"]
    elif how == "before_sample":
        mine["offset"] = table.column("offset")[POS].as_py() - 100
    elif how == "negative":
        mine["offset"] = -16
    elif how == "past_shard_end":
        mine["size"] = info.bytes
    at = table.schema.get_field_index("fields")
    groups[info.samples_row_group] = table.set_column(at, table.schema.field(at),
                                                      pa.array(fields, table.schema.field(at).type))
    with pq.ParquetWriter(path, pf.schema_arrow) as writer:
        for group in groups:
            writer.write_table(group)
    assert pq.ParquetFile(path).num_row_groups == len(groups)
    return table.column("key")[POS].as_py()


def _bins(batches: Any) -> dict[str, bytes]:
    return {k: bytes(v) for b in batches for k, v in zip(b["__key__"], unpack(b, "bin"))}


def _every(ds: ShardDataset) -> dict[str, bytes]:
    return {s["__key__"]: bytes(s["bin"]) for s in (ds[i] for i in range(len(ds)))}


def _wds(url: str, tmp: Path) -> None:
    """Go through the stage (WebDataset parses the tars itself: no sample bytes to compare)."""
    assert [d["__shard__"] for d in wds_shards(url, cache_dir=tmp)]


READERS: dict[str, Callable[[str, Path], dict[str, bytes] | None]] = {
    "stream-cache": lambda url, tmp: {s["__key__"]: bytes(s["bin"]) for s in StreamingDataset(url, cache_dir=tmp)},
    "stream-no-cache": lambda url, tmp: {s["__key__"]: bytes(s["bin"]) for s in StreamingDataset(url)},
    "raw-batches-cache": lambda url, tmp: _bins(StreamingDataset(url, cache_dir=tmp, batch_size=7)),
    "raw-batches-no-cache": lambda url, tmp: _bins(StreamingDataset(url, batch_size=7)),
    "zero-copy": lambda url, tmp: _bins(StreamingDataset(url, cache_dir=tmp, batch_size=7, zero_copy=True)),
    "random-access": lambda url, tmp: _every(ShardDataset(url)),
    "random-access-cache": lambda url, tmp: _every(ShardDataset(url, cache_dir=tmp, cache_shards=True)),
    "wds-shards": lambda url, tmp: _wds(url, tmp),
    "iter-samples": lambda url, tmp: {s["__key__"]: bytes(s["bin"]) for s in shardkit.open_dataset(url).iter_samples()},
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("how", ["other_sample", "before_sample", "negative", "past_shard_end"])
def test_an_edited_field_span_is_refused_on_every_read_path(base: tuple[str, dict[str, bytes]], tmp_path: Path,
                                                            how: str, reader: str) -> None:
    url = str(tmp_path / "ds")
    shutil.copytree(base[0], url)  # a fresh URL: no manifest copy or memo of another case applies
    key = _tamper(url, how)
    with pytest.raises(ManifestError) as info:
        READERS[reader](url, tmp_path / "cache")
    msg = str(info.value)
    assert f"shard 0 (shards/shard-000000.tar): field 'bin' of sample {key!r} spans bytes" in msg, msg
    assert "outside the sample's" in msg and "\n" not in msg


@pytest.mark.parametrize("deep", [False, True], ids=["verify", "verify-deep"])
@pytest.mark.parametrize("how", ["other_sample", "before_sample", "negative", "past_shard_end"])
def test_verify_names_an_edited_field_span(base: tuple[str, dict[str, bytes]], tmp_path: Path, how: str,
                                           deep: bool) -> None:
    url = str(tmp_path / "ds")
    shutil.copytree(base[0], url)
    key = _tamper(url, how)
    with pytest.raises(IntegrityError) as info:
        shardkit.open_dataset(url, strict=False).verify(deep=deep)
    msg = str(info.value)
    assert f"shard 0 (shards/shard-000000.tar): field 'bin' of sample {key!r} spans bytes" in msg, msg
    assert "shard 0 (shards/shard-000000.tar): shard 0" not in msg and "\n" not in msg


@pytest.mark.parametrize("reader", sorted(READERS))
def test_an_untouched_manifest_reads_on_every_path(base: tuple[str, dict[str, bytes]], tmp_path: Path,
                                                   reader: str) -> None:
    url = str(tmp_path / "ds")
    shutil.copytree(base[0], url)
    got = READERS[reader](url, tmp_path / "cache")
    if got is not None:
        assert got == base[1]
    shardkit.open_dataset(url).verify(deep=False)
