"""TrainingJobs whose pods run in real containers: the real node `make cluster` starts (.ci/cluster/node.py:
containerd, a kubelet, CoreDNS) and the JAX trainer image `make images` built.

The operator runs here, as `wanloom operator` runs, with the chart's `trainerPods.env` giving every trainer pod the
GCS emulator's address; the jobs ask for the real node through spec.resources (its label and taint). Two JAX
processes in two pods find their coordinator by JobSet's pod hostname (cluster DNS), train the tiny model on
gs:// data and checkpoint to gs://; the operator reads progress from rank 0's pod and a real Prometheus scrapes it
at the address the chart's PodMonitor would select (Debian's Prometheus lacks Kubernetes discovery: the test lists
the pods with the PodMonitor's selector into a file); a pod killed mid-run restarts the JobSet, and the run resumes
from its last committed checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from wanloom_api.trainingjob import GROUP, PLURAL, VERSION

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "wanloom-real-node"
TIMEOUT = 420

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def node(cluster: Any) -> dict[str, Any]:
    if not cluster.env.get("node"):
        why = "the cluster has no real node (up.py said why: root, podman, the images)"
        if os.environ.get("WANLOOM_REQUIRE_E2E"):
            pytest.fail(f"{why}: CI requires it")
        pytest.skip(why)
    return cluster.env["node"]


@pytest.fixture(scope="module")
def storage(node: dict[str, Any], start_gcs_emulator: Any) -> Iterator[str]:
    """A GCS emulator the pods reach on the node's address."""
    with socket.socket() as s:
        s.bind((node["ip"], 0))
        port = s.getsockname()[1]
    server = start_gcs_emulator(node["ip"], port, BUCKET)
    yield f"http://{node['ip']}:{port}"
    server.stop()


