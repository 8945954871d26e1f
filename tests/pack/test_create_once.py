"""Create-only writes (the commit's dataset.json, a pack's claim) recognise their own success.

A lost answer: a small asyncio HTTP proxy on 127.0.0.1 in front of SeaweedFS forwards a PUT,
lets the server apply it, and then drops the connection before the answer; the client's retry
is refused (the object exists) and must be recognised as this writer's own success.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import shardkit
from shardkit.errors import DatasetExistsError
from shardkit.packing.create_once import create_once
from shardkit.packing.index import index_tars
from shardkit.storage.store import Store

from test_pack_ray import image_folder


class DropProxy:
    """HTTP/1.1 between clients and the S3 server, one upstream connection per request; the
    answers to the first ``count`` requests of ``method`` whose path ends with ``suffix`` are
    dropped after the server applied them (the client's connection is aborted instead)."""

    def __init__(self, target: str, rules: list[tuple[str, str, int]]) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.rules = [list(r) for r in rules]
        self.dropped: list[tuple[str, str]] = []
        self.seen: list[tuple[str, str]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._client, "127.0.0.1", 0), self.loop).result(10)
        self.endpoint = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def storage_options(self, server: Any) -> dict[str, Any]:
        opts = server.storage_options()
        opts["client_kwargs"] = {**opts.get("client_kwargs", {}), "endpoint_url": self.endpoint}
        return opts

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:  # the open client connections
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.server.wait_closed()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @staticmethod
    async def _body(reader: asyncio.StreamReader, headers: dict[str, str], until_eof: bool) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            out = b""
            while True:
                line = await reader.readline()
                out += line
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers, then the empty line
                        trailer = await reader.readline()
                        out += trailer
                        if trailer in (b"\r\n", b"\n", b""):
                            return out
                out += await reader.readexactly(size + 2)
        if "content-length" in headers:
            return await reader.readexactly(int(headers["content-length"]))
        return await reader.read() if until_eof else b""

    @staticmethod
    def _parse(head: bytes) -> tuple[str, dict[str, str]]:
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        return lines[0], headers

    def _drop(self, method: str, path: str) -> bool:
        for rule in self.rules:
            if rule[0] == method and path.endswith(rule[1]) and rule[2] > 0:
                rule[2] -= 1
                return True
        return False

    async def _client(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await creader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                first, headers = self._parse(head)
                method, target = first.split(" ")[:2]
                if headers.get("expect", "").lower() == "100-continue":
                    cwriter.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = b"\r\n".join(line for line in head.split(b"\r\n")
                                        if not line.lower().startswith(b"expect:"))
                body = await self._body(creader, headers, until_eof=False)
                ureader, uwriter = await asyncio.open_connection(*self.target)
                try:
                    uwriter.write(head + body)
                    await uwriter.drain()
                    while True:
                        rhead = await ureader.readuntil(b"\r\n\r\n")
                        status, rheaders = self._parse(rhead)
                        if not status.split(" ")[1].startswith("1"):
                            break
                    code = status.split(" ")[1]
                    bodyless = method == "HEAD" or code in ("204", "304")
                    rbody = b"" if bodyless else await self._body(ureader, rheaders, until_eof=True)
                finally:
                    uwriter.close()
                path = target.split("?")[0]
                self.seen.append((method, path))
                if self._drop(method, path):  # the server applied it; the client never hears
                    self.dropped.append((method, path))
                    cwriter.transport.abort()
                    return
                cwriter.write(rhead + rbody)
                await cwriter.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            cwriter.close()


@pytest.fixture
def drop_proxy(s3_server: Any) -> Any:
    proxies: list[DropProxy] = []

    def make(rules: list[tuple[str, str, int]]) -> DropProxy:
        proxies.append(DropProxy(s3_server.endpoint, rules))
        return proxies[-1]

    yield make
    for p in proxies:
        p.close()


# --------------------------------------------------------------------------- lost answers


@pytest.mark.s3
@pytest.mark.parametrize("lost", ["dataset.json", "_pack/plan.json"])
def test_pack_whose_create_answer_is_lost_commits(tmp_path, s3_server, s3_bucket, drop_proxy, lost):
    """The PUT of dataset.json (or of the claim) is applied, its answer lost, the PUT retried:
    the pack commits its own dataset (it reported "another writer committed first", or refused
    itself for 150 s, before)."""
    src = image_folder(tmp_path / "imgs", count=12, side=32)
    proxy = drop_proxy([("PUT", "/" + lost, 1)])
    opts = proxy.storage_options(s3_server)
    dest = f"{s3_bucket}/ds"
    info = shardkit.pack(str(src), dest, shard_bytes="16KB", labels_from_dirs=True, storage_options=opts,
                         progress=False)
    assert proxy.dropped == [("PUT", f"/{s3_bucket[5:]}/ds/{lost}")], proxy.seen
    assert info["num_samples"] == 12
    direct = s3_server.storage_options()
    ds = shardkit.open_dataset(dest, storage_options=direct)
    assert ds.info == {k: v for k, v in info.items() if k not in ("elapsed_seconds", "reused_tasks", "tasks")}
    ds.verify(deep=True)
    fs = s3_server.filesystem()
    assert not fs.exists(f"{dest[5:]}/_pack/plan.json")  # released, not left behind


@pytest.mark.s3
def test_index_whose_commit_answer_is_lost_commits(tmp_path, s3_server, s3_bucket, drop_proxy):
    src = image_folder(tmp_path / "imgs", count=8, side=32)
    direct = s3_server.storage_options()
    shardkit.pack(str(src), f"{s3_bucket}/packed", shard_bytes="16KB", labels_from_dirs=True,
                  storage_options=direct, progress=False)
    fs = s3_server.filesystem()
    for tar in fs.glob(f"{s3_bucket[5:]}/packed/shards/*.tar"):
        fs.copy(tar, f"{s3_bucket[5:]}/tars/{tar.rsplit('/', 1)[1]}")
    proxy = drop_proxy([("PUT", "/dataset.json", 1), ("PUT", "/_pack/plan.json", 1)])
    info = index_tars(f"{s3_bucket}/tars", progress=False, storage_options=proxy.storage_options(s3_server))
    assert len(proxy.dropped) == 2, proxy.seen
    ds = shardkit.open_dataset(f"{s3_bucket}/tars", storage_options=direct)
    assert ds.info == info and ds.num_samples == 8
    ds.verify(deep=True)


def test_create_once_refuses_another_writers_object(tmp_path):
    store = Store(str(tmp_path))
    create_once(store, "x.json", b"mine")
    create_once(store, "x.json", b"mine")  # a retry that finds its own bytes: created
    with pytest.raises(DatasetExistsError, match="x.json already exists"):
        create_once(store, "x.json", b"theirs")
    assert (tmp_path / "x.json").read_bytes() == b"mine"
