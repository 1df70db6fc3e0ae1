"""The Helm chart installed through the Helm SDK into the real API server, and the operator run with exactly the
chart's RBAC: as the chart's ServiceAccount, with a TokenRequest token. The API server's audit log then says
which verbs the operator really used; a granted verb it never uses, or a request it was refused, fails the test.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "wanloom.dev", "v1alpha1", "trainingjobs"
CHART_NAMESPACE, RELEASE, WATCHED = "wanloom-system", "wanloom", "wanloom-chart"
SERVICE_ACCOUNT = "wanloom"
# Granted for a check the API server makes on the operator's behalf, not for a request of its own: creating a
# JobSet (or a dataset's Job) whose ownerReference sets blockOwnerDeletion needs `update` on the owner's finalizers.
IMPLICIT = {
    ("wanloom.dev", "trainingjobs/finalizers", "update"),
    ("wanloom.dev", "latentdatasets/finalizers", "update"),
}


def _wait(check: Callable[[], Any], what: str, timeout: float = 120) -> Any:
    return wait_for(check, what, timeout, interval=1)


def _manifest(release: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(release["manifest"]) if d]


def test_chart_objects_are_accepted_and_the_operator_deployment_becomes_available(
    cluster: Any, chart_release: dict[str, Any], crd: Any
) -> None:
    from kubernetes import client, dynamic

    objects = _manifest(chart_release)
    kinds = {d["kind"] for d in objects}
    assert {"CustomResourceDefinition", "ServiceAccount", "Role", "RoleBinding", "Deployment"} <= kinds, kinds
    api = dynamic.DynamicClient(cluster.api)
    for doc in objects:
        resource = api.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        namespace = doc["metadata"].get("namespace", CHART_NAMESPACE) if resource.namespaced else None
        assert resource.get(name=doc["metadata"]["name"], namespace=namespace), doc["metadata"]
    apps = client.AppsV1Api(cluster.api)
    name = next(d["metadata"]["name"] for d in objects if d["kind"] == "Deployment")
    _wait(lambda: apps.read_namespaced_deployment(name, CHART_NAMESPACE).status.available_replicas == 1,
          "the operator Deployment available (its pod runs on a KWOK node)")  # fmt: skip


def _granted(release: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the chart grants its ServiceAccount in the watched namespace and cluster-wide."""
    out = set()
    for doc in _manifest(release):
        if doc["kind"] not in ("Role", "ClusterRole"):
            continue
        if doc["kind"] == "Role" and doc["metadata"].get("namespace") != WATCHED:
            continue
        for rule in doc["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out |= {(group, resource, verb) for verb in rule["verbs"]}
    return out


def _audited(audit_log: str, user: str, since: float) -> tuple[set[tuple[str, str, str]], list[dict[str, Any]]]:
    """(apiGroup, resource[/subresource], verb) of the user's requests after ``since``, and the refused ones."""
    used, refused = set(), []
    for line in Path(audit_log).read_text().splitlines():
        event = json.loads(line)
        if event["user"]["username"] != user or event.get("stage") != "ResponseComplete":
            continue
        stamp = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
        if stamp < since - 1 or "objectRef" not in event:
            continue
        ref = event["objectRef"]
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used.add((ref.get("apiGroup", ""), resource, event["verb"]))
        if event["responseStatus"]["code"] == 403:
            refused.append(event)
    return used, refused


def _service_account_kubeconfig(cluster: Any, path: Path) -> None:
    from kubernetes import client

    token = (
        client.CoreV1Api(cluster.api)
        .create_namespaced_service_account_token(
            SERVICE_ACCOUNT, CHART_NAMESPACE, {"spec": {"expirationSeconds": 3600}}
        )
        .status.token
    )
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    admin["users"] = [{"name": "user", "user": {"token": token}}]
    path.write_text(yaml.safe_dump(admin))


def _spec_hash(api: Any, name: str) -> str | None:
    from kubernetes import client

    try:
        jobset = api.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", WATCHED, "jobsets", name)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return jobset["metadata"].get("annotations", {}).get("wanloom.dev/spec-hash")


def _job(name: str, **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "jobs" / "tiny-local.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": WATCHED}
    doc["spec"] = {**copy.deepcopy(doc["spec"]), "maxRestarts": 0, **spec}
    return doc


@pytest.mark.slow
def test_operator_runs_on_the_charts_rbac_and_uses_every_verb_it_is_granted(
    cluster: Any, chart_release: dict[str, Any], crd: Any, tmp_path: Path
) -> None:
    from kubernetes import client

    kubeconfig = tmp_path / "operator.kubeconfig"
    _service_account_kubeconfig(cluster, kubeconfig)
    since = time.time()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "WANLOOM_PROGRESS_INTERVAL_SECONDS": "2",
           "WANLOOM_LOG_FORMAT": "plain"}  # fmt: skip
    command = [sys.executable, "-c", "from wanloom_cli import main; main()", "operator",
               f"--namespace={WATCHED}", "--metrics-port=0", "--liveness-port=0"]  # fmt: skip
    operator = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    api = client.CustomObjectsApi(cluster.api)
    suffix = uuid.uuid4().hex[:6]  # the watched namespace outlives a session: fresh names for each run
    run, held, queued = f"rbac-run-{suffix}", f"rbac-suspend-{suffix}", f"rbac-queued-{suffix}"
    corpus = f"rbac-corpus-{suffix}"
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, WATCHED, PLURAL, _job(run))
        api.create_namespaced_custom_object(GROUP, VERSION, WATCHED, PLURAL, _job(held, suspend=True))
        # Queued and suspended: the operator deactivates the Workload Kueue makes for it (its LocalQueue need not
        # exist for that).
        queued_job = _job(queued, suspend=True)
        queued_job["spec"]["resources"]["queueName"] = "nowhere"
        api.create_namespaced_custom_object(GROUP, VERSION, WATCHED, PLURAL, queued_job)

        def phase(name: str) -> str | None:
            return (api.get_namespaced_custom_object(GROUP, VERSION, WATCHED, PLURAL, name).get("status") or {}).get(
                "phase"
            )

        _wait(lambda: phase(run) == "Succeeded", f"{run} Succeeded")
        _wait(lambda: phase(held) == "Suspended", "rbac-suspend Suspended")

        def deactivated() -> bool:
            workloads = api.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", WATCHED, "workloads")["items"]
            mine = [w for w in workloads if any(r["name"] == queued for r in w["metadata"].get("ownerReferences", []))]
            return bool(mine) and all(w["spec"].get("active") is False for w in mine)

        # A LatentDataset created suspended: its plan Job waits suspended until the dataset is resumed (a Job patch);
        # KWOK's pods print the summary the steps would (kwok-stages.yaml).
        dataset = yaml.safe_load((ROOT / "jobs" / "datasets" / "tiny-corpus.yaml").read_text())
        dataset["metadata"] = {"name": corpus, "namespace": WATCHED}
        summary = {"inputs": 2, "units": 1, "bad": {}, "samples": 2, "shards": 1, "skipped": {}}
        dataset["spec"] |= {"suspend": True}
        dataset["spec"]["resources"]["env"] = [{"name": "E2E_TERMINATION_MESSAGE", "value": json.dumps(summary)}]
        api.create_namespaced_custom_object(GROUP, VERSION, WATCHED, "latentdatasets", dataset)

        def dataset_phase() -> str | None:
            obj = api.get_namespaced_custom_object(GROUP, VERSION, WATCHED, "latentdatasets", corpus)
            return (obj.get("status") or {}).get("phase")

        _wait(lambda: dataset_phase() == "Suspended", f"{corpus} Suspended")
        api.patch_namespaced_custom_object(
            GROUP, VERSION, WATCHED, "latentdatasets", corpus, {"spec": {"suspend": False}}
        )
        _wait(lambda: dataset_phase() == "Ready", f"{corpus} Ready after resuming")
        api.delete_namespaced_custom_object(GROUP, VERSION, WATCHED, "latentdatasets", corpus)
        _wait(deactivated, "the queued job's Workload deactivated")
        assert phase(queued) == "Suspended"
        api.delete_namespaced_custom_object(GROUP, VERSION, WATCHED, PLURAL, queued)
        # A spec change while suspended: the operator rewrites the ConfigMap and replaces the JobSet (delete +
        # create); resuming runs it (its pod runs 4 s on a KWOK node: the operator reads progress meanwhile).
        before = _spec_hash(api, held)
        patch = {"spec": {"training": {"steps": 21}}}
        api.patch_namespaced_custom_object(GROUP, VERSION, WATCHED, PLURAL, held, patch)
        _wait(lambda: _spec_hash(api, held) not in (None, before), "the JobSet re-created for the new spec")
        api.patch_namespaced_custom_object(GROUP, VERSION, WATCHED, PLURAL, held, {"spec": {"suspend": False}})
        _wait(lambda: phase(held) == "Succeeded", "rbac-suspend Succeeded after resuming")
        api.delete_namespaced_custom_object(GROUP, VERSION, WATCHED, PLURAL, held)
        _wait(lambda: not [j for j in api.list_namespaced_custom_object(GROUP, VERSION, WATCHED, PLURAL)["items"]
                           if j["metadata"]["name"] == held], "rbac-suspend deleted")  # fmt: skip
    finally:
        operator.terminate()
        output, _ = operator.communicate(timeout=60)
    time.sleep(2)  # the audit backend writes in batches
    used, refused = _audited(
        cluster.env["audit_log"], f"system:serviceaccount:{CHART_NAMESPACE}:{SERVICE_ACCOUNT}", since
    )
    assert not refused, [(e["verb"], e["objectRef"]) for e in refused] + [output[-3000:]]
    granted = _granted(chart_release)
    unused = granted - used - IMPLICIT
    assert not unused, f"granted but never used: {sorted(unused)}; used: {sorted(used)}"
