"""The fault proxy itself: pass-through (keep-alive, chunked bodies both ways, HEAD,
``Expect: 100-continue``), each fault as a client sees it, the schedule (nth, per object,
methods, seeded probability, limit), and real S3 clients (boto3, s3fs) through it."""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from faultproxy import FAULTS, FaultProxy, Rule

pytestmark = pytest.mark.timeout(60)


def _payload(n: int) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[:n]


class _Upstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.requests: list[tuple[str, str]] = []
        self.store: dict[str, bytes] = {}
        self.mu = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Upstream

    def setup(self) -> None:
        super().setup()
        with self.server.mu:
            self.server.connections += 1

    def log_message(self, *args: Any) -> None:
        pass

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or ""):
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _record(self) -> None:
        with self.server.mu:
            self.server.requests.append((self.command, self.path))

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._record()
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"hello ", b"chunked ", b"world"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        body = self.server.store.get(self.path) or _payload(int(self.path.rsplit("/", 1)[-1] or 0))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802
        self._record()
        self.send_response(200)
        self.send_header("Content-Length", "1234")
        self.end_headers()

    def do_PUT(self) -> None:  # noqa: N802
        body = self._body()
        self._record()
        with self.server.mu:
            self.server.store[self.path] = body
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT  # noqa: N815


@pytest.fixture
def upstream() -> Iterator[_Upstream]:
    server = _Upstream()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def proxy(upstream: _Upstream) -> Iterator[FaultProxy]:
    with FaultProxy(f"http://127.0.0.1:{upstream.server_address[1]}", seed=0) as p:
        yield p


def _conn(proxy: FaultProxy, timeout: float = 10) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=timeout)


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, bytes]:
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, resp.read()


def test_pass_through_keeps_one_connection_alive(proxy: FaultProxy, upstream: _Upstream) -> None:
    conn = _conn(proxy)
    try:
        assert _get(conn, "/data/1000") == (200, _payload(1000))
        assert _get(conn, "/data/0") == (200, b"")
        assert _get(conn, "/chunked") == (200, b"hello chunked world")  # re-framed with a length
        conn.request("HEAD", "/data/5")
        head = conn.getresponse()
        assert head.status == 200 and head.getheader("Content-Length") == "1234" and head.read() == b""
        conn.request("PUT", "/obj", body=iter([b"ab", b"cd", b"ef"]), encode_chunked=True)  # chunked request
        assert conn.getresponse().read() == b""
        conn.request("POST", "/form", body=b"x" * 70_000)
        posted = conn.getresponse()
        assert posted.status == 200 and posted.read() == b""
        assert _get(conn, "/obj") == (200, b"abcdef")
    finally:
        conn.close()
    assert upstream.store["/form"] == b"x" * 70_000
    assert upstream.connections == 1  # keep-alive on both sides
    assert proxy.stats()["connections"] == 1 and proxy.stats()["requests"] == 7
    assert sum(proxy.stats()[f] for f in FAULTS) == 0


def test_expect_100_continue_is_answered_by_the_proxy(proxy: FaultProxy, upstream: _Upstream) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"PUT /e HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(b"hello")
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += s.recv(1000)
        assert reply.startswith(b"HTTP/1.1 200")
    assert upstream.store["/e"] == b"hello"


def _one_faulted_get(proxy: FaultProxy, fault: str, **kw: Any) -> Any:
    proxy.set_rules(Rule(fault, methods=("GET",), path="/data/", nth=(1,), **kw))
    conn = _conn(proxy, timeout=kw.get("stall_seconds", 1) / 4 if fault == "stall" else 10)
    try:
        conn.request("GET", "/data/1000")
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_reset_before_never_reaches_the_server(proxy: FaultProxy, upstream: _Upstream) -> None:
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        _one_faulted_get(proxy, "reset_before")
    assert upstream.requests == [] and proxy.stats()["reset_before"] == 1
    assert proxy.injected == [("reset_before", "GET", "/data/1000")]


def test_reset_mid_cuts_the_body_with_a_reset(proxy: FaultProxy, upstream: _Upstream) -> None:
    # (Linux may drop what was received before the reset: the head, or part of the body.)
    with pytest.raises((ConnectionResetError, http.client.IncompleteRead, http.client.RemoteDisconnected)):
        _one_faulted_get(proxy, "reset_mid", keep=0.3)
    assert upstream.requests == [("GET", "/data/1000")] and proxy.stats()["reset_mid"] == 1


def test_truncate_promises_more_than_it_sends(proxy: FaultProxy) -> None:
    with pytest.raises(http.client.IncompleteRead) as err:
        _one_faulted_get(proxy, "truncate", keep=0.5)
    assert err.value.partial == _payload(1000)[:500] and err.value.expected == 500
    assert proxy.stats()["truncate"] == 1


def test_flip_changes_exactly_one_byte(proxy: FaultProxy) -> None:
    status, body = _one_faulted_get(proxy, "flip")
    want = _payload(1000)
    assert status == 200 and len(body) == len(want)
    diff = [i for i in range(len(want)) if body[i] != want[i]]
    assert len(diff) == 1 and body[diff[0]] == want[diff[0]] ^ 0xFF


