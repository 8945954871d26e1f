"""ShardWriter and keys: rollover, streamed members, short/long streams, safe keys, odd names."""

from __future__ import annotations

import io
import os
import sys
import tarfile
import uuid
from pathlib import Path
from typing import Iterator

import fsspec
import pytest
import xxhash

import shardkit
from shardkit.errors import SourceError
from shardkit.packing.sample import PackSample, StreamedField, safe_key
from shardkit.storage.store import Store
from shardkit.packing.writer import ShardWriter


@pytest.fixture
def store() -> Iterator[Store]:
    url = f"memory://writer-{uuid.uuid4().hex[:8]}"
    yield Store(url)
    fsspec.filesystem("memory").rm(url, recursive=True)


def sample(i: int, size: int = 1000) -> PackSample:
    return PackSample(f"k{i:04d}", {"bin": bytes([i % 251]) * size, "cls": str(i % 3).encode()})


def members(store: Store, path: str) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(store.read_bytes(path)), mode="r:") as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf]  # type: ignore[union-attr]


def test_rollover_by_bytes_keeps_shards_within_the_limit(store: Store) -> None:
    limit = 8000
    with ShardWriter(store, shard_bytes=limit) as w:
        for i in range(20):
            w.write(sample(i))
    assert len(w.shards) >= 4
    assert [s.shard for s in w.shards] == list(range(len(w.shards)))
    assert sum(s.num_samples for s in w.shards) == len(w.rows) == 20
    for rec in w.shards:
        data = store.read_bytes(rec.path)
        assert len(data) == rec.bytes
        assert xxhash.xxh3_128_hexdigest(data) == rec.checksum
        assert rec.bytes <= limit, rec  # every shard here holds >= 2 samples
    # Greedy: a shard closed only because the next sample did not fit.
    per_sample = 512 + 1024 + 512 + 512  # bin header+body, cls header+body
    for rec in w.shards[:-1]:
        assert rec.bytes + per_sample > limit
    # All samples present, in order, across shards.
    names = [n for rec in w.shards for n, _ in members(store, rec.path)]
    assert names == [f"k{i:04d}.{f}" for i in range(20) for f in ("bin", "cls")]


def test_rollover_by_sample_count_and_oversized_sample(store: Store) -> None:
    with ShardWriter(store, shard_bytes=10**9, shard_samples=3) as w:
        for i in range(10):
            w.write(sample(i))
    assert [s.num_samples for s in w.shards] == [3, 3, 3, 1]
    # A sample bigger than shard_bytes still gets a shard of its own (never dropped, never split).
    with ShardWriter(Store(store.url + "/big"), shard_bytes=2000) as w2:
        w2.write(sample(0, 100))
        w2.write(sample(1, 5000))
        w2.write(sample(2, 100))
    assert [s.num_samples for s in w2.shards] == [1, 1, 1]


def chunked(data: bytes, step: int) -> StreamedField:
    return StreamedField(len(data), lambda: (data[i:i + step] for i in range(0, len(data), step)))


def test_streamed_field_writes_the_same_bytes_as_bytes(tmp_path: Path) -> None:
    big = os.urandom(300_000) + b"tail"
    a, b = Store(str(tmp_path / "a")), Store(str(tmp_path / "b"))
    with ShardWriter(a, shard_bytes=10**6) as wa:
        wa.write(PackSample("x", {"npy": big, "txt": b"hi"}))
    with ShardWriter(b, shard_bytes=10**6) as wb:
        wb.write(PackSample("x", {"npy": chunked(big, 65_536 + 7), "txt": b"hi"}))
    assert a.read_bytes(wa.shards[0].path) == b.read_bytes(wb.shards[0].path)
    assert wa.shards == wb.shards
    assert wa.rows.checksum == wb.rows.checksum and wa.rows.fields == wb.rows.fields
    assert dict(members(b, wb.shards[0].path))["x.npy"] == big


