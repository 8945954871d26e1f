"""Tests of the test infrastructure itself: the S3 fixtures and the local docker stack."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, RemoteConnectionRefused, S3Server


@pytest.mark.s3
def test_s3_round_trip(s3_server: S3Server, s3_bucket: str) -> None:
    fs = s3_server.filesystem()
    payload = os.urandom(3 * 1024 * 1024 + 17)
    path = f"{s3_bucket}/dir/obj.bin"
    fs.pipe_file(path, payload)
    assert fs.cat_file(path) == payload
    assert fs.cat_file(path, start=10, end=1010) == payload[10:1010]
    assert fs.size(path) == len(payload)
    assert fs.ls(f"{s3_bucket}/dir", detail=False) == [path.removeprefix("s3://")]


@pytest.mark.s3
def test_s3_create_only_put_refuses_existing_key(s3_server: S3Server, s3_bucket: str) -> None:
    fs = s3_server.filesystem()
    path = f"{s3_bucket}/dataset.json"
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(OSError, match="(?i)pre-?condition"):
        fs.pipe_file(path, b"second", mode="create")
    assert fs.cat_file(path) == b"first"


@pytest.mark.s3
def test_s3_buckets_are_independent(s3_server: S3Server, s3_bucket: str) -> None:
    fs = s3_server.filesystem()
    other = "s3://other-" + s3_bucket.removeprefix("s3://test-")
    fs.mkdir(other)
    try:
        fs.pipe_file(f"{s3_bucket}/k", b"a")
        fs.pipe_file(f"{other}/k", b"b")
        assert fs.cat_file(f"{s3_bucket}/k") == b"a"
        assert fs.cat_file(f"{other}/k") == b"b"
        assert not fs.exists(f"{other}/only-in-first")
    finally:
        fs.rm(other, recursive=True)


@pytest.mark.s3
def test_s3_server_rejects_wrong_secret(s3_server: S3Server, s3_bucket: str) -> None:
    import s3fs

    opts = s3_server.storage_options()
    opts["secret"] = "not-" + opts["secret"]
    opts["config_kwargs"] = {"retries": {"max_attempts": 1}}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    with pytest.raises(PermissionError):
        fs.pipe_file(f"{s3_bucket}/x", b"x")
    assert s3_server.secret not in repr(s3_server)


@pytest.mark.s3
def test_s3_env_sets_standard_variables(s3_env: S3Server, s3_bucket: str) -> None:
    import s3fs

    assert os.environ["AWS_ENDPOINT_URL"] == s3_env.endpoint
    # Nothing passed explicitly: s3fs/botocore pick up the standard variables.
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.pipe_file(f"{s3_bucket}/from-env", b"ok")
    assert fs.cat_file(f"{s3_bucket}/from-env") == b"ok"


def test_a_connection_off_this_machine_is_refused_before_it_is_made() -> None:
    """The audit hook conftest installs stops any socket aimed off loopback. Raised through
    ``sys.audit`` with the event's own arguments, so nothing is sent anywhere even if it fails."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(RemoteConnectionRefused, match="192.0.2.7:443"):
            sys.audit("socket.connect", sock, ("192.0.2.7", 443))
        with pytest.raises(RemoteConnectionRefused, match="2001:db8::1"):
            sys.audit("socket.sendto", sock, ("2001:db8::1", 53, 0, 0))
        sys.audit("socket.connect", sock, ("127.0.0.1", 9))  # loopback passes the hook
        sys.audit("socket.connect", sock, "/run/some.sock")  # so do Unix sockets
    finally:
        sock.close()


def test_boto3_finds_no_credentials_and_asks_no_metadata_service() -> None:
    """With the environment scrubbed, credential lookup ends at once with nothing found: it
    neither reads ~/.aws nor tries the EC2 metadata address (the guard above would refuse it)."""
    import boto3

    assert boto3.Session().get_credentials() is None