@pytest.mark.parametrize("fault,status,code", [("error500", 500, b"InternalError"), ("slowdown", 503, b"SlowDown")])
def test_error_answers_are_s3_errors_and_keep_the_connection(proxy: FaultProxy, upstream: _Upstream, fault: str,
                                                             status: int, code: bytes) -> None:
    proxy.set_rules(Rule(fault, nth=(1,)))
    conn = _conn(proxy)
    try:
        got_status, body = _get(conn, "/data/10")
        assert got_status == status and b"<Code>%s</Code>" % code in body and b"<Resource>/data/10" in body
        assert _get(conn, "/data/10") == (200, _payload(10))  # the same connection, kept alive
    finally:
        conn.close()
    assert upstream.requests == [("GET", "/data/10")] and proxy.stats()[fault] == 1
    assert proxy.stats()["connections"] == 1


def test_stall_holds_the_response_past_a_client_timeout(proxy: FaultProxy, upstream: _Upstream) -> None:
    with pytest.raises(socket.timeout):
        _one_faulted_get(proxy, "stall", stall_seconds=2.0)
    conn = _conn(proxy, timeout=10)
    try:
        assert _get(conn, "/data/1000") == (200, _payload(1000))  # the next request goes through
    finally:
        conn.close()
    assert proxy.stats()["stall"] == 1


def test_drop_loses_the_response_of_an_applied_put(proxy: FaultProxy, upstream: _Upstream) -> None:
    proxy.set_rules(Rule("drop", methods=("PUT", "POST"), nth=(1,)))
    conn = _conn(proxy)
    try:
        conn.request("PUT", "/applied", body=b"payload")
        with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
            conn.getresponse()
    finally:
        conn.close()
    assert upstream.store["/applied"] == b"payload"  # the server applied it
    assert proxy.stats()["drop"] == 1


def test_schedule_nth_per_object_and_methods(proxy: FaultProxy, upstream: _Upstream) -> None:
    proxy.set_rules(Rule("error500", methods=("GET",), path=r"^/data/", nth=(1,), per_path=True),
                    Rule("slowdown", nth=(3,)))
    conn = _conn(proxy)
    statuses = []
    try:
        for path in ("/data/1", "/data/1", "/data/2", "/data/2", "/other/3", "/other/3"):
            statuses.append(_get(conn, path)[0])
        conn.request("PUT", "/data/9", body=b"x")
        put = conn.getresponse()
        statuses.append(put.status)
        put.read()
    finally:
        conn.close()
    # First GET of each /data/ object: 500. The slowdown rule counts every request it sees that
    # the first rule did not take: /data/1 (2nd), /data/2 (2nd), /other/3 -> the third is a 503.
    assert statuses == [500, 200, 500, 200, 503, 200, 200]
    assert proxy.stats()["error500"] == 2 and proxy.stats()["slowdown"] == 1


def test_seeded_probability_is_reproducible_and_limited(upstream: _Upstream) -> None:
    target = f"http://127.0.0.1:{upstream.server_address[1]}"

    def run(seed: int, limit: int | None = None) -> list[str]:
        with FaultProxy(target, [Rule("error500", prob=0.3, limit=limit)], seed=seed) as p:
            conn = _conn(p)
            try:
                for i in range(40):
                    _get(conn, f"/data/{i % 7}")
            finally:
                conn.close()
            return [t for _, _, t in p.injected]

    first = run(1)
    assert 4 <= len(first) <= 24
    assert run(1) == first and run(2) != first
    assert run(1, limit=3) == first[:3]


def test_unknown_fault_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault 'explode'"):
        Rule("explode")


@pytest.mark.s3
def test_boto3_and_s3fs_through_the_proxy(s3_server: Any, s3_bucket: str, fault_proxy: FaultProxy) -> None:
    import boto3
    import s3fs
    from botocore.config import Config

    bucket = s3_bucket.removeprefix("s3://")
    # A 503 on each object's first request and a lost PUT response: both clients retry (their
    # own default retries here), over kept-alive connections, with signed (and chunked) bodies.
    fault_proxy.set_rules(Rule("slowdown", per_path=True, nth=(1,)),
                          Rule("drop", methods=("PUT",), path="dropped", nth=(1,)))
    client = boto3.client("s3", endpoint_url=fault_proxy.endpoint, aws_access_key_id=s3_server.key,
                          aws_secret_access_key=s3_server.secret, region_name="us-east-1",
                          config=Config(retries={"total_max_attempts": 4, "mode": "standard"}))
    body = _payload(300_000)
    client.put_object(Bucket=bucket, Key="a/boto", Body=body)
    client.put_object(Bucket=bucket, Key="a/dropped", Body=b"again")
    assert client.get_object(Bucket=bucket, Key="a/boto")["Body"].read() == body
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **fault_proxy.storage_options(s3_server))
    fs.pipe_file(f"{bucket}/a/s3fs", body[::-1])
    assert fs.cat_file(f"{bucket}/a/s3fs") == body[::-1]
    assert fs.cat_file(f"{bucket}/a/dropped") == b"again"
    stats = fault_proxy.stats()
    assert stats["slowdown"] >= 4 and stats["drop"] == 1
    assert stats["connections"] < stats["requests"]  # keep-alive: connections reused
    assert s3_server.filesystem().cat_file(f"{bucket}/a/boto") == body  # what storage holds
