"""LatentDatasets on the real control plane (kube-apiserver, the Job controller, KWOK fake nodes), run by the operator
as `wanloom operator` runs it: plan Job -> Indexed encode Job (completions from the plan pod's summary) -> finalize
Job -> Ready; a TrainingJob that names the dataset waits Pending, then trains on its output; a dataset that fails
fails the jobs waiting for it with its reason; a Ready dataset applied again creates nothing; an operator killed while
a dataset encodes is replaced, and the new one finishes the dataset with the Jobs the first one made.

KWOK runs no containers: a step's pod succeeds after 4 s with the termination message its container's
E2E_TERMINATION_MESSAGE holds (.ci/cluster/kwok-stages.yaml), standing in for the summary `wanloom data build`
prints; the steps themselves are tested for real in tests/trainer/data/test_data_resource.py.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_operator import start_operator
from e2e_wait import wait_for

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION = "wanloom.dev", "v1alpha1"
SUMMARY = {"inputs": 7, "units": 3, "bad": {"bad-row": 1}, "samples": 6, "shards": 3, "skipped": {"bad-row": 1}}


@pytest.fixture(scope="module")
def namespace(k8s: Any, module_namespace: str) -> str:
    return module_namespace


class Operator:
    """The module's `wanloom operator` process, which a test may kill and start again."""

    def __init__(self, cluster: Any, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.process = start_operator(cluster, namespace, progress_interval=2)

    def kill_and_restart(self) -> None:
        """SIGKILL (a crash, an OOM kill: no chance to clean up), then a new process, as its Deployment would."""
        self.process.kill()
        output, _ = self.process.communicate(timeout=60)
        print(output[-3000:])
        self.process = start_operator(self.cluster, self.namespace, progress_interval=2)


@pytest.fixture(scope="module")
def operator(k8s: Any, cluster: Any, namespace: str) -> Iterator[Operator]:
    running = Operator(cluster, namespace)
    yield running
    api = k8s.client.CustomObjectsApi()
    api.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, "trainingjobs")
    wait_for(lambda: not api.list_namespaced_custom_object(GROUP, VERSION, namespace, "trainingjobs")["items"],
             "cleanup", 120)  # fmt: skip
    running.process.terminate()
    output, _ = running.process.communicate(timeout=60)
    print(output[-5000:])


def _dataset(name: str, **env: str) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "jobs" / "datasets" / "tiny-corpus.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["output"] = f"gs://bucket/datasets/{name}"
    doc["spec"]["workers"] = 2
    doc["spec"]["resources"]["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return doc


def _trainingjob(name: str, dataset: str) -> dict[str, Any]:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "jobs" / "tiny-from-dataset.yaml").read_text()))
    doc["metadata"] = {"name": name}
    doc["spec"]["data"] = {"dataset": dataset}
    doc["spec"]["maxRestarts"] = 0
    return doc


def _status(k8s: Any, namespace: str, plural: str, name: str) -> dict[str, Any]:
    obj = k8s.client.CustomObjectsApi().get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
    return obj.get("status") or {}


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def _jobs(k8s: Any, namespace: str, dataset: str) -> dict[str, Any]:
    items = k8s.client.BatchV1Api().list_namespaced_job(
        namespace, label_selector=f"wanloom.dev/latentdataset={dataset}"
    )
    return {j.metadata.name: j for j in items.items}


