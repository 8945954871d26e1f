"""Transient faults between the readers and SeaweedFS, made by a real proxy on 127.0.0.1.

* A byte flipped in transit in the first GET of a shard: a stream without a cache reads the
  segment again and yields every sample with its own bytes; a byte flipped on storage still
  fails, naming the shard, after a bounded number of reads.
* Connections reset before the response: metadata reads (dataset.json, shards.parquet, the
  samples fragments) retry a reset with the budget of data reads instead of taking it for a
  dead endpoint; a refused connection still fails fast.

The proxy is the fault matrix's (``tests/faultproxy.py``).
"""

from __future__ import annotations

import socket
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import boto3
import numpy as np
import pytest
from botocore.config import Config
from botocore.exceptions import EndpointConnectionError
from conftest import S3Server
from faultproxy import FaultProxy, Rule

import shardkit
from shardkit import StreamingDataset
from shardkit.errors import IntegrityError, StorageError
from shardkit.storage import retry
from shardkit.storage.store import Store
from shardkit.storage.retry import attempts_for, is_connect_failure, is_transient, translate

pytestmark = pytest.mark.s3

N = 48


@pytest.fixture
def proxies() -> Iterator[list[FaultProxy]]:
    made: list[FaultProxy] = []
    yield made
    for p in made:
        p.stop()


def resetting(server: S3Server, nth: tuple[int, ...] = (), prob: float = 0.0) -> FaultProxy:
    """A started proxy that resets (before forwarding) the ``nth`` requests it sees, or each
    with probability ``prob``."""
    return FaultProxy(server.endpoint, [Rule("reset_before", nth=nth, prob=prob)]).start()


@pytest.fixture(scope="module")
def packed(s3_server: S3Server) -> tuple[str, dict[str, bytes]]:
    """A dataset of N samples in several shards, packed straight to SeaweedFS (no proxy)."""
    bucket = f"tf-{uuid.uuid4().hex[:12]}"
    s3_server.filesystem().mkdir(bucket)
    rng = np.random.default_rng(5)
    data = [{"__key__": f"t{i:04d}", "bin": rng.bytes(int(rng.integers(200, 3000)))} for i in range(N)]
    url = f"s3://{bucket}/ds"
    shardkit.pack(iter(data), url, shard_bytes="24KB", storage_options=s3_server.storage_options(), progress=False)
    return url, {d["__key__"]: d["bin"] for d in data}


def _bin_offset(url: str, opts: dict[str, Any], shard: int, pos: int) -> int:
    """The shard offset of a byte in the middle of sample ``pos``'s ``bin`` field."""
    rows = shardkit.open_dataset(url, opts).shard_rows(shard)
    names, offs, sizes = rows.fields(pos)
    i = names.index("bin")
    return int(offs[i]) + int(sizes[i]) // 2


# --------------------------------------------------------------------------- a flipped byte


@pytest.mark.parametrize("batch_size", [None, 5], ids=["samples", "raw-batches"])
def test_a_byte_flipped_in_transit_is_read_again_without_a_cache(s3_server: S3Server, packed: Any,
                                                                 proxies: list[FaultProxy],
                                                                 batch_size: int | None) -> None:
    url, content = packed
    at = _bin_offset(url, s3_server.storage_options(), 0, 2)
    proxy = FaultProxy(s3_server.endpoint, [Rule("flip", methods=("GET",), path=r"/shards/shard-000000\.tar",
                                                 prob=1.0, limit=1, at=at)]).start()
    proxies.append(proxy)
    sd = StreamingDataset(url, storage_options=proxy.storage_options(s3_server), batch_size=batch_size)
    if batch_size is None:
        got = {s["__key__"]: bytes(s["bin"]) for s in sd}
    else:
        from shardkit.batch.collate import unpack
        got = {k: bytes(v) for b in sd for k, v in zip(b["__key__"], unpack(b, "bin"))}
    assert proxy.stats()["flip"] == 1  # the fault happened, once
    assert got == content  # every sample, with its own bytes


