"""End to end on the real control plane `make cluster` starts (kube-apiserver, controller manager, scheduler,
JobSet controller, KWOK fake nodes): the operator turns a CPU TrainingJob into a JobSet whose pods are scheduled
onto a fake node and driven to completion by KWOK, follows it to its final phase, suspends and resumes, and its
children are garbage-collected with it.

The operator runs here, out of the cluster, with the same code as `wanloom operator`. KWOK runs no containers: a
Job's pod goes Running, then Succeeded, so the job must end Succeeded. (On a kind or GKE cluster, point
WANLOOM_CLUSTER_DIR at a folder whose `env` names its kubeconfig; without WANLOOM_E2E_TRAINER_IMAGE the pods there
run a Python image without the trainer and the job ends Failed.)
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_operator import start_operator as _start_operator
from e2e_wait import wait_for

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
TRAINER_IMAGE = os.environ.get("WANLOOM_E2E_TRAINER_IMAGE")
TIMEOUT = float(os.environ.get("WANLOOM_E2E_TIMEOUT", "300"))
GROUP, VERSION, PLURAL = "wanloom.dev", "v1alpha1", "trainingjobs"


@pytest.fixture(scope="module")
def fake_nodes(cluster: Any) -> bool:
    return "kwok" in cluster.env.get("components", ())


@pytest.fixture(scope="module")
def namespace(k8s: Any, module_namespace: str) -> str:
    return module_namespace


@pytest.fixture(scope="module")
def operator(k8s: Any, cluster: Any, namespace: str) -> Iterator[subprocess.Popen[str]]:
    process = _start_operator(cluster, namespace)
    yield process
    # Delete the TrainingJobs while the operator still runs: it removes its finalizer from active ones.
    api = k8s.client.CustomObjectsApi()
    api.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
    _wait(lambda: not api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"], "cleanup", 120)
    process.terminate()
    output, _ = process.communicate(timeout=60)
    print(output[-5000:])


def _trainingjob(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "jobs" / "tiny-local.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"]["maxRestarts"] = 0
    doc["spec"]["training"]["steps"] = 20
    if not TRAINER_IMAGE:
        doc["spec"]["resources"]["image"] = "python:3.11-slim"  # no wanloom_trainer inside: the pod fails
    doc["spec"] = {**copy.deepcopy(doc["spec"]), **spec}
    return doc


def _wait(check: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
    return wait_for(check, what, timeout)


def _get(k8s: Any, namespace: str, name: str) -> dict[str, Any]:
    return k8s.client.CustomObjectsApi().get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def _jobset(k8s: Any, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return k8s.client.CustomObjectsApi().get_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", name
        )
    except k8s.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_trainingjob_runs_to_a_final_phase(k8s: Any, namespace: str, operator: Any, fake_nodes: bool) -> None:
    api = k8s.client.CustomObjectsApi()
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _trainingjob("e2e-run", namespace))
    jobset = _wait(lambda: _jobset(k8s, namespace, "e2e-run"), "the JobSet")
    assert jobset["metadata"]["ownerReferences"][0]["kind"] == "TrainingJob"
    pods = _wait(
        lambda: (
            k8s.client.CoreV1Api()
            .list_namespaced_pod(namespace, label_selector="jobset.sigs.k8s.io/jobset-name=e2e-run")
            .items
        ),
        "a trainer pod",
    )
    env = {e.name: e for e in pods[0].spec.containers[0].env}
    assert env["WANLOOM_HOST_INDEX"].value_from.field_ref.field_path.endswith("job-completion-index']")
    final = "Succeeded" if TRAINER_IMAGE or fake_nodes else "Failed"
    status = _wait(
        lambda: (s := _get(k8s, namespace, "e2e-run").get("status") or {}).get("phase") == final and s, f"phase {final}"
    )
    assert status["replicatedJobs"][0]["name"] == "node"
    assert any(c["type"] == final and c["status"] == "True" for c in status["conditions"])


def test_suspend_resume_and_cascading_deletion(k8s: Any, namespace: str, operator: Any) -> None:
    api, core = k8s.client.CustomObjectsApi(), k8s.client.CoreV1Api()
    api.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, _trainingjob("e2e-suspend", namespace, suspend=True)
    )
    _wait(lambda: (_jobset(k8s, namespace, "e2e-suspend") or {}).get("spec", {}).get("suspend") is True, "suspended")
    _wait(lambda: (_get(k8s, namespace, "e2e-suspend").get("status") or {}).get("phase") == "Suspended", "Suspended")
    assert not core.list_namespaced_pod(namespace, label_selector="jobset.sigs.k8s.io/jobset-name=e2e-suspend").items
    api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "e2e-suspend", {"spec": {"suspend": False}})
    _wait(
        lambda: core.list_namespaced_pod(namespace, label_selector="jobset.sigs.k8s.io/jobset-name=e2e-suspend").items,
        "pods after resuming",
    )
    # Every condition says which spec it reflects: the resume is generation 2.
    resumed = _wait(
        lambda: (s := _get(k8s, namespace, "e2e-suspend").get("status") or {}).get("phase") != "Suspended" and s,
        "the resumed status",
    )
    suspended = next(c for c in resumed["conditions"] if c["type"] == "Suspended")
    assert suspended["status"] == "False" and suspended["observedGeneration"] == 2, resumed["conditions"]
    assert all(c.get("observedGeneration") in (1, 2) for c in resumed["conditions"]), resumed["conditions"]
    api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "e2e-suspend")
    _wait(lambda: _jobset(k8s, namespace, "e2e-suspend") is None, "the JobSet garbage-collected")
    _wait(
        lambda: (
            not [c for c in core.list_namespaced_config_map(namespace).items if c.metadata.name == "e2e-suspend-config"]
        ),
        "the ConfigMap garbage-collected",
    )


def test_invalid_trainingjob_is_reported(k8s: Any, cluster: Any) -> None:
    """The CRD refuses every rule a manifest alone decides; what is left to the operator depends on how it is
    configured: under the GPUDirect RDMA profile (gib) an h100 job, whose nodes lack those NICs, is Invalid."""
    gib = {"WANLOOM_GPU_NCCL_PROFILE": "gib", "WANLOOM_GPU_NETWORK_INTERFACES": "gvnic-1,rdma-0"}
    with _own_operator(k8s, cluster, "invalid", settings=gib) as (namespace, _):
        doc = _trainingjob("e2e-invalid", namespace)
        doc["spec"]["resources"] = {"gpu": {"type": "h100", "nodes": 2}, "image": "python:3.11-slim"}
        doc["spec"]["training"]["globalBatch"] = 16  # one sample per rank, or the CRD refuses it
        k8s.client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
        status = _wait(
            lambda: (s := _get(k8s, namespace, "e2e-invalid").get("status") or {}).get("phase") == "Invalid" and s,
            "phase Invalid",
            timeout=120,
        )
        assert "spec.resources.gpu.type" in status["message"], status
        assert _jobset(k8s, namespace, "e2e-invalid") is None


def _pods(k8s: Any, namespace: str, jobset: str) -> list[Any]:
    return (
        k8s.client.CoreV1Api()
        .list_namespaced_pod(namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={jobset}")
        .items
    )


@pytest.mark.slow
def test_every_shipped_job_lands_on_its_node_pools(k8s: Any, namespace: str, operator: Any, fake_nodes: bool) -> None:
    """jobs/*.yaml as shipped: TPU slices each fill one tpu7x node pool of their topology (JobSet's exclusive
    placement), GPU pods land on nodes of their accelerator, CPU pods anywhere; every job then succeeds."""
    if not fake_nodes:
        pytest.skip("needs the fake TPU/GPU node pools of `make cluster`")
    from wanloom_api.validation import load_trainingjob_file
    from wanloom_operator.render.pods import pod_shape
    from wanloom_operator.settings import OperatorSettings

    api, core = k8s.client.CustomObjectsApi(), k8s.client.CoreV1Api()
    expected = {}
    for path in sorted((ROOT / "jobs").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        doc["metadata"] = {"name": path.stem, "namespace": namespace}
        doc["spec"]["maxRestarts"] = 0
        # Placement only: no LocalQueue exists here, so a queued job would wait (queueing: test_kueue_*).
        doc["spec"]["resources"].pop("queueName", None)
        if "dataset" in doc["spec"]["data"]:  # placement only: waiting for a dataset is test_dataset_cluster.py's
            doc["spec"]["data"] = {"uri": f"gs://bucket/{path.stem}"}
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
        expected[path.stem] = pod_shape(load_trainingjob_file(path).spec, OperatorSettings())
    nodes = {n.metadata.name: n.metadata.labels for n in core.list_node().items}
    for name, shape in expected.items():
        pods = _wait(
            lambda name=name, shape=shape: (p := _pods(k8s, namespace, name)) and len(p) == shape.pods
            and all(x.spec.node_name for x in p) and p,
            f"{name}: {shape.pods} pods bound",
        )  # fmt: skip
        pools: dict[str, set[str]] = {}
        for pod in pods:
            labels = nodes[pod.spec.node_name]
            for key, value in shape.node_selector.items():
                assert labels.get(key) == value, (name, pod.metadata.name, key, labels)
            job = pod.metadata.labels["jobset.sigs.k8s.io/job-index"]
            pools.setdefault(job, set()).add(labels["cloud.google.com/gke-nodepool"])
        if shape.accelerator == "tpu":
            assert len(pools) == shape.replicas and all(len(p) == 1 for p in pools.values()), (name, pools)
            assert len(set().union(*pools.values())) == shape.replicas, f"{name}: two slices share a pool {pools}"
        if shape.accelerator == "gpu":
            assert all(labels.startswith("h") for p in pools.values() for labels in p), (name, pools)
    for name in expected:
        _wait(lambda name=name: (_get(k8s, namespace, name).get("status") or {}).get("phase") == "Succeeded",
              f"{name} Succeeded")  # fmt: skip


def _as_table(cluster: Any, path: str) -> dict[str, Any]:
    """GET ``path`` as a meta.k8s.io Table, the server-side printing `kubectl get` shows."""
    import ssl
    import urllib.request

    config = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    server = config["clusters"][0]["cluster"]
    request = urllib.request.Request(
        server["server"] + path,
        headers={"Authorization": f"Bearer {config['users'][0]['user']['token']}",
                 "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
    )  # fmt: skip
    context = ssl.create_default_context(cafile=server["certificate-authority"])
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        return json.loads(response.read())


def test_a_failing_pod_is_retried_max_restarts_times_then_the_job_fails(
    k8s: Any, cluster: Any, namespace: str, operator: Any, fake_nodes: bool
) -> None:
    if not fake_nodes:
        pytest.skip("KWOK fails the pod on request (WANLOOM_E2E_FAIL); a real pod needs a failing image")
    doc = _trainingjob("e2e-fails", namespace, maxRestarts=1)
    doc["spec"]["resources"]["env"] = [{"name": "WANLOOM_E2E_FAIL", "value": "1"}]
    k8s.client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    status = _wait(
        lambda: (s := _get(k8s, namespace, "e2e-fails").get("status") or {}).get("phase") == "Failed" and s,
        "phase Failed",
    )
    assert status["restarts"] == 1, status
    assert any(c["type"] == "Failed" and c["status"] == "True" for c in status["conditions"])
    # `kubectl get tj` as the API server prints it: the CRD's columns over the stored status.
    table = _as_table(cluster, f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/e2e-fails")
    columns = [c["name"] for c in table["columnDefinitions"]]
    row = dict(zip(columns, table["rows"][0]["cells"], strict=True))
    assert row["Phase"] == "Failed" and row["Restarts"] == 1, row
    assert row["Steps"] == doc["spec"]["training"]["steps"] and "Loss" in row, row


class _Operator:
    """An operator process of one namespace that a test may SIGKILL and start again."""

    def __init__(
        self, cluster: Any, namespace: str, progress_interval: float = 5, settings: dict[str, str] | None = None
    ) -> None:
        self.cluster, self.namespace, self.interval, self.settings = cluster, namespace, progress_interval, settings
        self.process = _start_operator(cluster, namespace, progress_interval, settings)

    def kill(self) -> None:
        import signal

        self.process.send_signal(signal.SIGKILL)
        self.process.communicate(timeout=30)

    def restart(self) -> None:
        self.kill()
        self.process = _start_operator(self.cluster, self.namespace, self.interval, self.settings)


@contextlib.contextmanager
def _own_operator(
    k8s: Any, cluster: Any, prefix: str, progress_interval: float = 5, settings: dict[str, str] | None = None
) -> Iterator[tuple[str, _Operator]]:
    """A fresh namespace with its own operator; on the way out its TrainingJobs are deleted (while an operator
    runs, to lift the finalizers), then the operator stopped and the namespace deleted."""
    import uuid

    core, api = k8s.client.CoreV1Api(), k8s.client.CustomObjectsApi()
    namespace = f"wanloom-e2e-{prefix}-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})
    operator = _Operator(cluster, namespace, progress_interval, settings)
    try:
        yield namespace, operator
    finally:
        if operator.process.poll() is not None:
            operator.process = _start_operator(cluster, namespace)
        api.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        _wait(lambda: not api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"], "cleanup", 180)
        operator.process.terminate()
        operator.process.communicate(timeout=60)
        core.delete_namespace(namespace)


@pytest.mark.slow
def test_a_job_that_finished_while_the_operator_was_down_is_not_run_again(k8s: Any, cluster: Any) -> None:
    """The operator is SIGKILLed once the JobSet exists; the JobSet finishes and its TTL deletes it; the operator,
    back, must end the TrainingJob rather than create the JobSet again."""
    api = k8s.client.CustomObjectsApi()
    with _own_operator(k8s, cluster, "ttl") as (namespace, operator):
        api.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, _trainingjob("e2e-ttl", namespace, ttlSecondsAfterFinished=0)
        )
        _wait(lambda: (_get(k8s, namespace, "e2e-ttl").get("status") or {}).get("createdSpecHash"), "JobSet created")
        operator.kill()
        _wait(lambda: _jobset(k8s, namespace, "e2e-ttl") is None, "the finished JobSet deleted by its TTL")
        operator.process = _start_operator(cluster, namespace)
        status = _wait(
            lambda: (
                (s := _get(k8s, namespace, "e2e-ttl").get("status") or {}).get("phase") in ("Succeeded", "Failed") and s
            ),
            "a final phase after the restart",
        )
        assert "deleted before its outcome was recorded" in status["message"], status
        time.sleep(5)  # a re-created JobSet would show up within a reconcile
        assert _jobset(k8s, namespace, "e2e-ttl") is None


JOBS_UNDER_FAULTS, OPERATOR_KILLS, CONVERGE_S = 30, 5, 240


@pytest.mark.slow
def test_operator_killed_while_jobs_reconcile_converges_with_one_jobset_each(k8s: Any, cluster: Any) -> None:
    """30 TrainingJobs while the operator is SIGKILLed at random points and restarted 5 times: every job ends
    Succeeded with exactly one JobSet, owned by it, and nothing orphaned."""
    import random

    api = k8s.client.CustomObjectsApi()
    rng = random.Random(13)
    with _own_operator(k8s, cluster, "kill") as (namespace, operator):
        names = [f"kill-{i:02d}" for i in range(JOBS_UNDER_FAULTS)]
        for name in names:
            api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _trainingjob(name, namespace))
        for _ in range(OPERATOR_KILLS):
            time.sleep(rng.uniform(0.5, 4.0))
            operator.restart()
        started = time.monotonic()

        def phases() -> dict[str, str | None]:
            items = api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
            return {j["metadata"]["name"]: (j.get("status") or {}).get("phase") for j in items}

        _wait(lambda: set(phases().values()) == {"Succeeded"}, "every job Succeeded", timeout=CONVERGE_S)
        print(f"converged {time.monotonic() - started:.1f} s after the last restart")
        uids = {j["metadata"]["name"]: j["metadata"]["uid"]
                for j in api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]}  # fmt: skip
        jobsets = api.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets")["items"]
        assert sorted(j["metadata"]["name"] for j in jobsets) == names
        for jobset in jobsets:
            [owner] = jobset["metadata"]["ownerReferences"]
            assert owner["uid"] == uids[jobset["metadata"]["name"]], jobset["metadata"]
        # Never a second run: the audit log shows no JobSet created twice and none deleted. Every job's create is
        # logged, though not always with its 201: under load the JobSet webhook can time out (504) after the object
        # was stored, and the operator's retry then gets 409 and adopts it. Seen on a 2-core CI machine.
        time.sleep(2)  # the audit backend writes in batches
        attempted: dict[str, list[int]] = {}
        deleted = []
        for line in Path(cluster.env["audit_log"]).read_text().splitlines():
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            if ref.get("resource") != "jobsets" or ref.get("namespace") != namespace:
                continue
            if event.get("stage") != "ResponseComplete":
                continue
            if event["verb"] == "create" and "name" not in ref:  # the body cut off by a SIGKILL: nothing stored
                assert event["responseStatus"]["code"] >= 500, event
            elif event["verb"] == "create":
                attempted.setdefault(ref["name"], []).append(event["responseStatus"]["code"])
            elif event["verb"] == "delete" and event["responseStatus"]["code"] < 300:
                deleted.append(ref["name"])
        assert sorted(attempted) == names, attempted
        assert all(sum(code < 300 for code in codes) <= 1 for codes in attempted.values()), attempted
        assert not deleted, deleted


def test_a_configuration_error_fails_the_job_without_restarts(
    k8s: Any, namespace: str, operator: Any, fake_nodes: bool
) -> None:
    """The trainer exits with keys.EXIT_CONFIG_ERROR: the pod failure policy and the JobSet rule fail it at once,
    with maxRestarts left unused (a restart would fail the same way)."""
    if not fake_nodes:
        pytest.skip("KWOK sets the exit code on request (WANLOOM_E2E_FAIL)")
    from wanloom_api.keys import EXIT_CONFIG_ERROR

    doc = _trainingjob("e2e-config-error", namespace, maxRestarts=3)
    doc["spec"]["resources"]["env"] = [{"name": "WANLOOM_E2E_FAIL", "value": str(EXIT_CONFIG_ERROR)}]
    k8s.client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    status = _wait(
        lambda: (s := _get(k8s, namespace, "e2e-config-error").get("status") or {}).get("phase") == "Failed" and s,
        "phase Failed",
    )
    assert status["restarts"] == 0, status


def test_trainer_pods_are_burstable_non_root_and_have_time_to_checkpoint(
    k8s: Any, namespace: str, operator: Any, fake_nodes: bool
) -> None:
    """What the API server makes of the rendered pod: not BestEffort (requests from the machine type), no root,
    no privilege escalation, RuntimeDefault seccomp, a grace period long enough for a SIGTERM checkpoint."""
    doc = _trainingjob("e2e-podspec", namespace)
    k8s.client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    [pod] = _wait(lambda: _pods(k8s, namespace, "e2e-podspec"), "the pod")
    assert pod.status.qos_class == "Burstable"
    assert (
        pod.spec.security_context.run_as_non_root and pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
    )
    container = pod.spec.containers[0].security_context
    assert container.allow_privilege_escalation is False and container.capabilities.drop == ["ALL"]
    assert pod.spec.termination_grace_period_seconds >= 300


def test_a_disrupted_pod_restarts_the_job_without_using_up_max_restarts(
    k8s: Any, namespace: str, operator: Any, fake_nodes: bool
) -> None:
    """Preemption or a node drain (pod condition DisruptionTarget) restarts the JobSet for free: with maxRestarts
    0, two disruptions in a row still leave the job restarting, not Failed."""
    if not fake_nodes:
        pytest.skip("KWOK evicts the pod on request (WANLOOM_E2E_DISRUPT)")
    doc = _trainingjob("e2e-disrupted", namespace, maxRestarts=0)
    doc["spec"]["resources"]["env"] = [{"name": "WANLOOM_E2E_DISRUPT", "value": "1"}]
    api = k8s.client.CustomObjectsApi()
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    status = _wait(
        lambda: (s := _get(k8s, namespace, "e2e-disrupted").get("status") or {}).get("restarts", 0) >= 2 and s,
        "two restarts after disruptions",
    )
    assert status["phase"] != "Failed", status
    api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "e2e-disrupted")


def test_active_deadline_bounds_the_whole_run_across_restarts(k8s: Any, cluster: Any) -> None:
    """Each attempt fails after 4 s and maxRestarts allows 20 more; a 15 s activeDeadlineSeconds must still end
    the run (Failed, DeadlineExceeded) long before the restarts run out, and stop its pods."""
    api = k8s.client.CustomObjectsApi()
    with _own_operator(k8s, cluster, "deadline", progress_interval=2) as (namespace, _):
        doc = _trainingjob("e2e-deadline", namespace, maxRestarts=20, activeDeadlineSeconds=15)
        doc["spec"]["resources"]["env"] = [{"name": "WANLOOM_E2E_FAIL", "value": "1"}]
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
        status = _wait(
            lambda: (s := _get(k8s, namespace, "e2e-deadline").get("status") or {}).get("phase") == "Failed" and s,
            "phase Failed",
            timeout=90,
        )
        assert any(c["type"] == "Failed" and c["reason"] == "DeadlineExceeded" for c in status["conditions"]), status
        assert status["restarts"] < 20, status
        _wait(lambda: (_jobset(k8s, namespace, "e2e-deadline") or {}).get("spec", {}).get("suspend"), "suspended")
        _wait(lambda: not [p for p in _pods(k8s, namespace, "e2e-deadline") if p.status.phase == "Running"],
              "no pod left running")  # fmt: skip


@pytest.mark.slow
def test_kueue_admits_one_slice_at_a_time(k8s: Any, cluster: Any) -> None:
    """A ClusterQueue with quota for one tpu7x 2x2x1 slice and two jobs in its LocalQueue: the first is admitted
    (Kueue unsuspends its JobSet), the second waits (Pending, saying it is queued, its JobSet still suspended) and
    is admitted once the first has finished and given its quota back."""
    import uuid

    if "kueue" not in cluster.env.get("components", ()):
        pytest.fail("make cluster starts Kueue; this cluster has none (an older .cluster? make cluster-down)")
    api, suffix = k8s.client.CustomObjectsApi(), uuid.uuid4().hex[:6]
    flavor, queue = f"tpu7x-2x2x1-{suffix}", f"one-slice-{suffix}"
    kueue = ("kueue.x-k8s.io", "v1beta2")
    topology = {"cloud.google.com/gke-tpu-accelerator": "tpu7x", "cloud.google.com/gke-tpu-topology": "2x2x1"}
    api.create_cluster_custom_object(*kueue, "resourceflavors", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": flavor},
        "spec": {"nodeLabels": topology},
    })  # fmt: skip
    api.create_cluster_custom_object(*kueue, "clusterqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": queue},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["cpu", "memory", "google.com/tpu"],
            "flavors": [{"name": flavor, "resources": [
                {"name": "cpu", "nominalQuota": "1000"}, {"name": "memory", "nominalQuota": "100Ti"},
                {"name": "google.com/tpu", "nominalQuota": "4"},  # one 2x2x1 slice
            ]}],
        }]},
    })  # fmt: skip
    try:
        with _own_operator(k8s, cluster, "kueue", progress_interval=1) as (namespace, _):
            api.create_namespaced_custom_object(*kueue, namespace, "localqueues", {
                "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                "metadata": {"name": "tpu", "namespace": namespace}, "spec": {"clusterQueue": queue},
            })  # fmt: skip

            def job(name: str, **spec: Any) -> dict[str, Any]:
                doc = _trainingjob(name, namespace, **spec)
                image = {k: v for k, v in doc["spec"]["resources"].items() if k == "image"}
                doc["spec"]["resources"] = {"tpu": {"topology": "2x2x1"}, "queueName": "tpu", **image}
                return doc

            # The first holds the quota for three 4 s attempts (each fails, maxRestarts 2), then ends Failed.
            first = job("e2e-first", maxRestarts=2)
            first["spec"]["resources"]["env"] = [{"name": "WANLOOM_E2E_FAIL", "value": "1"}]
            api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, first)
            _wait(lambda: (_jobset(k8s, namespace, "e2e-first") or {"spec": {"suspend": True}})["spec"]["suspend"]
                  is False, "the first job admitted")  # fmt: skip
            api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job("e2e-second"))

            def queued(name: str) -> dict[str, Any] | None:
                status = _get(k8s, namespace, name).get("status") or {}
                found = [c for c in status.get("conditions") or [] if c["type"] == "Queued" and c["status"] == "True"]
                return {**status, "queued": found[0]} if found else None

            waiting = _wait(lambda: queued("e2e-second"), "the second job reported queued", timeout=60)
            assert waiting["phase"] == "Pending" and "LocalQueue 'tpu'" in waiting["queued"]["message"], waiting
            assert (_jobset(k8s, namespace, "e2e-second") or {})["spec"]["suspend"] is True
            assert (_get(k8s, namespace, "e2e-first").get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            done = _wait(
                lambda: (s := _get(k8s, namespace, "e2e-second").get("status") or {}).get("phase") == "Succeeded" and s,
                "the second job admitted and finished",
                timeout=180,
            )
            finished = _get(k8s, namespace, "e2e-first")["status"]
            assert finished["phase"] == "Failed" and finished["restarts"] == 2, finished
            assert done["startTime"] >= finished["completionTime"], (done, finished)  # RFC 3339 in UTC sorts
            # Suspending a queued job goes through Kueue (its Workload inactive), so Kueue does not start it
            # while the quota is free; resuming queues it again and it runs.
            api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job("e2e-held", suspend=True))
            _wait(lambda: (_get(k8s, namespace, "e2e-held").get("status") or {}).get("phase") == "Suspended",
                  "the held job Suspended")  # fmt: skip
            workloads = lambda: [w for w in api.list_namespaced_custom_object(*kueue, namespace, "workloads")["items"]
                                 if w["metadata"]["ownerReferences"][0]["name"] == "e2e-held"]  # fmt: skip
            _wait(lambda: workloads() and workloads()[0]["spec"].get("active") is False, "its Workload inactive")
            time.sleep(5)  # quota is free: an active Workload would be admitted within a second
            assert (_jobset(k8s, namespace, "e2e-held") or {})["spec"]["suspend"] is True
            assert (_get(k8s, namespace, "e2e-held").get("status") or {})["phase"] == "Suspended"
            api.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, "e2e-held", {"spec": {"suspend": False}}
            )
            _wait(lambda: (_get(k8s, namespace, "e2e-held").get("status") or {}).get("phase") == "Succeeded",
                  "the held job resumed through Kueue and finished", timeout=120)  # fmt: skip
    finally:
        api.delete_cluster_custom_object(*kueue, "clusterqueues", queue)
        api.delete_cluster_custom_object(*kueue, "resourceflavors", flavor)


@pytest.mark.slow
def test_rank_0_is_looked_up_once_per_attempt_not_once_per_pass(k8s: Any, cluster: Any) -> None:
    """The tracker reads rank 0's metrics every interval; it lists pods to find rank 0 only when the JobSet starts
    an attempt (the pods, and so the IP, change only then). At 500 jobs and a 30 s interval a list per pass would
    be 17 pod lists a second; this bounds it by the restarts. Counted in the API server's audit log."""
    with _own_operator(k8s, cluster, "lists", progress_interval=0.5) as (namespace, _):
        doc = _trainingjob("e2e-lists", namespace, maxRestarts=2)
        doc["spec"]["resources"]["env"] = [{"name": "WANLOOM_E2E_FAIL", "value": "1"}]  # each attempt runs 4 s
        k8s.client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
        status = _wait(
            lambda: (s := _get(k8s, namespace, "e2e-lists").get("status") or {}).get("phase") == "Failed" and s,
            "phase Failed",
            timeout=120,
        )
        attempts = status["restarts"] + 1
        time.sleep(2)  # the audit backend writes in batches
        lists = 0
        for line in Path(cluster.env["audit_log"]).read_text().splitlines():
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            if (event["verb"], ref.get("resource"), ref.get("namespace")) != ("list", "pods", namespace):
                continue
            if event.get("stage") == "ResponseComplete" and "job-index" in event.get("requestURI", ""):
                lists += 1
        # About 8 passes per attempt run while Running; a list per pass would be ~8x attempts.
        assert 1 <= lists <= 2 * attempts, (lists, attempts)


def test_a_jobset_event_past_the_deadline_suspends_before_failed_is_written(k8s: Any) -> None:
    """The JobSet-event path (not the tracker) can be the first to see a run past its deadline. It must suspend
    the JobSet before it writes Failed: a Failed TrainingJob is never looked at again, so a suspension left for
    later never happens and the pods keep running. No operator runs here; the event handler's code is called."""
    import uuid

    api, core = k8s.client.CustomObjectsApi(), k8s.client.CoreV1Api()
    namespace = f"wanloom-e2e-event-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})
    try:
        _deadline_seen_first_by_a_jobset_event(k8s, api, namespace)
    finally:
        core.delete_namespace(namespace)


def _deadline_seen_first_by_a_jobset_event(k8s: Any, api: Any, namespace: str) -> None:
    import asyncio
    from datetime import UTC, datetime, timedelta

    from wanloom_api.validation import validate_trainingjob
    from wanloom_operator.reconcile import observe
    from wanloom_operator.reconcile.cluster import Cluster
    from wanloom_operator.reconcile.runtime import Runtime
    from wanloom_operator.render.jobset import render_trainingjob
    from wanloom_operator.settings import OperatorSettings

    doc = _trainingjob("e2e-deadline-event", namespace, activeDeadlineSeconds=60)
    created = api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    settings = OperatorSettings.from_env({})
    job = validate_trainingjob(doc).job
    assert job is not None
    jobset = render_trainingjob(job, settings, owner_uid=created["metadata"]["uid"]).jobset
    api.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", jobset)
    started = (datetime.now(UTC) - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    api.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "e2e-deadline-event", {"status": {"phase": "Running", "startTime": started}}
    )
    runtime = Runtime(settings=settings, cluster=Cluster(k8s.client.ApiClient()))
    live = _jobset(k8s, namespace, jobset["metadata"]["name"])
    assert live is not None and not live["spec"].get("suspend")

    written = asyncio.run(observe.mirror_jobset(live, runtime))

    assert written is not None and written["phase"] == "Failed", written
    assert (_jobset(k8s, namespace, jobset["metadata"]["name"]) or {})["spec"]["suspend"] is True
    status = _get(k8s, namespace, "e2e-deadline-event")["status"]
    assert any(c["type"] == "Failed" and c["reason"] == "DeadlineExceeded" for c in status["conditions"]), status


LOAD_JOBS = 200


@pytest.mark.slow
def test_two_hundred_trainingjobs_at_once_get_one_jobset_each_and_are_collected(
    k8s: Any, cluster: Any, tmp_path: Path
) -> None:
    """Load on the real API server: 200 TrainingJobs (suspended, so the fake pools run no pods) created at once,
    then deleted. Every one gets exactly one JobSet and ConfigMap, owned by it; after the deletion nothing is left.
    The figures it prints (time to the JobSet, operator RSS and CPU, API requests per job) are written up in
    docs/benchmarks.md; only the counts are asserted."""
    import psutil

    # The test's own requests carry a user agent of their own: the audit log then tells the operator's apart (both
    # are cluster admin).
    client = k8s.client.ApiClient()
    client.user_agent = "wanloom-load-test"
    api, core = k8s.client.CustomObjectsApi(client), k8s.client.CoreV1Api(client)
    namespace = f"wanloom-e2e-load-{os.getpid()}"
    core.create_namespace({"metadata": {"name": namespace}})
    log = open(tmp_path / "operator.log", "w")  # noqa: SIM115 (closed below)
    operator = _start_operator(cluster, namespace, log=log)
    try:
        names = [f"load-{i:03d}" for i in range(LOAD_JOBS)]
        created: dict[str, float] = {}
        started = time.monotonic()
        for name in names:
            api.create_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, _trainingjob(name, namespace, suspend=True)
            )
            created[name] = time.monotonic()
        seen: dict[str, float] = {}

        def all_jobsets() -> bool:
            now = time.monotonic()
            for js in api.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets")["items"]:
                seen.setdefault(js["metadata"]["name"], now)
            return len(seen) == LOAD_JOBS

        _wait(all_jobsets, f"{LOAD_JOBS} JobSets", timeout=600)
        usage = psutil.Process(operator.pid)
        rss, cpu = usage.memory_info().rss, usage.cpu_times()
        delays = sorted(seen[n] - created[n] for n in names)
        uids = {j["metadata"]["name"]: j["metadata"]["uid"]
                for j in api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]}  # fmt: skip
        jobsets = api.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets")["items"]
        assert sorted(j["metadata"]["name"] for j in jobsets) == names
        assert all(j["metadata"]["ownerReferences"][0]["uid"] == uids[j["metadata"]["name"]] for j in jobsets)
        owned = [c for c in core.list_namespaced_config_map(namespace).items if c.metadata.owner_references]
        assert len(owned) == LOAD_JOBS

        api.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        _wait(
            lambda: not api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"], "deletion", 600
        )
        _wait(
            lambda: (
                not api.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets")["items"]
                and not [c for c in core.list_namespaced_config_map(namespace).items if c.metadata.owner_references]
            ),
            "garbage collection",
            300,
        )
        collected = time.monotonic() - started
        time.sleep(2)  # the audit backend writes in batches
        admin = (
            k8s.client.AuthenticationV1Api(client)
            .create_self_subject_review({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
            .status.user_info.username
        )
        requests: Counter[str] = Counter()
        for line in Path(cluster.env["audit_log"]).read_text().splitlines():
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            user = (event.get("user") or {}).get("username", "")
            operator_call = user == admin and event.get("userAgent") != client.user_agent
            if ref.get("namespace") == namespace and operator_call and event.get("stage") == "ResponseComplete":
                requests[f"{event['verb']} {ref.get('resource')}"] += 1
        per_job = sum(requests.values()) / LOAD_JOBS
        print(
            f"injected: {LOAD_JOBS} TrainingJobs at once, then deleted; found: {len(jobsets)} JobSets, time to "
            f"JobSet p50 {delays[len(delays) // 2]:.1f} s p99 {delays[int(len(delays) * 0.99)]:.1f} s, operator RSS "
            f"{rss / 2**20:.0f} MiB, CPU {(cpu.user + cpu.system) / LOAD_JOBS * 1000:.0f} ms per job, operator "
            f"requests per job {per_job:.1f} {dict(requests)}, all collected after {collected:.0f} s"
        )
    finally:
        api.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        _wait(lambda: not api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"], "cleanup", 600)
        operator.terminate()
        operator.wait(timeout=60)
        log.close()
        core.delete_namespace(namespace)
