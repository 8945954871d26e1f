"""Shared pytest fixtures: a real S3 server (SeaweedFS), local Ray, and leak checks.

Session fixtures:
    s3_server   SeaweedFS ``weed mini`` on free loopback ports with per-session random keys.
    ray_local   an embedded local Ray (started only when a test asks for it).

Function fixtures:
    s3_bucket   a fresh, uniquely named bucket on ``s3_server``: ``"s3://<name>"``.
    s3_env      the standard AWS_* variables pointed at ``s3_server`` for one test.

Every test also runs under ``_leak_police``, which fails a test that leaves non-daemon
threads or child processes behind (opt out with ``@pytest.mark.allow_leaks``).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardkit.dev.devserver import DevServer, DevServerError, S3Server

__all__ = ["REPO_ROOT", "S3Server", "RemoteConnectionRefused"]  # test modules import these from conftest

REPO_ROOT = Path(__file__).resolve().parent.parent

S3_START_TIMEOUT = 30.0
LEAK_GRACE_SECONDS = 5.0

# Processes owned by session fixtures; the leak police never counts them.
_SESSION_PIDS: set[int] = set()


# --------------------------------------------------------------------------- env hygiene


def _scrub_environment() -> None:
    """Keep tests offline and deterministic, whatever the calling shell exported."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            del os.environ[name]
    # Never read ~/.aws, never ask the EC2 metadata service (a non-loopback address).
    os.environ["AWS_CONFIG_FILE"] = os.devnull
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    for name in ("NO_PROXY", "no_proxy"):
        os.environ[name] = "127.0.0.1,localhost"


_scrub_environment()


# --------------------------------------------------------------------------- loopback only

_LOCAL_HOSTS = ("127.", "::1", "0.0.0.0", "localhost", "::ffff:127.")


class RemoteConnectionRefused(ConnectionRefusedError):
    """A test process tried to reach an address off this machine."""


def refuse_remote(event: str, args: tuple[Any, ...]) -> None:
    """Audit hook: a socket connect or UDP send to anything but loopback (or a Unix socket)
    raises before a packet leaves, so no test can reach the network by accident."""
    if event not in ("socket.connect", "socket.sendto"):
        return
    address = args[1]
    if not isinstance(address, tuple):  # AF_UNIX path, abstract socket name
        return
    host = str(address[0])
    if not host.startswith(_LOCAL_HOSTS):
        raise RemoteConnectionRefused(f"tests reach only loopback: refused {event} to {host}:{address[1]}")


# Installed once for the whole pytest process (audit hooks cannot be removed); subprocesses
# (servers, DDP ranks, Ray workers) are kept local by their own loopback flags.
import sys  # noqa: E402

sys.addaudithook(refuse_remote)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "allow_leaks: do not fail the test for leaked threads or child processes"
    )


