"""A fault-injecting HTTP proxy on 127.0.0.1 between S3 clients (s3fs/aiohttp, boto3/urllib3)
and the test S3 server, for the fault matrix (``tests/faults``).

It speaks HTTP/1.1 on both sides: keep-alive connections (one upstream connection per client
connection), request bodies with ``Content-Length`` or ``Transfer-Encoding: chunked``
(forwarded byte for byte, so signatures still hold), ``Expect: 100-continue`` (answered by
the proxy itself), and upstream responses framed by length, by chunks or by the end of the
connection (always re-sent with a ``Content-Length``).

Faults come from :class:`Rule` s on a seeded schedule. A rule matches requests by method and
a regular expression on the request target (path and query) and fires on the Nth matching
request (counted over the rule, or per object with ``per_path=True``) or with a probability.
The decision for a request depends only on the seed, the rule, the object and how many
requests for that object the rule saw before: the same run makes the same faults, whatever
the interleaving of other objects' requests across threads. The first rule that fires wins.

Faults (:data:`FAULTS`):

``reset_before``  the connection is reset (RST) before anything is forwarded: the server never
                  sees the request.
``reset_mid``     the response's head and part of its body are sent, then the connection is reset.
``stall``         the response is held for ``stall_seconds``, then sent whole (a client with a
                  shorter read timeout gives up first).
``truncate``      the head promises the whole body (``Content-Length``), part of it is sent, and
                  the connection is closed cleanly (FIN).
``flip``          one byte of the body is flipped (XOR 0xFF): a corrupt transfer of good data.
``error500``      ``500 InternalError`` with an S3 XML error body; nothing is forwarded.
``slowdown``      ``503 SlowDown`` with an S3 XML error body; nothing is forwarded.
``drop``          the request is forwarded and the server applies it; its response is thrown
                  away and the connection reset (a lost response to a PUT/POST).

:meth:`FaultProxy.stats` counts requests, connections and each fault injected;
:attr:`FaultProxy.injected` lists each injection (fault, method, target).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import re
import socket
import struct
import threading
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

__all__ = ["FAULTS", "Rule", "FaultProxy"]

FAULTS = ("reset_before", "reset_mid", "stall", "truncate", "flip", "error500", "slowdown", "drop")

_HEAD_LIMIT = 1 << 20
_ERRORS = {
    "error500": (500, "Internal Server Error", "InternalError",
                 "We encountered an internal error. Please try again."),
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}


@dataclasses.dataclass
class Rule:
    """When to inject one fault.

    Attributes:
        fault: one of :data:`FAULTS`.
        methods: HTTP methods matched (upper case); empty: any.
        path: a regular expression searched in the request target (path and query).
        nth: 1-based counts of matching requests that get the fault (see ``per_path``).
        prob: the probability that a matching request gets the fault (when ``nth`` is empty).
        per_path: count ``nth`` per object (method and path without the query) instead of
            over the whole rule.
        limit: the most faults this rule injects (None: no bound).
        stall_seconds: how long ``stall`` holds a response.
        keep: the fraction of the body ``reset_mid`` and ``truncate`` send before cutting.
        at: for ``flip``, the object offset of the byte to flip (the request's range decides
            where its body starts); a response whose body does not hold it passes unharmed
            and does not count against ``limit``. None: a random byte of the body.
    """

    fault: str
    methods: tuple[str, ...] = ()
    path: str = ""
    nth: tuple[int, ...] = ()
    prob: float = 0.0
    per_path: bool = False
    limit: int | None = None
    stall_seconds: float = 3.0
    keep: float = 0.5
    at: int | None = None

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; one of {', '.join(FAULTS)}")
        self.methods = tuple(m.upper() for m in self.methods)
        self._pattern = re.compile(self.path)
        self.matched = 0
        self.fired = 0
        self._per_path: Counter[str] = Counter()

    def matches(self, method: str, target: str) -> bool:
        """Whether a request is one this rule is about.

        Args:
            method: the request's method.
            target: its target (path and query).

        Returns:
            True when the method and the path pattern match.
        """
        return (not self.methods or method in self.methods) and bool(self._pattern.search(target))


@dataclasses.dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    head: bytes  # the head as forwarded (Expect removed)
    body: bytes  # raw, as framed by the client

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None


@dataclasses.dataclass
class _Response:
    status: int
    status_line: bytes
    headers: list[tuple[str, str]]
    body: bytes
    bodiless: bool  # a response to HEAD, a 1xx, 204 or 304: headers go verbatim
    close: bool  # the upstream connection ends with this response

    def head(self, content_length: int | None = None, close: bool = False) -> bytes:
        lines = [self.status_line]
        for k, v in self.headers:
            low = k.lower()
            if not self.bodiless and low in ("content-length", "transfer-encoding"):
                continue
            if close and low == "connection":
                continue
            lines.append(f"{k}: {v}".encode("latin-1"))
        if not self.bodiless:
            lines.append(b"Content-Length: %d" % (len(self.body) if content_length is None else content_length))
        if close:
            lines.append(b"Connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n"


def _body_start(request: _Request) -> int:
    """The object offset a GET's body starts at (its ``Range: bytes=N-``; 0 without one)."""
    match = re.match(r"bytes=(\d+)-", request.header("range") or "")
    return int(match.group(1)) if match else 0