def test_a_byte_flipped_on_storage_still_fails_naming_the_shard(s3_server: S3Server, s3_bucket: str,
                                                                proxies: list[FaultProxy]) -> None:
    opts = s3_server.storage_options()
    url = f"{s3_bucket}/rotten"
    rng = np.random.default_rng(6)
    shardkit.pack(iter([{"__key__": f"r{i:03d}", "bin": rng.bytes(1500)} for i in range(12)]), url,
                  shard_bytes="8KB", storage_options=opts, progress=False)
    path = shardkit.open_dataset(url, opts).shard_list[1].path
    at = _bin_offset(url, opts, 1, 0)
    fs = s3_server.filesystem()
    obj = f"{url[len('s3://'):]}/{path}"
    data = bytearray(fs.cat_file(obj))
    data[at] ^= 0xFF
    fs.pipe_file(obj, bytes(data))
    proxy = FaultProxy(s3_server.endpoint).start()  # only to count the reads of the rotten shard
    proxies.append(proxy)
    with pytest.raises(IntegrityError, match=r"shard 1 \(shards/shard-000001\.tar\).*on each of 3 reads.*corrupt on storage") as info:
        list(StreamingDataset(url, storage_options=proxy.storage_options(s3_server)))
    assert "\n" not in str(info.value)
    gets = [p for m, p in proxy.requests if m == "GET" and p.split("?")[0].endswith(path)]
    assert len(gets) == 3  # read three times, then refused


# --------------------------------------------------------------------------- resets


def test_resets_are_told_from_a_dead_endpoint() -> None:
    # aiobotocore (s3fs) wraps a reset after connecting in the same EndpointConnectionError as a
    # refused connect: what it wraps decides.
    reset = EndpointConnectionError(endpoint_url="http://127.0.0.1:9", error=ConnectionResetError(104, "reset by peer"))
    refused = EndpointConnectionError(endpoint_url="http://127.0.0.1:9", error=ConnectionRefusedError(111, "refused"))
    bare = EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
    assert is_transient(reset) and retry.is_reset(reset) and not is_connect_failure(reset)
    assert attempts_for(reset) == retry.RETRY_ATTEMPTS  # the budget of data reads
    for dead in (refused, bare):
        assert is_connect_failure(dead) and not retry.is_reset(dead)
        assert attempts_for(dead) == retry.CONNECT_ATTEMPTS
    assert "reset the connection" in str(translate(reset, "dataset.json", "here"))
    assert "cannot reach storage" in str(translate(refused, "dataset.json", "here"))