@pytest.mark.ray
@pytest.mark.slow
def test_ray_local_runs_a_task(ray_local) -> None:  # type: ignore[no-untyped-def]
    @ray_local.remote
    def square(x: int) -> int:
        return x * x

    assert ray_local.get([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]
    assert ray_local.util.get_node_ip_address() == "127.0.0.1"


# --------------------------------------------------------------------------- docker stack


def _compose() -> str:
    """docker-compose, which scripts/bootstrap.sh installs in CI; skipped elsewhere without it."""
    compose = shutil.which("docker-compose")
    if compose is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed: scripts/bootstrap.sh installs it (apt-get) in CI")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    return compose


def test_docker_compose_resolves_the_stack() -> None:
    """docker-compose validates the file against its schema and resolves it as `up` would: the
    credentials users export reach MinIO and both Ray nodes, and nothing listens beyond loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="user-key-1", AWS_SECRET_ACCESS_KEY="user-secret-1")
    result = subprocess.run([_compose(), "config"], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load(result.stdout)["services"]
    assert services["minio"]["environment"]["MINIO_ROOT_USER"] == "user-key-1"
    for name in ("createbucket", "ray-head", "ray-worker"):
        svc_env = services[name]["environment"]
        assert (svc_env["AWS_ACCESS_KEY_ID"], svc_env["AWS_SECRET_ACCESS_KEY"]) == ("user-key-1", "user-secret-1")
        assert svc_env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    published = [p for svc in services.values() for p in svc.get("ports", [])]
    # docker-compose v1 prints "127.0.0.1:9000:9000", v2 a mapping with host_ip.
    hosts = [p.get("host_ip") if isinstance(p, dict) else str(p).split(":")[0] for p in published]
    assert hosts and set(hosts) == {"127.0.0.1"}, published
    # The worker joins the head's cluster, and only once the head answers its health check.
    assert "--address=ray-head:6379" in services["ray-worker"]["command"]
    assert services["ray-worker"]["depends_on"]["ray-head"]["condition"] == "service_healthy"


def test_docker_compose_refuses_a_broken_file(tmp_path: Path) -> None:
    """The check above can fail: the same tool refuses the file with one service misspelt."""
    broken = (REPO_ROOT / "docker-compose.yml").read_text().replace("depends_on:\n      minio:",
                                                                       "depends_on:\n      minoi:", 1)
    (tmp_path / "docker-compose.yml").write_text(broken)
    result = subprocess.run([_compose(), "config", "-q"], cwd=tmp_path, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "minoi" in result.stderr


def test_dockerfile_install_line_builds_an_importable_package(tmp_path: Path) -> None:
    """Run the Dockerfile's own COPY and RUN lines in a scratch context (pip installs the package
    without dependencies into a target dir; this environment provides those): what the image
    copies is enough to build shardkit, and every subpackage is installed and imports."""
    lines = (REPO_ROOT / "infra" / "Dockerfile").read_text().splitlines()
    context = tmp_path / "image"
    context.mkdir()
    for line in lines:
        if line.startswith("COPY "):
            src, dest = line.split()[1:3]
            target = context / dest
            if (REPO_ROOT / src).is_dir():
                shutil.copytree(REPO_ROOT / src, target / Path(src).name if dest.endswith("/") and dest != src else target,
                                dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(REPO_ROOT / src, target if not dest.endswith("/") else target / Path(src).name)
    run = [line[len("RUN "):] for line in lines if line.startswith("RUN ")]
    assert run, "the Dockerfile has no RUN line"
    site = tmp_path / "site"
    env = {**os.environ, "PIP_TARGET": str(site), "PIP_NO_DEPS": "1", "PIP_NO_BUILD_ISOLATION": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for command in run:
        result = subprocess.run(["bash", "-c", command.replace("pip install", f"{sys.executable} -m pip install")],
                                cwd=context, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
    expected = sorted(str(p.parent.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "shardkit").rglob("__init__.py"))
    installed = sorted(str(p.parent.relative_to(site)) for p in (site / "shardkit").rglob("__init__.py"))
    assert installed == expected
    probe = "import shardkit, shardkit.packing.pack, shardkit.datasets.streaming; print(shardkit.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().startswith(str(site)), out.stderr[-2000:]
