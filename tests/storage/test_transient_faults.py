"""Transient faults between the readers and SeaweedFS, made by a real proxy on 127.0.0.1.

* A byte flipped in transit in the first GET of a shard: a stream without a cache reads the
  segment again and yields every sample with its own bytes; a byte flipped on storage still
  fails, naming the shard, after a bounded number of reads.
* Connections reset before the response: metadata reads (dataset.json, shards.parquet, the
  samples fragments) retry a reset with the budget of data reads instead of taking it for a
  dead endpoint; a refused connection still fails fast.

The proxy here is the minimum these tests need (HTTP/1.1 with keep-alive, Content-Length and
chunked bodies); ``tests/faultproxy.py`` grows the full one.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import threading
import uuid
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from botocore.exceptions import EndpointConnectionError
from conftest import S3Server

import shardkit
from shardkit import StreamingDataset
from shardkit.errors import IntegrityError, StorageError
from shardkit.storage import retry
from shardkit.storage.retry import attempts_for, is_connect_failure, is_transient, translate

pytestmark = pytest.mark.s3

N = 48


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of ``target`` (keep-alive, one request at a
    time per connection, as boto3 and aiohttp send them).

    Args:
        target: the server's ``http://host:port``.
        reset: called with (method, path) of each request, before it is forwarded: True
            resets the client's connection (RST) instead, and the server never sees it.
        flip: (path regex, object offset): flip that byte in the body of the first GET
            response of a matching path whose range holds the offset.
    """

    def __init__(self, target: str, *, reset: Callable[[str, str], bool] | None = None,
                 flip: tuple[str, int] | None = None) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.reset, self.flip = reset, flip
        self.requests: list[tuple[str, str]] = []
        self.resets = 0
        self.flipped: list[tuple[str, int]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()

    def storage_options(self, server: S3Server) -> dict[str, Any]:
        opts = server.storage_options()
        opts["client_kwargs"] = {**opts["client_kwargs"], "endpoint_url": self.endpoint}
        return opts

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method, path, headers = _parse_head(head)
                body = await _read_body(reader, headers, None)
                self.requests.append((method, path))
                if self.reset is not None and self.reset(method, path):
                    self.resets += 1
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()  # RST: "connection reset by peer" on the client
                    return
                if upstream is None:
                    upstream = await asyncio.open_connection(*self.target)
                up_r, up_w = upstream
                up_w.write(head + body)
                await up_w.drain()
                rhead = await up_r.readuntil(b"\r\n\r\n")
                status = int(rhead.split(b" ", 2)[1])
                _, _, rheaders = _parse_head(rhead, response=True)
                writer.write(rhead)
                if method != "HEAD" and status not in (204, 304) and status >= 200:
                    data = await _read_body(up_r, rheaders, writer)
                    if data is not None:
                        writer.write(self._maybe_flip(method, path, headers, status, data))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went, or the proxy closes
        finally:
            writer.close()
            if upstream is not None:
                upstream[1].close()

    def _maybe_flip(self, method: str, path: str, headers: dict[str, str], status: int, data: bytes) -> bytes:
        if self.flip is None or method != "GET" or status not in (200, 206):
            return data
        pattern, at = self.flip
        if not re.search(pattern, path) or any(p == path for p, _ in self.flipped):
            return data
        m = re.match(r"bytes=(\d+)-", headers.get("range", ""))
        start = int(m.group(1)) if m else 0
        if not start <= at < start + len(data):
            return data
        self.flipped.append((path, at))
        out = bytearray(data)
        out[at - start] ^= 0xFF
        return bytes(out)


def _parse_head(head: bytes, response: bool = False) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    first = lines[0].split(" ")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return ("", "", headers) if response else (first[0], first[1], headers)


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str],
                     relay: asyncio.StreamWriter | None) -> bytes | None:
    """A request's or response's body: by Content-Length (returned), or chunked (relayed as
    it comes when ``relay`` is given, then None)."""
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            size = int(line.split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            out += line + chunk
            if size == 0:
                if chunk != b"\r\n":  # trailers
                    out += await reader.readuntil(b"\r\n\r\n")
                break
        if relay is not None:
            relay.write(bytes(out))
            return None
        return bytes(out)
    return b""


@pytest.fixture
def proxies() -> Iterator[list[FaultProxy]]:
    made: list[FaultProxy] = []
    yield made
    for p in made:
        p.close()


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
    proxy = FaultProxy(s3_server.endpoint, flip=(r"/shards/shard-000000\.tar", at))
    proxies.append(proxy)
    sd = StreamingDataset(url, storage_options=proxy.storage_options(s3_server), batch_size=batch_size)
    if batch_size is None:
        got = {s["__key__"]: bytes(s["bin"]) for s in sd}
    else:
        from shardkit.batch.collate import unpack
        got = {k: bytes(v) for b in sd for k, v in zip(b["__key__"], unpack(b, "bin"))}
    assert len(proxy.flipped) == 1  # the fault happened, once
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
    proxy = FaultProxy(s3_server.endpoint)  # only to count the reads of the rotten shard
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
    left = [4]

    def first_four(method: str, path: str) -> bool:
        left[0] -= 1
        return left[0] >= 0
    proxy = FaultProxy(s3_server.endpoint, reset=first_four)
    proxies.append(proxy)
    ds = shardkit.open_dataset(url, proxy.storage_options(s3_server))
    assert proxy.resets == 4 and ds.num_samples == N
    assert count_retries  # shardkit's retries, not only s3fs's, saw them


def test_a_stream_without_a_cache_opens_and_reads_with_a_fifth_of_requests_reset(s3_server: S3Server, packed: Any,
                                                                          proxies: list[FaultProxy],
                                                                          count_retries: list[int]) -> None:
    url, content = packed
    seen = [0]

    def some(method: str, path: str) -> bool:  # the first four requests (dataset.json), then every sixth
        seen[0] += 1
        return seen[0] <= 4 or seen[0] % 6 == 0
    proxy = FaultProxy(s3_server.endpoint, reset=some)
    proxies.append(proxy)
    got = {s["__key__"]: bytes(s["bin"]) for s in StreamingDataset(url, storage_options=proxy.storage_options(s3_server))}
    assert got == content
    assert proxy.resets >= 6 and any(p.endswith("/shards/shard-000000.tar") for _, p in proxy.requests)


def test_resets_on_every_try_fail_saying_so(s3_server: S3Server, packed: Any, proxies: list[FaultProxy],
                                            count_retries: list[int]) -> None:
    url, _ = packed
    proxy = FaultProxy(s3_server.endpoint, reset=lambda m, p: True)
    proxies.append(proxy)
    with pytest.raises(StorageError, match=r"reset the connection for dataset\.json") as info:
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