@pytest.fixture
def count_retries(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Retries of shardkit's retry loops (their backoff made zero)."""
    seen: list[int] = []
    real = retry.pause_before_retry

    def pause(exc: BaseException, what: str, where: str, failures: int, attempts: int) -> None:
        seen.append(failures)
        real(exc, what, where, failures, attempts)
    monkeypatch.setattr(retry, "pause_before_retry", pause)
    monkeypatch.setattr(retry, "backoff_delay", lambda attempt: 0.0)
    monkeypatch.setattr("shardkit.storage.resumable.pause_before_retry", pause)
    return seen


def test_four_resets_in_a_row_on_metadata_reads_are_retried(s3_server: S3Server, packed: Any,
                                                            proxies: list[FaultProxy], count_retries: list[int]) -> None:
    url, content = packed
    proxy = resetting(s3_server, nth=(1, 2, 3, 4))
    proxies.append(proxy)
    ds = shardkit.open_dataset(url, proxy.storage_options(s3_server))
    assert proxy.stats()["reset_before"] == 4 and ds.num_samples == N
    assert count_retries  # shardkit's retries, not only s3fs's, saw them


def test_a_stream_without_a_cache_opens_and_reads_with_a_fifth_of_requests_reset(s3_server: S3Server, packed: Any,
                                                                          proxies: list[FaultProxy],
                                                                          count_retries: list[int]) -> None:
    url, content = packed
    # The first four requests (dataset.json), then every sixth.
    proxy = resetting(s3_server, nth=(1, 2, 3, 4, *range(6, 6000, 6)))
    proxies.append(proxy)
    got = {s["__key__"]: bytes(s["bin"]) for s in StreamingDataset(url, storage_options=proxy.storage_options(s3_server))}
    assert got == content
    assert proxy.stats()["reset_before"] >= 6
    assert any(p.split("?")[0].endswith("/shards/shard-000000.tar") for _, p in proxy.requests)


def test_resets_on_every_try_fail_saying_so(s3_server: S3Server, packed: Any, proxies: list[FaultProxy],
                                            count_retries: list[int]) -> None:
    url, _ = packed
    proxy = resetting(s3_server, prob=1.0)
    proxies.append(proxy)
    # Opening lists the versions first, then reads dataset.json: the first call fails.
    with pytest.raises(StorageError, match=r"reset the connection for (versions/\*|dataset\.json)") as info:
        shardkit.open_dataset(url, proxy.storage_options(s3_server))
    assert "cannot reach" not in str(info.value) and "\n" not in str(info.value)
    assert len(count_retries) == retry.RETRY_ATTEMPTS - 1


def test_a_refused_connection_still_fails_fast(s3_server: S3Server, packed: Any, count_retries: list[int]) -> None:
    url, _ = packed
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = s3_server.storage_options()
    opts["client_kwargs"] = {**opts["client_kwargs"], "endpoint_url": f"http://127.0.0.1:{port}"}
    with pytest.raises(StorageError, match="cannot reach storage"):
        shardkit.open_dataset(url, opts)
    assert len(count_retries) == retry.CONNECT_ATTEMPTS - 1


# --------------------------------------------------------------------------- manifests


def test_manifest_files_flipped_in_transit_are_read_again(s3_server: S3Server, s3_bucket: str,
                                                          proxies: list[FaultProxy], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The first GET of dataset.json, shards.parquet and every samples fragment gets one byte
    # flipped. Their copies here were uploaded without a stored checksum (as older SDKs and
    # many tools upload), so the client cannot catch the flip on its own: checked against
    # their ETags, each is read again, and the stream is exact.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # no node-local manifest copies of other tests
    opts = s3_server.storage_options()
    url = f"{s3_bucket}/plain"
    rng = np.random.default_rng(8)
    content = {f"m{i:03d}": rng.bytes(int(rng.integers(200, 2000))) for i in range(40)}
    shardkit.pack(iter([{"__key__": k, "bin": v} for k, v in content.items()]), url, shard_bytes="16KB",
                  storage_options=opts, progress=False)
    store = Store(url, opts)
    plain = boto3.client("s3", endpoint_url=s3_server.endpoint, aws_access_key_id=s3_server.key,
                         aws_secret_access_key=s3_server.secret, region_name="us-east-1",
                         config=Config(request_checksum_calculation="when_required"))
    bucket, prefix = store.bucket_key("")
    manifest = ["dataset.json", *("manifest/" + p.rsplit("/manifest/", 1)[1] for p in store.fs.find(store.path("manifest")))]
    for rel in manifest:
        plain.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=store.read_bytes(rel))
        head = plain.head_object(Bucket=bucket, Key=f"{prefix}/{rel}", ChecksumMode="ENABLED")
        assert not any("checksum" in h for h in head["ResponseMetadata"]["HTTPHeaders"]), rel
    proxy = FaultProxy(s3_server.endpoint, [Rule("flip", methods=("GET",), path=r"/(dataset\.json|manifest/)",
                                                 per_path=True, nth=(1,))]).start()
    proxies.append(proxy)
    sd = StreamingDataset(url, storage_options=proxy.storage_options(s3_server))
    assert {s["__key__"]: bytes(s["bin"]) for s in sd} == content
    flipped = {target.split("?")[0].rsplit("/", 1)[1] for fault, _, target in proxy.injected if fault == "flip"}
    assert {"dataset.json", "shards.parquet"} < flipped and any(n.startswith("samples-") for n in flipped)
