"""Tests of the test infrastructure itself: the S3 fixtures and the local docker stack."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

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


# --------------------------------------------------------------------------- KubeRay RayJob

# Fields of the KubeRay ray.io/v1 types (ray-operator/apis/ray/v1/{rayjob,raycluster}_types.go):
# a key outside these is a typo the API server would drop or refuse.
RAYJOB_SPEC_FIELDS = {"activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
                      "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint",
                      "runtimeEnvYAML", "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus",
                      "entrypointNumGpus", "ttlSecondsAfterFinished", "shutdownAfterJobFinishes", "suspend",
                      "schedule"}
RAYCLUSTER_SPEC_FIELDS = {"headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling",
                          "autoscalerOptions", "headServiceAnnotations", "suspend", "gcsFaultToleranceOptions",
                          "managedBy", "upgradeStrategy"}
HEAD_GROUP_FIELDS = {"serviceType", "headService", "enableIngress", "rayStartParams", "template"}
WORKER_GROUP_FIELDS = {"groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts", "rayStartParams",
                       "template", "scaleStrategy", "suspend", "idleTimeoutSeconds"}
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}
RAYJOB_MANIFEST = REPO_ROOT / "infra" / "kuberay-rayjob.yaml"


def _containers(template: object, where: str, problems: list[str]) -> list[dict[str, object]]:
    """The containers of a pod template, with what is wrong about them added to ``problems``."""
    spec = template.get("spec") if isinstance(template, dict) else None
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if not isinstance(containers, list) or not containers:
        problems.append(f"{where}.template.spec.containers: missing or empty")
        return []
    for i, c in enumerate(containers):
        at = f"{where}.template.spec.containers[{i}]"
        if not isinstance(c, dict) or not c.get("name") or not isinstance(c.get("image"), str) or not c["image"]:
            problems.append(f"{at}: needs a name and an image")
            continue
        for j, e in enumerate(c.get("env") or []):
            ref = (e.get("valueFrom") or {}).get("secretKeyRef") if isinstance(e, dict) else None
            if not isinstance(ref, dict) or "value" in e or not ref.get("name") or not ref.get("key"):
                problems.append(f"{at}.env[{j}] ({e.get('name') if isinstance(e, dict) else e}): "
                                "must come from a Secret (valueFrom.secretKeyRef with name and key), never a value")
        for j, e in enumerate(c.get("envFrom") or []):
            if not isinstance(e, dict) or set(e) - {"secretRef", "prefix"} or "secretRef" not in e:
                problems.append(f"{at}.envFrom[{j}]: only secretRef")
    return [c for c in containers if isinstance(c, dict)]


def _start_params(group: dict[str, object], where: str, problems: list[str]) -> None:
    # map[string]string in the CRD (required before KubeRay 1.4): a bare YAML number is refused.
    params = group.get("rayStartParams")
    if not isinstance(params, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
        problems.append(f"{where}.rayStartParams: a map of strings is required (quote numbers)")


def rayjob_problems(doc: object) -> list[str]:
    """What a KubeRay RayJob manifest gets wrong about the fields KubeRay requires ([]: none)."""
    problems: list[str] = []
    if not isinstance(doc, dict) or doc.get("apiVersion") != "ray.io/v1" or doc.get("kind") != "RayJob":
        return ["apiVersion ray.io/v1 and kind RayJob are required"]
    name = (doc.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
        problems.append(f"metadata.name: {name!r} is not a DNS-1123 label")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return [*problems, "spec: missing"]
    problems += [f"spec.{k}: not a RayJob field" for k in sorted(set(spec) - RAYJOB_SPEC_FIELDS)]
    if not isinstance(spec.get("entrypoint"), str) or not spec["entrypoint"].strip():
        problems.append("spec.entrypoint: the command to run is required")
    if spec.get("submissionMode", "K8sJobMode") not in SUBMISSION_MODES:
        problems.append(f"spec.submissionMode: {spec['submissionMode']!r} is not one of {sorted(SUBMISSION_MODES)}")
    for key in ("shutdownAfterJobFinishes", "suspend"):
        if key in spec and not isinstance(spec[key], bool):
            problems.append(f"spec.{key}: a boolean")
    for key in ("ttlSecondsAfterFinished", "backoffLimit", "activeDeadlineSeconds"):
        if key in spec and (not isinstance(spec[key], int) or isinstance(spec[key], bool) or spec[key] < 0):
            problems.append(f"spec.{key}: a non-negative integer")
    cluster = spec.get("rayClusterSpec")
    if not isinstance(cluster, dict):
        return [*problems, "spec.rayClusterSpec: a cluster to run the job on is required"]
    where = "spec.rayClusterSpec"
    problems += [f"{where}.{k}: not a RayCluster field" for k in sorted(set(cluster) - RAYCLUSTER_SPEC_FIELDS)]
    head = cluster.get("headGroupSpec")
    if not isinstance(head, dict) or "template" not in head:
        problems.append(f"{where}.headGroupSpec.template: required")
    else:
        problems += [f"{where}.headGroupSpec.{k}: not a head group field" for k in sorted(set(head) - HEAD_GROUP_FIELDS)]
        _start_params(head, f"{where}.headGroupSpec", problems)
        _containers(head["template"], f"{where}.headGroupSpec", problems)
    groups = cluster.get("workerGroupSpecs")
    if not isinstance(groups, list) or not groups:
        problems.append(f"{where}.workerGroupSpecs: at least one worker group (a pack on the head alone is "
                        "engine='local' with extra steps)")
        groups = []
    names = [g.get("groupName") for g in groups if isinstance(g, dict)]
    if len(set(names)) != len(names):
        problems.append(f"{where}.workerGroupSpecs: groupName repeated: {names}")
    for i, g in enumerate(groups):
        at = f"{where}.workerGroupSpecs[{i}]"
        if not isinstance(g, dict):
            problems.append(f"{at}: a mapping")
            continue
        problems += [f"{at}.{k}: not a worker group field" for k in sorted(set(g) - WORKER_GROUP_FIELDS)]
        if not isinstance(g.get("groupName"), str) or not g["groupName"]:
            problems.append(f"{at}.groupName: required")
        counts = [g.get(k) for k in ("minReplicas", "replicas", "maxReplicas")]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
            problems.append(f"{at}: minReplicas, replicas and maxReplicas are required non-negative integers")
        elif not counts[0] <= counts[1] <= counts[2] or counts[1] < 1:  # type: ignore[operator]
            problems.append(f"{at}: needs minReplicas <= replicas <= maxReplicas and replicas >= 1, got {counts}")
        _start_params(g, at, problems)
        if "template" not in g:
            problems.append(f"{at}.template: required")
        else:
            _containers(g["template"], at, problems)
    return problems


def _rayjob() -> dict[str, object]:
    yaml = pytest.importorskip("yaml")
    docs = list(yaml.safe_load_all(RAYJOB_MANIFEST.read_text()))
    assert len(docs) == 1, f"{RAYJOB_MANIFEST.name}: one document expected, got {len(docs)}"
    return docs[0]  # type: ignore[no-any-return]


def test_kuberay_rayjob_manifest_has_what_kuberay_requires() -> None:
    """infra/kuberay-rayjob.yaml is a RayJob KubeRay accepts (the fields its ray.io/v1 CRD
    requires, nothing it does not know), runs the pack entry point that the project's image
    installs, on Ray that the package allows, with S3 settings from a Secret only."""
    from packaging.requirements import Requirement

    doc = _rayjob()
    assert rayjob_problems(doc) == []
    spec: dict[str, Any] = doc["spec"]  # type: ignore[assignment]
    # The entry point is ray_jobs/pack.py where infra/Dockerfile copies it (WORKDIR /opt/shardkit).
    dockerfile = (REPO_ROOT / "infra" / "Dockerfile").read_text()
    assert "WORKDIR /opt/shardkit" in dockerfile and "COPY ray_jobs/ ray_jobs/" in dockerfile
    argv = spec["entrypoint"].split()
    assert argv[:2] == ["python", "/opt/shardkit/ray_jobs/pack.py"] and len(argv) >= 4, argv
    cluster = spec["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    images = {c["image"] for p in pods for c in p["spec"]["containers"]}
    assert len(images) == 1, f"head and workers must run one image (one Ray version): {images}"
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    ray_req = Requirement(re.search(r'^ray = \["([^"]+)"\]', pyproject, re.M).group(1))  # type: ignore[union-attr]
    assert ray_req.specifier.contains(cluster["rayVersion"]), (cluster["rayVersion"], str(ray_req))
    for p in pods:  # every node reads and writes S3 with the same Secret's settings
        names = {e["name"] for c in p["spec"]["containers"] for e in c.get("env", [])}
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= names
    assert not re.search(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b", RAYJOB_MANIFEST.read_text())  # no access key id


@pytest.mark.parametrize("breakage, complaint", [
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"), "groupName: required"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"].pop("template"), "headGroupSpec.template: required"),
    (lambda d: d["spec"].pop("entrypoint"), "spec.entrypoint"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].pop("image"),
     "needs a name and an image"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].update(
        env=[{"name": "AWS_SECRET_ACCESS_KEY", "value": "inline"}]), "must come from a Secret"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),
     "map of strings"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas=9), "minReplicas <= replicas"),
    (lambda d: d["spec"].update(entrypointt="x"), "spec.entrypointt: not a RayJob field"),
    (lambda d: d.update(apiVersion="ray.io/v1alpha1"), "apiVersion ray.io/v1"),
], ids=["no-groupName", "no-head-template", "no-entrypoint", "no-image", "inline-secret", "numeric-param",
        "replicas-over-max", "typo-field", "old-api"])
def test_kuberay_rayjob_check_refuses_a_broken_manifest(breakage: Any, complaint: str) -> None:
    """The check above can fail: each breakage of the real manifest is named."""
    import copy

    doc = copy.deepcopy(_rayjob())
    breakage(doc)
    problems = rayjob_problems(doc)
    assert any(complaint in p for p in problems), problems
