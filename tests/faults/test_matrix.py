"""The fault matrix: {each fault of the proxy} x {pack, index, cold streaming with a cache,
streaming without a cache, raw batches, random access, ``wds_shards``}.

Each cell packs or reads a small dataset (48 samples in ~8 shards) through a
:class:`~faultproxy.FaultProxy` in front of SeaweedFS and must end with exactly the samples
packed (their multiset, every byte), and for writes with output byte-identical to the same
pack or index made through no proxy, within a hard timeout: never a hang, never a wrong byte.
The faults are transient, as a real cluster's are, so every cell is expected to recover:

- ``reset_before``, ``reset_mid``, ``truncate``, ``error500``, ``slowdown``: the first two
  requests for every object (per method) get the fault: two in a row, on metadata and data;
- ``stall``: the first request for an object, twice per cell, held 3 s past a 1.5 s read
  timeout;
- ``flip``: the first GET of every shard (``.tar``) gets one byte flipped in transit (for
  ``pack``, the first response of every GET);
- ``drop``: the first PUT/POST for every object is applied by the server and its response
  lost (writes only: readers send none).

A cell that fails by a known shardkit fault is ``xfail(strict=True)`` with the fault named:
when the fix lands the cell passes and the strict xfail turns it red, to be removed.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

import shardkit
from faultproxy import FaultProxy, Rule
from shardkit.packing.index import index_tars

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

N_SAMPLES = 48
SHARD_BYTES = "12KB"
STALL_SECONDS = 3.0
STALL_READ_TIMEOUT = 1.5
# dataset.json keys that differ between two packs of the same data (time, where, how long).
VOLATILE = {"created", "elapsed_seconds", "reused_tasks"}

WRITES = ("pack", "index")
READS = ("stream_cache", "stream_nocache", "raw_batches", "random_access", "wds_shards")
PATHS = WRITES + READS
MATRIX_FAULTS = ("reset_before", "reset_mid", "stall", "truncate", "flip", "error500", "slowdown", "drop")


def rules_for(fault: str, path: str) -> list[Rule]:
    """The schedule of one cell (see the module docstring).

    Args:
        fault: the fault.
        path: the path under test.

    Returns:
        The proxy's rules.
    """
    if fault == "drop":
        return [Rule("drop", methods=("PUT", "POST"), per_path=True, nth=(1,))]
    if fault == "stall":
        return [Rule("stall", per_path=True, nth=(1,), limit=2, stall_seconds=STALL_SECONDS)]
    if fault == "flip":
        return [Rule("flip", methods=("GET",), path="" if path == "pack" else r"\.tar", per_path=True, nth=(1,))]
    return [Rule(fault, per_path=True, nth=(1, 2))]


def samples() -> list[dict[str, Any]]:
    """The packed samples: random bodies of 300 B to 3 KB and a label."""
    rng = np.random.default_rng(23)
    return [{"__key__": f"s{i:04d}", "bin": rng.bytes(int(rng.integers(300, 3000))), "cls": str(i % 5).encode()}
            for i in range(N_SAMPLES)]


def expected() -> Counter[tuple[str, bytes, bytes]]:
    return Counter((s["__key__"], s["bin"], s["cls"]) for s in samples())


class Ref(NamedTuple):
    bucket: str  # s3://<bucket>
    pack_url: str  # the dataset packed through no proxy: read by the read cells
    index_url: str  # its shards indexed in place through no proxy
    fs: Any  # s3fs straight to the server, for setting up and checking


@pytest.fixture(scope="module")
def ref(s3_server: Any) -> Iterator[Ref]:
    fs = s3_server.filesystem()
    bucket = f"faults-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    opts = s3_server.storage_options()
    pack_url, index_url = f"s3://{bucket}/ref-pack", f"s3://{bucket}/ref-index"
    shardkit.pack(iter(samples()), pack_url, shard_bytes=SHARD_BYTES, storage_options=opts, progress=False)
    _copy_shards(fs, pack_url, index_url)
    index_tars(index_url, storage_options=opts, progress=False)
    assert shardkit.open_dataset(pack_url, storage_options=opts).num_shards >= 5
    try:
        yield Ref(f"s3://{bucket}", pack_url, index_url, fs)
    finally:
        try:
            fs.rm(bucket, recursive=True)
        except OSError:
            pass


def _copy_shards(fs: Any, src_url: str, dst_url: str) -> None:
    src, dst = src_url.removeprefix("s3://"), dst_url.removeprefix("s3://")
    for path in fs.find(f"{src}/shards"):
        if path.endswith(".tar"):
            fs.copy(path, f"{dst}/{path[len(src) + 1:]}")
    fs.invalidate_cache()


def _tree(fs: Any, url: str) -> dict[str, bytes]:
    root = url.removeprefix("s3://")
    fs.invalidate_cache()
    return {p[len(root) + 1:]: fs.cat_file(p) for p in fs.find(root)}


def assert_same_output(fs: Any, got_url: str, want_url: str) -> None:
    """Every object under ``got_url`` equals the one under ``want_url``, byte for byte
    (``dataset.json`` up to its time, with its own location read as the other's), and
    nothing more or less is there.

    Args:
        fs: s3fs straight to the server.
        got_url: what the cell wrote.
        want_url: the same written through no proxy.
    """
    got, want = _tree(fs, got_url), _tree(fs, want_url)
    assert sorted(got) == sorted(want), f"objects differ: {sorted(set(got) ^ set(want))}"
    for name in want:
        if name == "dataset.json":
            here, there = got_url.removeprefix("s3://"), want_url.removeprefix("s3://")
            a, b = json.loads(got[name].decode().replace(here, there)), json.loads(want[name])
            assert {k: v for k, v in a.items() if k not in VOLATILE} == \
                   {k: v for k, v in b.items() if k not in VOLATILE}, name
        else:
            assert got[name] == want[name], f"{name} differs from the pack through no proxy"


def check_samples(got: list[tuple[str, bytes, bytes]]) -> None:
    """``got`` holds exactly the packed samples, each once, every byte right (a short message
    naming the keys otherwise).

    Args:
        got: (key, body, label) of every sample read.
    """
    have, want = Counter(got), expected()
    if have == want:
        return
    wrong = sorted({k for k, _, _ in have - want} & {k for k, _, _ in want - have})
    missing = sorted({k for k, _, _ in want - have} - set(wrong))
    extra = sorted({k for k, _, _ in have - want} - set(wrong))
    pytest.fail(f"samples differ: {len(wrong)} with wrong bytes {wrong[:5]}, {len(missing)} missing {missing[:5]}, "
                f"{len(extra)} extra or repeated {extra[:5]}", pytrace=False)


# --------------------------------------------------------------------------- the paths


def _plain(s: dict[str, Any]) -> tuple[str, bytes, bytes]:
    return s["__key__"], bytes(s["bin"]), bytes(s["cls"])


def read_stream(url: str, opts: dict[str, Any], tmp: Path, cached: bool) -> list[tuple[str, bytes, bytes]]:
    ds = shardkit.StreamingDataset(url, cache_dir=tmp / "cache" if cached else None, storage_options=opts)
    return [_plain(s) for s in ds]


def read_raw_batches(url: str, opts: dict[str, Any], tmp: Path) -> list[tuple[str, bytes, bytes]]:
    ds = shardkit.StreamingDataset(url, cache_dir=tmp / "cache", batch_size=8, storage_options=opts)
    out = []
    for batch in shardkit.StreamingDataLoader(ds, num_workers=0):
        for key, body, cls in zip(batch["__key__"], shardkit.unpack(batch, "bin"), shardkit.unpack(batch, "cls")):
            out.append((key, bytes(body), bytes(cls)))
    return out


def read_random_access(url: str, opts: dict[str, Any], tmp: Path) -> list[tuple[str, bytes, bytes]]:
    ds = shardkit.ShardDataset(url, storage_options=opts)
    return [_plain(ds[i]) for i in range(len(ds))]


def read_wds(url: str, opts: dict[str, Any], tmp: Path) -> list[tuple[str, bytes, bytes]]:
    wds = pytest.importorskip("webdataset")
    stage = shardkit.wds_shards(url, cache_dir=tmp / "cache", storage_options=opts)
    return [_plain(s) for s in wds.DataPipeline(stage, wds.tarfile_to_samples())]


READERS: dict[str, Callable[[str, dict[str, Any], Path], list[tuple[str, bytes, bytes]]]] = {
    "stream_cache": lambda url, opts, tmp: read_stream(url, opts, tmp, cached=True),
    "stream_nocache": lambda url, opts, tmp: read_stream(url, opts, tmp, cached=False),
    "raw_batches": read_raw_batches,
    "random_access": read_random_access,
    "wds_shards": read_wds,
}


# --------------------------------------------------------------------------- the cells

# Cells that fail by a shardkit fault: (fault, path) -> (reason, the exception it raises).
KNOWN: dict[tuple[str, str], tuple[str, Any]] = {}


def _cells() -> list[Any]:
    out = []
    for fault in MATRIX_FAULTS:
        for path in PATHS:
            if fault == "drop" and path not in WRITES:
                continue  # readers send no PUT/POST
            marks: list[Any] = []
            if fault == "stall":
                marks.append(pytest.mark.slow)
            if (fault, path) in KNOWN:
                reason, raises = KNOWN[(fault, path)]
                marks.append(pytest.mark.xfail(strict=True, reason=reason, raises=raises))
            out.append(pytest.param(fault, path, marks=marks, id=f"{fault}-{path}"))
    return out


@pytest.fixture
def fresh_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No manifest rows or node-local manifest copies left by earlier cells: every cell reads
    its metadata from storage, through its proxy."""
    import shardkit.read.dataset as dataset_module

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    dataset_module._MEMOS.clear()
    yield
    dataset_module._MEMOS.clear()


@pytest.fixture(autouse=True)
def short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries back off a tenth as long (timing only: the same retries, in the same order), so
    the faults on every object of a cell cost seconds, not tens of seconds."""
    from shardkit.storage import retry

    monkeypatch.setattr(retry, "_BACKOFF_BASE", retry._BACKOFF_BASE / 10)


@pytest.mark.parametrize("fault,path", _cells())
def test_cell(fault: str, path: str, s3_server: Any, ref: Ref, fault_proxy: FaultProxy, tmp_path: Path,
              fresh_reader: None) -> None:
    fault_proxy.set_rules(*rules_for(fault, path))
    opts = fault_proxy.storage_options(s3_server, read_timeout=STALL_READ_TIMEOUT if fault == "stall" else None)
    if path == "pack":
        dest = f"{ref.bucket}/pack-{fault}-{uuid.uuid4().hex[:8]}"
        shardkit.pack(iter(samples()), dest, shard_bytes=SHARD_BYTES, storage_options=opts, progress=False)
        assert_same_output(ref.fs, dest, ref.pack_url)
        got = [_plain(s) for s in shardkit.StreamingDataset(dest, storage_options=s3_server.storage_options())]
    elif path == "index":
        dest = f"{ref.bucket}/index-{fault}-{uuid.uuid4().hex[:8]}"
        _copy_shards(ref.fs, ref.pack_url, dest)
        index_tars(dest, storage_options=opts, progress=False)
        assert_same_output(ref.fs, dest, ref.index_url)
        got = [_plain(s) for s in shardkit.StreamingDataset(dest, storage_options=s3_server.storage_options())]
    else:
        got = READERS[path](ref.pack_url, opts, tmp_path)
    check_samples(got)
    assert fault_proxy.stats()[fault] >= 1, f"no {fault} injected: the schedule missed {path}"