@pytest.mark.slow
def test_a_trainingjob_waits_for_its_dataset_which_plans_encodes_and_finalizes(
    k8s: Any, namespace: str, operator: Any
) -> None:
    api = k8s.client.CustomObjectsApi()
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "trainingjobs", _trainingjob("on-corpus", "corpus"))
    waiting = wait_for(
        lambda: (s := _status(k8s, namespace, "trainingjobs", "on-corpus")).get("phase") == "Pending" and s,
        "the TrainingJob Pending",
        60,
    )
    assert _condition(waiting, "DataReady")["reason"] == "DatasetNotFound", waiting

    dataset = _dataset("corpus", E2E_TERMINATION_MESSAGE=json.dumps(SUMMARY))
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "latentdatasets", dataset)
    encoding = wait_for(
        lambda: (s := _status(k8s, namespace, "latentdatasets", "corpus")).get("phase") == "Encoding" and s,
        "the dataset Encoding",
        120,
    )
    assert (encoding["inputs"], encoding["shardsTotal"]) == (7, 3)  # from the plan pod's summary
    # The operator writes the job's condition right after the dataset's phase: wait out that gap, not more.
    pending = wait_for(
        lambda: (
            "Encoding"
            in _condition(s := _status(k8s, namespace, "trainingjobs", "on-corpus"), "DataReady").get("message", "")
            and s
        ),
        "the TrainingJob's DataReady naming Encoding",
        30,
    )
    assert pending["phase"] == "Pending", pending
    encode = _jobs(k8s, namespace, "corpus")["corpus-encode"]
    assert (encode.spec.completion_mode, encode.spec.completions, encode.spec.parallelism) == ("Indexed", 3, 2)

    ready = wait_for(
        lambda: (s := _status(k8s, namespace, "latentdatasets", "corpus")).get("phase") == "Ready" and s,
        "the dataset Ready",
        180,
    )
    assert (ready["shardsDone"], ready["samplesEncoded"], ready["skipped"]) == (3, 6, {"bad-row": 1}), ready
    assert ready["outputUri"] == "gs://bucket/datasets/corpus" and _condition(ready, "Ready")["status"] == "True"
    assert sorted(_jobs(k8s, namespace, "corpus")) == ["corpus-encode", "corpus-finalize", "corpus-plan"]

    # The TrainingJob starts on the dataset's output, and runs to the end.
    wait_for(
        lambda: _status(k8s, namespace, "trainingjobs", "on-corpus").get("phase") == "Succeeded",
        "the TrainingJob Succeeded",
        180,
    )
    config = k8s.client.CoreV1Api().read_namespaced_config_map("on-corpus-config", namespace)
    trained_on = yaml.safe_load(config.data["trainingjob.yaml"])["spec"]["data"]
    assert trained_on == {**trained_on, "uri": "gs://bucket/datasets/corpus"} and "dataset" not in trained_on

    # Applied again (a label, a no-op edit): a Ready dataset creates nothing more.
    before = {n: j.metadata.uid for n, j in _jobs(k8s, namespace, "corpus").items()}
    api.patch_namespaced_custom_object(GROUP, VERSION, namespace, "latentdatasets", "corpus",
                                       {"metadata": {"labels": {"team": "media"}}})  # fmt: skip
    wait_for(lambda: _status(k8s, namespace, "latentdatasets", "corpus").get("phase") == "Ready", "still Ready", 30)
    assert {n: j.metadata.uid for n, j in _jobs(k8s, namespace, "corpus").items()} == before


def test_a_failed_dataset_fails_the_trainingjobs_waiting_for_it(k8s: Any, namespace: str, operator: Any) -> None:
    api = k8s.client.CustomObjectsApi()
    # Exit code 3 is a configuration error (a bad manifest): the pod failure policy fails the Job at once.
    api.create_namespaced_custom_object(
        GROUP, VERSION, namespace, "latentdatasets", _dataset("broken-corpus", WANLOOM_E2E_FAIL="3")
    )
    api.create_namespaced_custom_object(
        GROUP, VERSION, namespace, "trainingjobs", _trainingjob("on-broken", "broken-corpus")
    )
    failed = wait_for(
        lambda: (s := _status(k8s, namespace, "latentdatasets", "broken-corpus")).get("phase") == "Failed" and s,
        "the dataset Failed",
        120,
    )
    assert failed["message"].startswith("plan failed: ") and "exit code 3" in failed["message"], failed
    assert sorted(_jobs(k8s, namespace, "broken-corpus")) == ["broken-corpus-plan"]  # nothing after a failed step
    job = wait_for(
        lambda: (s := _status(k8s, namespace, "trainingjobs", "on-broken")).get("phase") == "Failed" and s,
        "the TrainingJob Failed",
        60,
    )
    assert _condition(job, "DataReady")["reason"] == "DatasetFailed" and "exit code 3" in job["message"], job


@pytest.mark.slow
def test_an_operator_killed_while_a_dataset_encodes_finishes_it_without_duplicate_jobs(
    k8s: Any, namespace: str, operator: Operator
) -> None:
    api = k8s.client.CustomObjectsApi()
    # KWOK's encode pods take 4 s each, 3 units on 2 pods: the kill lands while units are encoding.
    dataset = _dataset("restarted-corpus", E2E_TERMINATION_MESSAGE=json.dumps(SUMMARY))
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "latentdatasets", dataset)
    wait_for(
        lambda: _status(k8s, namespace, "latentdatasets", "restarted-corpus").get("phase") == "Encoding",
        "the dataset Encoding",
        120,
    )
    before = {n: j.metadata.uid for n, j in _jobs(k8s, namespace, "restarted-corpus").items()}
    assert sorted(before) == ["restarted-corpus-encode", "restarted-corpus-plan"]
    operator.kill_and_restart()

    ready = wait_for(
        lambda: (s := _status(k8s, namespace, "latentdatasets", "restarted-corpus")).get("phase") == "Ready" and s,
        "the dataset Ready after the restart",
        180,
    )
    after = {n: j.metadata.uid for n, j in _jobs(k8s, namespace, "restarted-corpus").items()}
    print(f"injected: operator SIGKILL while Encoding; found: jobs {sorted(after)}, status {ready}")
    # The Jobs the first operator made are the ones that ran: none made again, one finalize added.
    assert {n: after[n] for n in before} == before
    assert sorted(after) == sorted([*before, "restarted-corpus-finalize"])
    assert (ready["shardsDone"], ready["samplesEncoded"]) == (3, 6), ready


