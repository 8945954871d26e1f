"""Tests of the test infrastructure itself: the S3 fixtures and the local docker stack."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import REPO_ROOT, S3Server


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


def test_environment_is_offline() -> None:
    assert os.environ["AWS_EC2_METADATA_DISABLED"] == "true"
    assert "AWS_ACCESS_KEY_ID" not in os.environ
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert "127.0.0.1" in os.environ["NO_PROXY"]


@pytest.mark.ray
@pytest.mark.slow
def test_ray_local_runs_a_task(ray_local) -> None:  # type: ignore[no-untyped-def]
    @ray_local.remote
    def square(x: int) -> int:
        return x * x

    assert ray_local.get([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]
    assert ray_local.util.get_node_ip_address() == "127.0.0.1"


# --------------------------------------------------------------------------- docker stack


def _load_compose() -> dict:  # type: ignore[type-arg]
    yaml = pytest.importorskip("yaml")
    with open(REPO_ROOT / "docker-compose.yml") as f:
        doc = yaml.safe_load(f)
    assert isinstance(doc, dict)
    return doc


def _env(service: dict) -> dict:  # type: ignore[type-arg]
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return env


def test_docker_compose_wiring() -> None:
    doc = _load_compose()
    services = doc["services"]
    assert {"minio", "createbucket", "ray-head", "ray-worker"} <= set(services)

    minio = services["minio"]
    image, _, tag = minio["image"].partition(":")
    assert image == "minio/minio" and tag and tag != "latest"
    published = " ".join(str(p) for p in minio["ports"])
    assert "9000:9000" in published and "9001:9001" in published
    assert any(v.startswith("minio-data:") for v in minio["volumes"])
    assert "minio-data" in doc["volumes"]
    assert _env(minio)["MINIO_ROOT_USER"] == "${AWS_ACCESS_KEY_ID:-minioadmin}"
    assert _env(minio)["MINIO_ROOT_PASSWORD"] == "${AWS_SECRET_ACCESS_KEY:-minioadmin}"

    init = services["createbucket"]
    image, _, tag = init["image"].partition(":")
    assert image == "minio/mc" and tag and tag != "latest"
    assert "minio" in init["depends_on"]
    assert "shardkit" in " ".join(init["command"])

    for name in ("ray-head", "ray-worker"):
        svc = services[name]
        assert svc["build"]["dockerfile"] == "infra/Dockerfile"
        assert (REPO_ROOT / svc["build"]["context"] / "infra" / "Dockerfile").is_file()
        env = _env(svc)
        # The same variables the tests and shardkit read, pointed at the minio service.
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
        assert env["AWS_ACCESS_KEY_ID"] == "${AWS_ACCESS_KEY_ID:-minioadmin}"
        assert env["AWS_SECRET_ACCESS_KEY"] == "${AWS_SECRET_ACCESS_KEY:-minioadmin}"
        assert env["RAY_USAGE_STATS_ENABLED"] == "0"

    head = " ".join(services["ray-head"]["command"])
    assert "--head" in head and "--port=6379" in head and "--block" in head
    assert services["ray-head"]["ports"] == ["127.0.0.1:8265:8265"]
    assert "--address=ray-head:6379" in " ".join(services["ray-worker"]["command"])
    # The worker waits for a healthy head (it exited for good when it started first) and rejoins.
    assert services["ray-worker"]["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert "ray" in services["ray-head"]["healthcheck"]["test"] and services["ray-worker"]["restart"] == "on-failure"


def test_docker_compose_config_validates() -> None:
    """Validate with Debian's docker-compose where it happens to be installed."""
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed (the YAML wiring is checked above)")
    result = subprocess.run(
        [compose, "-f", str(REPO_ROOT / "docker-compose.yml"), "config", "-q"],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_dockerfile_installs_the_package() -> None:
    text = (REPO_ROOT / "infra" / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text
    for copied in ("pyproject.toml", "shardkit/", "ray_jobs/"):
        assert f"COPY {copied}" in text
    assert 'pip install ".[ray,hdf5]"' in text