def test_block_checksums_cover_each_mib_of_big_samples_only(tmp_path: Path) -> None:
    from shardkit.format.checksums import BLOCK_BYTES

    big = os.urandom(2 * BLOCK_BYTES + 12_345)
    samples = [("small", {"bin": b"x" * 1000}), ("big", {"npy": big, "txt": b"hi"}),
               ("edge", {"bin": b"e" * (BLOCK_BYTES - 512)})]  # header + body + padding: exactly one block
    a, b = Store(str(tmp_path / "a")), Store(str(tmp_path / "b"))
    with ShardWriter(a, shard_bytes=10**8) as wa:
        for key, fields in samples:
            wa.write(PackSample(key, dict(fields)))
    with ShardWriter(b, shard_bytes=10**8) as wb:  # streamed in chunks that straddle the block bounds
        for key, fields in samples:
            wb.write(PackSample(key, {n: chunked(v, 65_536 + 7) if len(v) > 10**5 else v for n, v in fields.items()}))
    assert wa.rows.blocks == wb.rows.blocks and wa.rows.checksum == wb.rows.checksum
    data = a.read_bytes(wa.shards[0].path)
    small, got, edge = wa.rows.blocks
    assert small is None and wa.rows.size[2] == BLOCK_BYTES and edge is None  # its checksum covers it
    off, size = wa.rows.offset[1], wa.rows.size[1]
    assert got == [xxhash.xxh3_64_intdigest(data[off + k:min(off + k + BLOCK_BYTES, off + size)])
                   for k in range(0, size, BLOCK_BYTES)]
    assert len(got) == 3