@pytest.fixture(scope="module")
def namespace(k8s: Any) -> Iterator[str]:
    name = f"wanloom-node-{uuid.uuid4().hex[:6]}"
    core = k8s.client.CoreV1Api()
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A real Prometheus scraping every second the targets in a file (Debian's build has no Kubernetes discovery):
    yields its URL and the file, which `_discover` fills as the chart's PodMonitor selects pods."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed (make services)")
    workdir = tmp_path_factory.mktemp("prometheus")
    targets = workdir / "targets.json"
    targets.write_text("[]")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": "wanloom-trainers", "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(
        [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: process.poll() is None and _ready(url), "Prometheus", 30)
    yield url, targets
    process.terminate()
    process.wait(timeout=30)
    log.close()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _discover(k8s: Any, namespace: str, targets: Path) -> None:
    """What the chart's PodMonitor selects: pods the operator manages, at their `metrics` container port."""
    found = []
    for pod in (
        k8s.client.CoreV1Api()
        .list_namespaced_pod(namespace, label_selector="app.kubernetes.io/managed-by=wanloom-operator")
        .items
    ):
        ports = [p.container_port for c in pod.spec.containers for p in c.ports or () if p.name == "metrics"]
        if pod.status.pod_ip and ports:
            labels = {"namespace": namespace, "pod": pod.metadata.name}
            found.append({"targets": [f"{pod.status.pod_ip}:{ports[0]}"], "labels": labels})
    targets.write_text(json.dumps(found))


def _query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.load(response)["data"]["result"]
    except OSError:
        return []


@pytest.fixture(scope="module")
def operator(k8s: Any, cluster: Any, namespace: str, storage: str) -> Iterator[subprocess.Popen[str]]:
    pod_env = [
        {"name": "STORAGE_EMULATOR_HOST", "value": storage},
        {"name": "TENSORSTORE_GCS_HTTP_URL", "value": storage},
        {"name": "GOOGLE_CLOUD_PROJECT", "value": "wanloom-test"},
    ]
    env = {**os.environ, "KUBECONFIG": cluster.kubeconfig, "WANLOOM_LOG_FORMAT": "plain",
           "WANLOOM_PROGRESS_INTERVAL_SECONDS": "3",
           "WANLOOM_TRAINER_POD_DEFAULTS": json.dumps({"env": pod_env})}  # fmt: skip
    command = [sys.executable, "-c", "from wanloom_cli import main; main()", "operator", f"--namespace={namespace}",
               "--metrics-port=0", "--liveness-port=0"]  # fmt: skip
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield process
    api = k8s.client.CustomObjectsApi()
    api.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
    _wait(lambda: not api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"], "cleanup", 120)
    process.terminate()
    output, _ = process.communicate(timeout=60)
    print(output[-5000:])


def _trainingjob(name: str, namespace: str, node: dict[str, Any], steps: int, interval: int) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "jobs" / "tiny-local.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    spec = doc["spec"]
    spec["data"]["uri"] = f"gs://{BUCKET}/{namespace}/{name}/data"
    spec["training"].update(steps=steps)
    spec["training"]["checkpoint"] = {"uri": f"gs://{BUCKET}/{namespace}/{name}/checkpoints", "interval": interval}
    spec["optimizer"]["warmupSteps"] = 2
    spec["maxRestarts"] = 3
    spec["resources"] = {
        "cpu": {"nodes": 2, "devicesPerNode": 1},
        "nodeSelector": {node["label"]: "true"},
        "tolerations": [{"key": node["label"], "operator": "Exists", "effect": "NoSchedule"}],
    }
    return doc


def _wait(check: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _status(k8s: Any, namespace: str, name: str) -> dict[str, Any]:
    job = k8s.client.CustomObjectsApi().get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    return job.get("status") or {}


def _checkpoint_steps(storage: str, prefix: str) -> set[int]:
    from google.cloud import storage as gcs

    os.environ["STORAGE_EMULATOR_HOST"] = storage
    client = gcs.Client(project="wanloom-test")
    names = [blob.name for blob in client.list_blobs(BUCKET, prefix=prefix)]
    return {int(part) for name in names for part in name[len(prefix) :].split("/")[:1] if part.isdigit()}


def _pods(k8s: Any, namespace: str, name: str) -> list[Any]:
    return k8s.client.CoreV1Api().list_namespaced_pod(namespace, label_selector=f"wanloom.dev/trainingjob={name}").items


def _logs(k8s: Any, namespace: str, pods: list[Any]) -> str:
    core = k8s.client.CoreV1Api()
    return "\n".join(
        f"--- {p.metadata.name}\n{core.read_namespaced_pod_log(p.metadata.name, namespace)[-3000:]}" for p in pods
    )


def test_two_jax_pods_train_on_gcs_and_resume_after_a_pod_is_killed(
    k8s: Any, namespace: str, node: dict[str, Any], storage: str, prometheus: tuple[str, Path], operator: Any
) -> None:
    name, steps, interval = "tiny-two-pods", 150, 50
    api = k8s.client.CustomObjectsApi()
    api.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, _trainingjob(name, namespace, node, steps, interval)
    )
    prefix = f"{namespace}/{name}/checkpoints/"

    pods = _wait(lambda: [p for p in _pods(k8s, namespace, name) if p.status.phase == "Running"] or None, "pods")
    assert {p.spec.node_name for p in pods} == {node["name"]}
    url, targets = prometheus
    _discover(k8s, namespace, targets)
    # Progress read from rank 0's metrics through the pod's address: a committed checkpoint, mid-run.
    committed = _wait(
        lambda: ((_status(k8s, namespace, name).get("progress") or {}).get("lastCheckpointStep") or 0) >= interval,
        "a committed checkpoint in the status",
    )
    assert committed
    # Prometheus scraped the contract's series from rank 0's pod.
    series = _wait(lambda: _query(url, f'wanloom_loss{{namespace="{namespace}"}}'), "scraped series", 60)
    assert series[0]["metric"]["pod"] in {p.metadata.name for p in pods}

    # Killed as the node would kill it (out of memory, a crash): SIGKILL to the trainer's container.
    index = "batch.kubernetes.io/job-completion-index"
    victim = next(p for p in _pods(k8s, namespace, name) if p.metadata.annotations.get(index) == "1")
    container = victim.status.container_statuses[0].container_id.removeprefix("containerd://")
    ctr = [node["ctr"], "--address", node["socket"], "-n", "k8s.io"]
    subprocess.run([*ctr, "tasks", "kill", "-s", "SIGKILL", container], check=True, capture_output=True)

    status = _wait(
        lambda: (s := _status(k8s, namespace, name)).get("phase") in ("Succeeded", "Failed") and s,
        "the job to finish",
    )
    pods = _pods(k8s, namespace, name)
    assert status["phase"] == "Succeeded", (status, _logs(k8s, namespace, pods))
    assert status["restarts"] == 1
    assert {interval, steps} <= _checkpoint_steps(storage, prefix)
    # The second attempt's rank 0 resumed after a committed checkpoint instead of starting over.
    rank0 = next(p for p in pods if p.metadata.annotations.get(index) == "0")
    log = k8s.client.CoreV1Api().read_namespaced_pod_log(rank0.metadata.name, namespace)
    first = int(re.search(rf"step (\d+)/{steps}", log).group(1))
    assert first - 1 in (interval, 2 * interval), [line for line in log.splitlines() if "step" in line][:5]