@pytest.mark.slow
def test_a_queued_dataset_is_admitted_by_kueue_and_suspends_through_its_workload(
    k8s: Any, cluster: Any, namespace: str, operator: Operator
) -> None:
    """spec.resources.queueName: each step's Job is created suspended with the queue label and Kueue admits it.
    spec.suspend on a queued dataset deactivates the step's Workload (Kueue owns the Job's flag, and would start a
    Job we suspended again): the Job stays suspended until the dataset is resumed, then the dataset finishes."""
    import uuid

    if "kueue" not in cluster.env.get("components", ()):
        pytest.fail("make cluster starts Kueue; this cluster has none (an older .cluster? make cluster-down)")
    api, suffix = k8s.client.CustomObjectsApi(), uuid.uuid4().hex[:6]
    kueue = ("kueue.x-k8s.io", "v1beta2")
    flavor, queue = f"cpu-{suffix}", f"prep-{suffix}"
    api.create_cluster_custom_object(*kueue, "resourceflavors", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": flavor}, "spec": {},
    })  # fmt: skip
    api.create_cluster_custom_object(*kueue, "clusterqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": queue},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["cpu", "memory"],
            "flavors": [{"name": flavor, "resources": [
                {"name": "cpu", "nominalQuota": "100"}, {"name": "memory", "nominalQuota": "1Ti"},
            ]}],
        }]},
    })  # fmt: skip
    try:
        api.create_namespaced_custom_object(*kueue, namespace, "localqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": "prep", "namespace": namespace}, "spec": {"clusterQueue": queue},
        })  # fmt: skip
        doc = _dataset("queued-corpus", E2E_TERMINATION_MESSAGE=json.dumps(SUMMARY))
        doc["spec"]["resources"]["queueName"] = "prep"
        doc["spec"]["suspend"] = True
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, "latentdatasets", doc)

        def workloads() -> list[dict[str, Any]]:
            return api.list_namespaced_custom_object(*kueue, namespace, "workloads")["items"]

        held = wait_for(
            lambda: [w for w in workloads() if (w.get("spec") or {}).get("active") is False] or None,
            "the plan step's Workload deactivated",
            60,
        )
        time.sleep(5)  # long enough for Kueue to have admitted it, were it active
        plan = _jobs(k8s, namespace, "queued-corpus")["queued-corpus-plan"]
        assert plan.spec.suspend is True and plan.metadata.labels["kueue.x-k8s.io/queue-name"] == "prep"
        assert _status(k8s, namespace, "latentdatasets", "queued-corpus")["phase"] == "Suspended"
        print(f"injected: a queued dataset suspended; found: Workload {held[0]['metadata']['name']} inactive, "
              "its Job suspended")  # fmt: skip

        api.patch_namespaced_custom_object(GROUP, VERSION, namespace, "latentdatasets", "queued-corpus",
                                           {"spec": {"suspend": False}})  # fmt: skip
        ready = wait_for(
            lambda: (s := _status(k8s, namespace, "latentdatasets", "queued-corpus")).get("phase") == "Ready" and s,
            "the resumed dataset Ready",
            180,
        )
        assert (ready["shardsDone"], ready["samplesEncoded"]) == (3, 6), ready
        jobs = _jobs(k8s, namespace, "queued-corpus").values()
        assert sorted(j.metadata.name for j in jobs) == [f"queued-corpus-{s}" for s in ("encode", "finalize", "plan")]
        assert all(j.metadata.labels["kueue.x-k8s.io/queue-name"] == "prep" for j in jobs)
        admitted = {w["metadata"]["name"] for w in workloads() if any(
            c["type"] == "Admitted" and c["status"] == "True" for c in (w.get("status") or {}).get("conditions") or []
        ) or any(c["type"] == "Finished" for c in (w.get("status") or {}).get("conditions") or [])}  # fmt: skip
        assert len(admitted) == 3, workloads()
    finally:
        api.delete_collection_namespaced_custom_object(*kueue, namespace, "localqueues")
        api.delete_cluster_custom_object(*kueue, "clusterqueues", queue)
        api.delete_cluster_custom_object(*kueue, "resourceflavors", flavor)