# --------------------------------------------------------------------------- S3 server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A SeaweedFS S3 server on a free loopback port for the whole session.

    Random keys per session, a throwaway data dir, every port weed opens chosen free so
    sessions can run side by side (see :mod:`shardkit.dev.devserver`). Stopped by PID and its
    directory removed at the end; weed gets SIGTERM if pytest dies without tearing down.
    """
    pytest.importorskip("s3fs")
    dev = DevServer(timeout=S3_START_TIMEOUT, key_prefix="sk")
    try:
        server = dev.start()
    except DevServerError as exc:
        pytest.fail(f"{exc}\n(install the test extras: scripts/bootstrap.sh, pip install -e '.[test]')",
                    pytrace=False)
    _SESSION_PIDS.add(server.pid)
    try:
        yield server
    finally:
        _SESSION_PIDS.discard(server.pid)
        dev.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A fresh bucket with a unique name; yields ``"s3://<name>"``.

    Deleted (best effort) afterwards: SeaweedFS gives every bucket its own volume and a
    small server has only so many. Never assert that deleted objects vanish at once.
    """
    name = f"test-{uuid.uuid4().hex[:16]}"
    fs = s3_server.filesystem()
    fs.mkdir(name)
    try:
        yield f"s3://{name}"
    finally:
        try:
            fs.rm(name, recursive=True)
        except OSError:
            pass  # cleanup only; the whole server is thrown away at session end


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """Point the standard AWS_* variables at ``s3_server`` for one test."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


# --------------------------------------------------------------------------- Ray


@pytest.fixture(scope="session")
def ray_local(s3_server: S3Server) -> Iterator[Any]:
    """An embedded local Ray (2 CPUs, loopback only, no dashboard) for the session.

    Started on first use only. Yields the ``ray`` module. Workers see the repository on
    PYTHONPATH so tasks can import ``shardkit`` even without an installed package, and the
    session S3 server's keys and region, not its endpoint: credentials configured on the
    cluster's nodes, as ray_jobs/pack.py documents; the endpoint is each job's to give.
    """
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.fail("ray was already initialised before the ray_local fixture", pytrace=False)
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    mp.setenv("RAY_AUTH_MODE", "disabled")
    mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
    old_pp = os.environ.get("PYTHONPATH")
    mp.setenv("PYTHONPATH", str(REPO_ROOT) + (os.pathsep + old_pp if old_pp else ""))
    temp_dir = tempfile.mkdtemp(prefix="shardkit-ray-")
    before = _child_pids()
    ray_pids: set[int] = set()
    try:
        with pytest.MonkeyPatch.context() as node_env:  # for Ray's daemons and workers only
            for name, value in s3_server.env().items():
                if name != "AWS_ENDPOINT_URL":
                    node_env.setenv(name, value)
            node_env.delenv("AWS_ENDPOINT_URL", raising=False)
            node_env.delenv("AWS_ENDPOINT_URL_S3", raising=False)
            ray.init(
                address="local",
                num_cpus=2,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                _temp_dir=temp_dir,
            )
        # Ray's own daemons (gcs_server, raylet, ...) are children of this process.
        ray_pids = {pid for pid, _ in _child_pids() - before}
        _SESSION_PIDS.update(ray_pids)
        yield ray
    finally:
        try:
            ray.shutdown()
        finally:
            _SESSION_PIDS.difference_update(ray_pids)
            mp.undo()
            shutil.rmtree(temp_dir, ignore_errors=True)


# --------------------------------------------------------------------------- leak police


def _child_pids() -> set[tuple[int, str]]:
    """Live (non-zombie) direct children of this process as (pid, start time)."""
    me = os.getpid()
    out: set[tuple[int, str]] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        import multiprocessing

        return {(p.pid, "") for p in multiprocessing.active_children() if p.pid is not None}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # Fields after the command name, which may itself contain spaces and parens.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) < 20 or int(fields[1]) != me or fields[0] in ("Z", "X"):
            continue
        out.add((int(entry), fields[19]))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _is_session_process(pid: int) -> bool:
    if pid in _SESSION_PIDS:
        return True
    # Ray may (re)start its own helpers from the driver after init.
    cmd = _cmdline(pid)
    return "/ray/" in cmd or "ray::" in cmd


def _non_daemon_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if not t.daemon and t.is_alive()}


@pytest.fixture(autouse=True)
def _leak_police(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves non-daemon threads or child processes running.

    Only non-daemon threads count (Ray, torch and fsspec keep daemon threads of their
    own). Leaks get a grace period to finish; leaked processes are then killed so they
    cannot spill into the next test.
    """
    if request.node.get_closest_marker("allow_leaks"):
        yield
        return
    threads_before = _non_daemon_threads()
    children_before = _child_pids()
    yield
    deadline = time.monotonic() + LEAK_GRACE_SECONDS
    while True:
        new_threads = _non_daemon_threads() - threads_before
        new_children = {
            (pid, start)
            for pid, start in _child_pids() - children_before
            if not _is_session_process(pid)
        }
        if not (new_threads or new_children) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not (new_threads or new_children):
        return
    problems = [f"thread {t.name!r} (ident {t.ident})" for t in sorted(new_threads, key=str)]
    for pid, _ in sorted(new_children):
        problems.append(f"process {pid}: {_cmdline(pid)[:200]}")
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    pytest.fail(
        f"test leaked after {LEAK_GRACE_SECONDS:.0f}s grace: " + "; ".join(problems),
        pytrace=False,
    )
