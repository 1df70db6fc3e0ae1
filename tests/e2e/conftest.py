"""The real control plane `make cluster` starts (.ci/cluster/up.py): clients for it, and a throwaway namespace.

Tests that need it skip when no cluster was started here, and fail instead where CI requires the end-to-end
tests (WANLOOM_REQUIRE_E2E=1).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # e2e_wait beside this file (test dirs are not packages)

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the control plane is marked ``cluster``: `make test` runs those after the cluster is up
    (``-m "cluster or images"``) and the rest while it builds (.ci/test.sh)."""
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


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


CHART_DIR = ROOT / "helm" / "wanloom"
CHART_NAMESPACE = "wanloom-system"
RELEASE = "wanloom"
# The chart's namespaced mode watches this namespace: the operator runs there as the chart's ServiceAccount.
CHART_WATCHED_NAMESPACE = "wanloom-chart"


@pytest.fixture(scope="session")
def chart_release(cluster: Cluster) -> dict[str, Any]:
    """The chart installed through the Helm SDK, as a platform engineer installs it (upgraded when an earlier
    session installed it). Test workers share one control plane: a file lock makes one of them install it."""
    import fcntl

    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
    from kubernetes import client

    values = {"operator": {"watch": {"allNamespaces": False, "namespaces": [CHART_WATCHED_NAMESPACE]}}}
    with open(STATE / "helm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        core = client.CoreV1Api(cluster.api)
        if not core.list_namespace(field_selector=f"metadata.name={CHART_WATCHED_NAMESPACE}").items:
            core.create_namespace({"metadata": {"name": CHART_WATCHED_NAMESPACE}})
        with helm.Config(kubeconfig_path=cluster.kubeconfig, namespace=CHART_NAMESPACE) as cfg:
            if any(r["name"] == RELEASE for r in cfg.list()):
                return cfg.upgrade(str(CHART_DIR), RELEASE, values, namespace=CHART_NAMESPACE)
            return cfg.install(str(CHART_DIR), RELEASE, values, namespace=CHART_NAMESPACE, create_namespace=True)


@pytest.fixture(scope="session")
def crd(cluster: Cluster, chart_release: dict[str, Any]) -> dict[str, Any]:
    """The TrainingJob CRD as the chart installed it, Established (and the LatentDataset CRD beside it)."""
    from kubernetes import client

    ext = client.ApiextensionsV1Api(cluster.api)
    deadline = time.monotonic() + 60
    found: dict[str, Any] = {}
    while time.monotonic() < deadline:
        for name in ("trainingjobs.wanloom.dev", "latentdatasets.wanloom.dev"):
            crd = ext.read_custom_resource_definition(name)
            if any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or ()):
                found[name] = cluster.api.sanitize_for_serialization(crd)
        if len(found) == 2:
            return found["trainingjobs.wanloom.dev"]
        time.sleep(0.5)
    raise AssertionError(f"the wanloom CRDs are not Established after 60 s (only {sorted(found)})")


@pytest.fixture(scope="session")
def k8s(cluster: Cluster, crd: dict[str, Any]) -> Any:
    """The kubernetes package with the cluster's admin kubeconfig as its default client (the CRD Established)."""
    import kubernetes

    kubernetes.config.load_kube_config(config_file=cluster.kubeconfig)
    return kubernetes


def _throwaway_namespace(cluster: Cluster) -> Iterator[str]:
    from kubernetes import client

    name = f"e2e-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(cluster.api)
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A namespace of this test's own, deleted after it."""
    yield from _throwaway_namespace(cluster)


@pytest.fixture(scope="module")
def module_namespace(cluster: Cluster) -> Iterator[str]:
    """A namespace shared by a module's tests (and its module-scoped operator), deleted after them."""
    yield from _throwaway_namespace(cluster)