@pytest.mark.parametrize("actual", [999, 1001])
def test_streamed_field_with_wrong_length_names_the_member(tmp_path: Path, actual: int) -> None:
    store = Store(str(tmp_path / "ds"))
    bad = StreamedField(1000, lambda: iter([b"a" * (actual // 2), b"b" * (actual - actual // 2)]))
    with pytest.raises(SourceError) as err:
        with ShardWriter(store, shard_bytes=10**6) as w:
            w.write(sample(0))
            w.write(PackSample("broken", {"npy": bad}))
    msg = str(err.value)
    assert "broken.npy" in msg and str(actual if actual < 1000 else "") in msg and "\n" not in msg
    # The aborted shard leaves nothing behind: no shard, no temp file.
    assert [p for p in (tmp_path / "ds").rglob("*") if p.is_file()] == []


def test_abort_on_s3_leaves_no_object(s3_bucket: str, s3_server: object) -> None:
    store = Store(f"{s3_bucket}/abort", s3_server.storage_options())  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(store, shard_bytes=10**6) as w:
            w.write(sample(0))
            raise RuntimeError("boom")
    assert store.glob("shards/*") == []


def test_safe_key_is_deterministic_and_tar_safe() -> None:
    originals = ["cat/img.1.jpg", "cat/img_1_jpg", "cat_img_1_jpg", "a b", "a_b", "a/b", "a.b", "ümlaut",
                 "..", "-", "x" * 300, "x" * 301, b"caf\xe9", "caf\udce9", "plain_key-01"]
    keys = [safe_key(o) for o in originals]
    assert keys == [safe_key(o) for o in originals]  # deterministic
    for k in keys:
        assert k and "." not in k and "/" not in k and "\\" not in k
        assert k.isascii()
    assert safe_key("plain_key-01") == "plain_key-01"  # safe keys are kept as they are
    # Distinct originals never share a key, even when they sanitise alike...
    distinct = [o for o in originals if o != "caf\udce9"]
    assert len({safe_key(o) for o in distinct}) == len(distinct)
    # ...but the same file name given as bytes or as a surrogate-escaped str is one key.
    assert safe_key(b"caf\xe9") == safe_key("caf\udce9")


@pytest.mark.skipif(sys.platform != "linux", reason="needs a filesystem that allows non-UTF-8 names")
def test_non_utf8_file_names_pack_and_read_back(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    raw = os.fsencode(str(src)) + b"/caf\xe9.txt"
    with open(raw, "wb") as f:
        f.write(b"latin-1 name")
    (src / "ok.txt").write_bytes(b"plain")
    (src / "sp ace.txt").write_bytes(b"space")
    info = shardkit.pack(str(src), str(tmp_path / "ds"), progress=False)
    assert info["num_samples"] == 3
    ds = shardkit.open_dataset(str(tmp_path / "ds"))
    got = {s["__key__"]: bytes(s["txt"]) for s in ds.iter_samples()}
    assert sorted(got.values()) == [b"latin-1 name", b"plain", b"space"]
    assert got["ok"] == b"plain"
    assert safe_key(b"caf\xe9") in got
    sources = dict(zip(ds.samples.column("key").to_pylist(), ds.samples.column("source").to_pylist()))
    assert sources[safe_key(b"caf\xe9")].startswith("caf")  # readable original, undecodable byte replaced
    assert ds.verify(deep=True)["ok"]


def test_iterable_with_undecodable_keys(tmp_path: Path) -> None:
    items = [{"__key__": b"caf\xe9", "txt": "bytes key"}, {"__key__": "na\udcefve", "txt": "escaped key"},
             {"__key__": "a.b/c", "txt": "dotted"}]
    shardkit.pack(iter(items), str(tmp_path / "ds"), progress=False)
    ds = shardkit.open_dataset(str(tmp_path / "ds"))
    got = {s["__key__"]: bytes(s["txt"]) for s in ds.iter_samples()}
    assert got == {safe_key(b"caf\xe9"): b"bytes key", safe_key("na\udcefve"): b"escaped key",
                   safe_key("a.b/c"): b"dotted"}
    assert ds.samples.column("source").to_pylist() == ["caf\ufffd", "na\ufffdve", "a.b/c"]


# -- tar headers, S3 parts, upload failures -----------------------------------------------------


def test_member_header_is_byte_identical_to_tarfile() -> None:
    """The fast header path patches a tarfile-built template; tarfile stays the reference."""
    import random

    from shardkit.format.tar import _tarfile_header, member_header

    names = ["", "a", "k0001.jpg", "x" * 99 + ".", "x" * 100, "x" * 101, "ümlaut.jpg", "dir/a.seg.png", "a\x7f\x01"]
    sizes = [0, 1, 511, 512, 65_536, 123_456_789, 8**11 - 1, 8**11, 2**40]
    rng = random.Random(0)
    names += ["".join(rng.choice("abcXYZ019_-.") for _ in range(rng.randint(1, 110))) for _ in range(300)]
    for name in names:
        for size in sizes + [rng.randint(0, 2**34)]:
            assert member_header(name, size) == _tarfile_header(name, size), (name, size)


def _mixed_samples() -> list[PackSample]:
    """Small members and streamed ones whose odd-sized chunks straddle 5 MiB part boundaries."""
    big = os.urandom(7 * 2**20 + 12_345)
    out = [PackSample(f"s{i:03d}", {"bin": os.urandom(40_000 + i), "cls": b"1"}) for i in range(110)]
    out.insert(10, PackSample("big1", {"npy": chunked(big, 3 * 2**20 + 7)}))
    out.insert(30, PackSample("big2", {"npy": chunked(big[::-1], 2**20 - 1), "txt": b"x"}))
    return out  # at 9 MB a shard: two shards of two parts or more, then one of a single PUT


def _write_all(store: Store, samples: list[PackSample], shard_bytes: int) -> ShardWriter:
    with ShardWriter(store, shard_bytes=shard_bytes) as w:
        for s in samples:
            w.write(s)
    return w


def test_s3_parts_single_puts_and_the_s3fs_fallback_write_the_same_bytes(
        tmp_path: Path, s3_bucket: str, s3_server: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.packing import tar_shard

    monkeypatch.setattr(tar_shard, "PART_BYTES", 5 * 2**20)  # the S3 minimum: several parts per shard
    opts = s3_server.storage_options()  # type: ignore[attr-defined]
    samples = _mixed_samples()
    local = _write_all(Store(str(tmp_path / "local")), samples, 9 * 10**6)
    boto = _write_all(Store(f"{s3_bucket}/boto", opts), samples, 9 * 10**6)
    # s3_additional_kwargs are applied by s3fs only: such a store keeps s3fs's writer.
    fallback_store = Store(f"{s3_bucket}/s3fs", {**opts, "s3_additional_kwargs": {"ContentType": "application/x-tar"}})
    assert not fallback_store.boto3_writes() and Store(f"{s3_bucket}/boto", opts).boto3_writes()
    fallback = _write_all(fallback_store, samples, 9 * 10**6)
    assert len(local.shards) >= 3 and local.shards == boto.shards == fallback.shards
    assert local.rows.checksum == boto.rows.checksum and local.rows.fields == boto.rows.fields
    for rec in local.shards:
        data = Store(str(tmp_path / "local")).read_bytes(rec.path)
        assert Store(f"{s3_bucket}/boto", opts).read_bytes(rec.path) == data
        assert fallback_store.read_bytes(rec.path) == data
    client = Store(f"{s3_bucket}/boto", opts).boto3_client()
    bucket = s3_bucket[len("s3://"):]
    etags = [client.head_object(Bucket=bucket, Key=f"boto/{r.path}")["ETag"] for r in boto.shards]
    assert any("-" in e for e in etags), etags  # a multipart upload (shard > one part)...
    assert any("-" not in e for e in etags), etags  # ...and a single PUT (shard <= one part)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


class _FailingClient:
    """A boto3 client whose ``method`` fails (not transiently) for keys ending in ``suffix``."""

    def __init__(self, inner: object, method: str, suffix: str) -> None:
        self.inner, self.method, self.suffix = inner, method, suffix

    def __getattr__(self, name: str) -> object:
        real = getattr(self.inner, name)
        if name != self.method:
            return real

        def fail(**kw: object) -> object:
            if str(kw["Key"]).endswith(self.suffix):
                raise PermissionError("simulated denial")
            return real(**kw)
        return fail


def test_failed_part_aborts_the_upload_and_skips_later_shards(
        s3_bucket: str, s3_server: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.packing import tar_shard
    from shardkit.errors import StoragePermissionError

    monkeypatch.setattr(tar_shard, "PART_BYTES", 5 * 2**20)
    opts = s3_server.storage_options()  # type: ignore[attr-defined]
    store = Store(f"{s3_bucket}/fail", opts)
    real = store.boto3_client()
    monkeypatch.setattr(Store, "boto3_client",
                        lambda self: _FailingClient(real, "upload_part", "shard-000001.tar"))
    with pytest.raises(StoragePermissionError) as err:
        _write_all(store, _mixed_samples(), 9 * 10**6)
    msg = str(err.value)
    assert "shards/shard-000001.tar" in msg and opts["secret"] not in msg and opts["key"] not in msg
    # Shard 0 was complete before the failure; shard 1's multipart upload was aborted and no
    # later shard was started.
    assert store.glob("shards/*") == ["shards/shard-000000.tar"]
    assert real.list_multipart_uploads(Bucket=s3_bucket[len("s3://"):]).get("Uploads", []) == []


def test_uploader_keeps_order_stops_at_the_first_error_and_bounds_bytes_in_flight() -> None:
    import threading

    from shardkit.packing.upload import Uploader

    up = Uploader(max_bytes=10)
    gate = threading.Event()
    done: list[str] = []
    up.submit(lambda: (gate.wait(5), done.append("a")), bytearray(10))
    blocked = threading.Thread(target=lambda: up.submit(lambda: done.append("b"), bytearray(10)))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive() and done == []  # 10 bytes in flight: the next part waits
    gate.set()
    blocked.join(5)
    up.flush()
    assert done == ["a", "b"]

    def boom() -> None:
        raise RuntimeError("boom")

    gate.clear()
    up.submit(lambda: (gate.wait(5), done.append("c")))
    up.submit(boom)
    up.submit(lambda: done.append("skipped"))
    up.submit(lambda: done.append("cleanup"), always=True)
    gate.set()
    with pytest.raises(RuntimeError, match="boom"):
        up.flush()
    with pytest.raises(RuntimeError, match="boom"):
        up.submit(lambda: done.append("late"))
    up.close(check=False)
    assert done == ["a", "b", "c", "cleanup"]


def test_uploader_runs_parallel_jobs_side_by_side_and_ordered_jobs_alone() -> None:
    """Consecutive parallel jobs (S3 parts) run at once; an ordered job (a multipart upload's
    completion, a fragment) starts only once every job before it is done, and the jobs after
    it wait for it."""
    import threading

    from shardkit.packing.upload import Uploader

    up = Uploader(threads=2)
    gate = threading.Event()
    events: list[str] = []
    b_ran = threading.Event()
    up.submit(lambda: (gate.wait(5), events.append("a")), parallel=True)
    up.submit(lambda: (events.append("b"), b_ran.set()), parallel=True)
    assert b_ran.wait(5) and events == ["b"]  # b ran while a was still running
    up.submit(lambda: events.append("c"))  # ordered
    up.submit(lambda: events.append("d"), parallel=True)
    threading.Event().wait(0.3)
    assert events == ["b"]  # c waits for a; d waits for c
    gate.set()
    up.flush()
    assert events == ["b", "a", "c", "d"]
    up.close()


def test_s3_parts_upload_side_by_side_and_land_in_order(
        tmp_path: Path, s3_bucket: str, s3_server: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard of several parts has two of them uploading at once, and the object is still
    the shard's bytes in order (the parts are numbered when queued)."""
    import threading
    import time

    from shardkit.packing import tar_shard

    monkeypatch.setattr(tar_shard, "PART_BYTES", 5 * 2**20)
    opts = s3_server.storage_options()  # type: ignore[attr-defined]
    store = Store(f"{s3_bucket}/side", opts)
    real = store.boto3_client()
    lock = threading.Lock()
    running = [0, 0]  # now, most at once

    class Slow:
        def __getattr__(self, name: str) -> object:
            call = getattr(real, name)
            if name != "upload_part":
                return call

            def upload_part(**kw: object) -> object:
                with lock:
                    running[0] += 1
                    running[1] = max(running)
                time.sleep(0.3)  # long enough for the next part to be queued and started
                try:
                    return call(**kw)
                finally:
                    with lock:
                        running[0] -= 1
            return upload_part

    monkeypatch.setattr(Store, "boto3_client", lambda self: Slow())
    samples = _mixed_samples()
    s3 = _write_all(store, samples, 30 * 10**6)
    local = _write_all(Store(str(tmp_path / "local")), samples, 30 * 10**6)
    assert running[1] == 2
    assert s3.shards == local.shards and s3.rows.checksum == local.rows.checksum
    for rec in local.shards:
        assert store.read_bytes(rec.path) == Store(str(tmp_path / "local")).read_bytes(rec.path)


def test_parts_grow_so_a_huge_shard_fits_in_the_s3_part_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every PARTS_PER_SIZE parts of one shard, its part size doubles (S3 takes 10,000 parts);
    the shard's bytes are the same."""
    from shardkit.packing import tar_shard
    from shardkit.packing.upload import FileTarget

    monkeypatch.setattr(tar_shard, "PART_BYTES", 64 * 2**10)
    monkeypatch.setattr(tar_shard, "PARTS_PER_SIZE", 2)
    sizes: list[int] = []
    queue = FileTarget.queue

    def record(self: FileTarget, uploader: object, part: bytearray, final: bool) -> None:
        sizes.append(len(part))
        queue(self, uploader, part, final)  # type: ignore[arg-type]

    monkeypatch.setattr(FileTarget, "queue", record)
    samples = [PackSample(f"g{i}", {"bin": os.urandom(100_000 + i)}) for i in range(12)]
    grown = _write_all(Store(str(tmp_path / "grown")), samples, 10**9)
    k = 64 * 2**10
    assert sizes[:-1] == [k, k, 2 * k, 2 * k, 4 * k, 4 * k, 8 * k][:len(sizes) - 1] and len(sizes) > 5
    monkeypatch.setattr(tar_shard, "PARTS_PER_SIZE", 10**6)
    plain = _write_all(Store(str(tmp_path / "plain")), samples, 10**9)
    assert grown.shards == plain.shards
    assert Store(str(tmp_path / "grown")).read_bytes(grown.shards[0].path) == \
        Store(str(tmp_path / "plain")).read_bytes(plain.shards[0].path)