def _parse_headers(lines: list[bytes]) -> list[tuple[str, str]]:
    out = []
    for line in lines:
        if not line:
            continue
        name, _, value = line.decode("latin-1").partition(":")
        out.append((name.strip(), value.strip()))
    return out


def _get(headers: list[tuple[str, str]], name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


async def _read_chunked(reader: asyncio.StreamReader, raw: bool) -> bytes:
    """A chunked body: the raw framing (``raw``) or the data alone."""
    parts: list[bytes] = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if raw:
            parts.append(size_line)
        if size == 0:
            while True:  # trailers, up to the empty line
                trailer = await reader.readuntil(b"\r\n")
                if raw:
                    parts.append(trailer)
                if trailer == b"\r\n":
                    return b"".join(parts)
        data = await reader.readexactly(size + 2)
        parts.append(data if raw else data[:-2])


class FaultProxy:
    """The proxy: an asyncio server on 127.0.0.1 in a daemon thread of its own.

    Args:
        target: the upstream endpoint, ``http://host:port``.
        rules: the schedule (see :class:`Rule`); replaced with :meth:`set_rules`.
        seed: the schedule's seed.
    """

    def __init__(self, target: str, rules: list[Rule] | tuple[Rule, ...] = (), seed: int = 0) -> None:
        parts = urlsplit(target if "://" in target else f"http://{target}")
        assert parts.hostname and parts.port, target
        self.target = (parts.hostname, parts.port)
        self.seed = seed
        self.rules: list[Rule] = list(rules)
        self.injected: list[tuple[str, str, str]] = []
        self.requests: list[tuple[str, str]] = []  # (method, target) of every request, in order
        self._counts: Counter[str] = Counter()
        self._mu = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.port = 0

    # ------------------------------------------------------------------ control

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>`` (once started)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        """Start serving (returns once the port is bound).

        Returns:
            The proxy itself.
        """
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._serve, "127.0.0.1", 0, limit=_HEAD_LIMIT))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="faultproxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start within 10 s")
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        """Close the listener and every connection, end the thread (waits up to 10 s)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=5)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def set_rules(self, *rules: Rule, seed: int | None = None) -> None:
        """Replace the schedule (and, given, its seed); counts of faults injected are kept.

        Args:
            rules: the new rules (none: pass everything through).
            seed: a new seed.
        """
        with self._mu:
            self.rules = list(rules)
            if seed is not None:
                self.seed = seed

    def stats(self) -> dict[str, int]:
        """What the proxy saw and did so far.

        Returns:
            ``requests``, ``connections`` and one count per fault in :data:`FAULTS`.
        """
        with self._mu:
            out = {"requests": self._counts["requests"], "connections": self._counts["connections"]}
            out.update({f: self._counts[f] for f in FAULTS})
        return out

    def storage_options(self, server: Any, read_timeout: float | None = None) -> dict[str, Any]:
        """shardkit/s3fs ``storage_options`` reaching ``server`` through this proxy.

        Args:
            server: the :class:`~shardkit.dev.devserver.S3Server` behind the proxy.
            read_timeout: seconds without a byte before a client gives up a request.

        Returns:
            ``server.storage_options()`` with this proxy as the endpoint.
        """
        opts = server.storage_options()
        opts["client_kwargs"] = {**opts.get("client_kwargs", {}), "endpoint_url": self.endpoint}
        if read_timeout is not None:
            opts["config_kwargs"] = {"read_timeout": read_timeout, "connect_timeout": 5}
        return opts

    def env(self, server: Any) -> dict[str, str]:
        """The ``AWS_*`` variables reaching ``server`` through this proxy.

        Args:
            server: the :class:`~shardkit.dev.devserver.S3Server` behind the proxy.

        Returns:
            ``server.env()`` with ``AWS_ENDPOINT_URL`` set to this proxy.
        """
        return {**server.env(), "AWS_ENDPOINT_URL": self.endpoint}

    # ------------------------------------------------------------------ schedule

    def _decide(self, method: str, target: str) -> tuple[Rule, random.Random] | None:
        """The rule that fires for this request (counted), and a generator for its details."""
        path = target.split("?", 1)[0]
        with self._mu:
            self._counts["requests"] += 1
            self.requests.append((method, target))
            for index, rule in enumerate(self.rules):
                if not rule.matches(method, target):
                    continue
                rule.matched += 1
                key = f"{method} {path}"
                rule._per_path[key] += 1
                occurrence = rule._per_path[key]
                rng = random.Random(f"{self.seed}|{index}|{key}|{occurrence}")
                if rule.limit is not None and rule.fired >= rule.limit:
                    continue
                if rule.nth:
                    fire = (occurrence if rule.per_path else rule.matched) in rule.nth
                else:
                    fire = rng.random() < rule.prob
                if fire:
                    rule.fired += 1
                    return rule, rng
        return None

    def _count(self, fault: str, method: str, target: str) -> None:
        with self._mu:
            self._counts[fault] += 1
            self.injected.append((fault, method, target))

    # ------------------------------------------------------------------ serving

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._mu:
            self._counts["connections"] += 1
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                request = await self._read_request(creader, cwriter)
                if request is None:
                    return
                decision = self._decide(request.method, request.target)
                rule, rng = decision if decision else (None, None)
                fault = rule.fault if rule else None
                client_close = (request.header("connection") or "").lower() == "close"
                if fault in _ERRORS:
                    assert rule is not None
                    self._count(fault, request.method, request.target)
                    cwriter.write(self._error(fault, request))
                    await cwriter.drain()
                    if client_close:
                        return
                    continue
                if fault == "reset_before":
                    self._count(fault, request.method, request.target)
                    self._reset(cwriter)
                    return
                for attempt in (1, 2):
                    reused = upstream is not None
                    if upstream is None:
                        upstream = await asyncio.open_connection(*self.target, limit=_HEAD_LIMIT)
                    ureader, uwriter = upstream
                    try:
                        uwriter.write(request.head + request.body)
                        await uwriter.drain()
                        response = await self._read_response(ureader, request.method)
                        break
                    except (ConnectionError, asyncio.IncompleteReadError) as exc:
                        # A kept-alive upstream connection the server closed while idle: not
                        # a fault of ours to pass on; the request goes again on a new one.
                        partial = getattr(exc, "partial", b"")
                        uwriter.close()
                        upstream = None
                        if not reused or partial or attempt == 2:
                            raise
                while 100 <= response.status < 200:  # interim responses go as they are
                    cwriter.write(response.head())
                    response = await self._read_response(ureader, request.method)
                close = response.close or client_close
                if await self._respond(rule, rng, request, response, cwriter, close):
                    return  # the fault ended the connection
                if close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ValueError):
            return
        except asyncio.CancelledError:
            return
        finally:
            self._tasks.discard(task)
            for w in (cwriter, upstream[1] if upstream else None):
                if w is not None:
                    try:
                        w.close()
                    except Exception:  # noqa: BLE001 - closing a broken connection
                        pass

    async def _read_request(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> _Request | None:
        """The next request on a client connection, or None at its clean end."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial.strip():
                raise
            return None
        lines = head[:-4].split(b"\r\n")
        method, target, version = lines[0].decode("latin-1").split(" ", 2)
        headers = _parse_headers(lines[1:])
        forwarded = [lines[0]] + [ln for ln in lines[1:] if not ln.lower().startswith(b"expect:")]
        request = _Request(method.upper(), target, version, headers, b"\r\n".join(forwarded) + b"\r\n\r\n", b"")
        if (request.header("expect") or "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        if (request.header("transfer-encoding") or "").lower().endswith("chunked"):
            request.body = await _read_chunked(reader, raw=True)
        else:
            length = int(request.header("content-length") or 0)
            request.body = await reader.readexactly(length) if length else b""
        return request

    async def _read_response(self, reader: asyncio.StreamReader, method: str) -> _Response:
        """The upstream's next response, its body read whole and de-chunked."""
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        status_line = lines[0]
        status = int(status_line.split(b" ", 2)[1])
        headers = _parse_headers(lines[1:])
        close = (_get(headers, "connection") or "").lower() == "close" or status_line.startswith(b"HTTP/1.0")
        bodiless = method == "HEAD" or 100 <= status < 200 or status in (204, 304)
        if bodiless:
            return _Response(status, status_line, headers, b"", True, close)
        if (_get(headers, "transfer-encoding") or "").lower().endswith("chunked"):
            body = await _read_chunked(reader, raw=False)
        elif _get(headers, "content-length") is not None:
            body = await reader.readexactly(int(_get(headers, "content-length") or 0))
        else:  # the body runs to the end of the connection
            body = await reader.read()
            close = True
        return _Response(status, status_line, headers, body, False, close)

    async def _respond(self, rule: Rule | None, rng: random.Random | None, request: _Request,
                       response: _Response, writer: asyncio.StreamWriter, close: bool) -> bool:
        """Send ``response`` as ``rule`` says; True when the connection is done for."""
        fault = rule.fault if rule else None
        body = response.body
        if fault is None or (fault in ("reset_mid", "truncate", "flip") and (response.bodiless or not body)):
            writer.write(response.head(close=close) + body)  # no body to cut or flip: passed through
            await writer.drain()
            return False
        assert rule is not None and rng is not None
        self._count(fault, request.method, request.target)
        if fault == "drop":
            self._reset(writer)
            return True
        if fault == "stall":
            await asyncio.sleep(rule.stall_seconds)
            writer.write(response.head(close=close) + body)
            await writer.drain()
            return False
        if fault == "flip":
            at = rng.randrange(len(body)) if rule.at is None else rule.at - _body_start(request)
            if not 0 <= at < len(body):  # not the byte asked for: passed through, not counted
                with self._mu:
                    rule.fired -= 1
                    self._counts[fault] -= 1
                    self.injected.pop()
                writer.write(response.head(close=close) + body)
                await writer.drain()
                return False
            flipped = bytearray(body)
            flipped[at] ^= 0xFF
            writer.write(response.head(close=close) + bytes(flipped))
            await writer.drain()
            return False
        cut = min(len(body) - 1, max(0, int(len(body) * rule.keep)))
        writer.write(response.head(close=close) + body[:cut])
        await writer.drain()
        if fault == "reset_mid":
            self._reset(writer)
        else:  # truncate: a clean close, short of the promised length
            writer.close()
        return True

    @staticmethod
    def _error(fault: str, request: _Request) -> bytes:
        status, reason, code, message = _ERRORS[fault]
        resource = request.target.split("?", 1)[0]
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                f"<Resource>{resource}</Resource><RequestId>faultproxy</RequestId></Error>").encode()
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
                f"x-amz-request-id: faultproxy\r\n")
        if fault == "slowdown":
            head += "Retry-After: 1\r\n"
        return (head + "\r\n").encode() + body

    @staticmethod
    def _reset(writer: asyncio.StreamWriter) -> None:
        """Close with a TCP reset (SO_LINGER 0), not a FIN."""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        writer.transport.abort()
