"""A TCP proxy on 127.0.0.1 in front of the test S3 server that can freeze: while frozen it
keeps every connection open and passes no bytes either way, as a SIGSTOPped store does
(imported by test modules)."""

from __future__ import annotations

import socket
import threading
from typing import Any


class StallProxy:
    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.frozen = threading.Event()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            upstream = socket.create_connection(self.target)
            self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pipe, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.2)
        while not self._stop.is_set():
            if self.frozen.is_set():
                self._stop.wait(0.05)
                continue
            try:
                data = src.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def storage_options(self, server: Any, read_timeout: float) -> dict[str, Any]:
        """s3fs options reaching ``server`` through this proxy, with a short read timeout."""
        opts = server.storage_options()
        opts["client_kwargs"] = {**opts.get("client_kwargs", {}), "endpoint_url": self.endpoint}
        opts["config_kwargs"] = {"read_timeout": read_timeout, "connect_timeout": 2, "retries": {"total_max_attempts": 1}}
        return opts

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for t in self._threads:
            t.join(timeout=2)
        for s in self._socks:
            s.close()
