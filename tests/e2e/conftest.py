"""The real control plane `make cluster` starts (.ci/cluster/up.py): clients for it, and a throwaway namespace.

Tests that need it skip when no cluster was started here, and fail instead where CI requires the end-to-end
tests (WANLOOM_REQUIRE_E2E=1).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("WANLOOM_CLUSTER_DIR", ROOT / ".cluster"))


@dataclass(frozen=True)
class Cluster:
    """The started control plane: its admin API client, ports and files (``.cluster/env``)."""

    api: Any  # kubernetes.client.ApiClient as cluster admin
    env: dict[str, Any]

    @property
    def kubeconfig(self) -> str:
        return self.env["kubeconfig"]


def _unavailable(why: str) -> None:
    if os.environ.get("WANLOOM_REQUIRE_E2E"):
        pytest.fail(f"{why}: CI requires the real control plane (run `make cluster` first)")
    pytest.skip(f"{why}; `make cluster` starts one")


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    from kubernetes import client, config

    env_file = STATE / "env"
    if not env_file.exists():
        _unavailable(f"no control plane started here ({env_file} is missing)")
    env = json.loads(env_file.read_text())
    api = config.new_client_from_config(env["kubeconfig"])
    try:
        client.VersionApi(api).get_code(_request_timeout=5)
    except Exception as exc:  # any failure means there is nothing to test against
        _unavailable(f"the control plane in {STATE} does not answer ({type(exc).__name__})")
    return Cluster(api, env)


@pytest.fixture(scope="session")
def crd(cluster: Any) -> dict[str, Any]:
    """The TrainingJob CRD created (or replaced) on the API server and Established."""
    from kubernetes import client

    from wanloom_operator.api.crd import trainingjob_crd

    ext = client.ApiextensionsV1Api(cluster.api)
    body = trainingjob_crd()
    name = body["metadata"]["name"]
    try:
        ext.create_custom_resource_definition(body)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
        body["metadata"]["resourceVersion"] = ext.read_custom_resource_definition(name).metadata.resource_version
        ext.replace_custom_resource_definition(name, body)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = ext.read_custom_resource_definition(name).status
        if any(c.type == "Established" and c.status == "True" for c in status.conditions or ()):
            return body
        time.sleep(0.5)
    raise AssertionError(f"{name} not Established after 60 s")


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    from kubernetes import client

    name = f"e2e-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(cluster.api)
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)
