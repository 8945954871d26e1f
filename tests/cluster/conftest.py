"""The ``ray_cluster`` fixture: a real two-node Ray cluster on loopback for this package's tests.

Started once per module (``ray start --head`` + ``ray start --address``, see
:mod:`raycluster`); its nodes see the repository and this directory on ``PYTHONPATH`` (the
tasks import ``shardkit`` and the test sources) and the session S3 server's keys and region,
not its endpoint: credentials configured on the cluster's nodes, as ray_jobs/pack.py documents.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "pack"))  # compare_datasets, image_folder

from raycluster import ClusterError, RayCluster  # noqa: E402

__all__: list[str] = []


def node_env(s3_env: dict[str, str]) -> dict[str, str]:
    """The environment of the cluster's nodes: loopback Ray, the code on PYTHONPATH, S3 keys."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "AWS_"))}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.update({k: v for k, v in s3_env.items() if not k.startswith("AWS_ENDPOINT_URL")})
    for k in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_EC2_METADATA_DISABLED"):
        if k in os.environ:
            env[k] = os.environ[k]
    return env


@pytest.fixture(scope="module")
def ray_cluster(s3_server) -> Iterator[RayCluster]:
    """A head (resource ``head``) and a worker node (resource ``worker``), one CPU each.

    Ports are chosen free at runtime and each node has its own temp dir; torn down by process
    group (never ``ray stop``, which would stop other sessions' Ray on this machine).
    """
    pytest.importorskip("ray")
    if not (Path(sys.executable).parent / "ray").exists():
        pytest.fail("the 'ray' CLI is missing from the environment (pip install 'ray[default]')", pytrace=False)
    root = Path(tempfile.mkdtemp(prefix="skc", dir="/tmp"))  # Ray's socket paths must stay short
    cluster = RayCluster(root, node_env(s3_server.env()))
    try:
        try:
            cluster.start()
        except ClusterError as exc:
            pytest.fail(str(exc), pytrace=False)
        yield cluster
    finally:
        cluster.stop()
