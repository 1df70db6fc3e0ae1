"""TrainingJobs whose pods run in real containers: the real node `make cluster` starts (.ci/cluster/node.py:
containerd, a kubelet, kube-proxy, CoreDNS) and the images `make images` built.

The chart is installed with Helm as a second release whose operator runs in-cluster on the real node, from the
operator image, as its own ServiceAccount with the chart's RBAC (watching only this test's namespace), reaching the
API server through the `kubernetes` Service, and live only while its probes pass; its `trainerPods.env` gives every
trainer pod the address of the GCS emulator `make cluster` runs on the host (where every bucket a job
names exists), and the jobs ask for the real node through spec.resources (its label and
taint). Two JAX processes in two pods find their coordinator by JobSet's pod hostname (cluster DNS), train the tiny
model on gs:// data and checkpoint to gs://; the operator reads progress from rank 0's pod, and a real Prometheus
scrapes the trainers at the address the chart's PodMonitor selects and the operator through its metrics Service's
endpoints (Debian's Prometheus lacks Kubernetes discovery: the test lists them into a file); a pod killed mid-run
restarts the JobSet, the run resumes from its last committed checkpoint and the operator counts the restart.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_wait import wait_for

from wanloom_api.trainingjob import GROUP, PLURAL, VERSION

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "wanloom-real-node"
CHART_DIR = ROOT / "helm" / "wanloom"
OPERATOR_RELEASE = "wanloom-node"
OPERATOR_SELECTOR = "app.kubernetes.io/component=operator"
GPU_IMAGE = "ghcr.io/wanloom/wanloom-trainer-gpu:0.1.0"
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
def storage(cluster: Any, node: dict[str, Any]) -> str:
    """The GCS emulator `make cluster` started on the node's address (every bucket a job names exists)."""
    return cluster.env["gcs"]


@pytest.fixture(scope="module")
def namespace(k8s: Any, module_namespace: str) -> str:
    return module_namespace


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


def _discover(k8s: Any, namespace: str, operator_namespace: str, targets: Path) -> None:
    """What the chart's PodMonitor selects (pods the operator manages, at their `metrics` container port) and what
    its ServiceMonitor scrapes (the endpoints of the operator's metrics Service)."""
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
    discovery = k8s.client.DiscoveryV1Api()
    for service in (
        k8s.client.CoreV1Api().list_namespaced_service(operator_namespace, label_selector=OPERATOR_SELECTOR).items
    ):
        selector = f"kubernetes.io/service-name={service.metadata.name}"
        for endpoints in discovery.list_namespaced_endpoint_slice(operator_namespace, label_selector=selector).items:
            port = next(p.port for p in endpoints.ports if p.name == "metrics")
            addresses = [a for e in endpoints.endpoints or () if e.conditions.ready for a in e.addresses]
            found += [{"targets": [f"{a}:{port}"], "labels": {"component": "operator"}} for a in addresses]
    targets.write_text(json.dumps(found))


def _query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.load(response)["data"]["result"]
    except OSError:
        return []


@pytest.fixture(scope="module")
def operator(k8s: Any, cluster: Any, namespace: str, storage: str, node: dict[str, Any]) -> Iterator[str]:
    """The chart's operator in-cluster on the real node (a second release; the session's release owns the CRDs).
    Yields the release's namespace once the operator's Deployment is available (its readiness probe passed)."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
    release_namespace = f"{namespace}-operator"
    pod_env = [
        {"name": "STORAGE_EMULATOR_HOST", "value": storage},
        {"name": "TENSORSTORE_GCS_HTTP_URL", "value": storage},
        {"name": "GOOGLE_CLOUD_PROJECT", "value": "wanloom-test"},
    ]
    values = {
        "crds": {"enabled": False},
        "dashboard": {"enabled": False},
        "trainerPods": {"env": pod_env},
        "operator": {
            "watch": {"allNamespaces": False, "namespaces": [namespace]},
            "logFormat": "plain",
            "extraEnv": [{"name": "WANLOOM_PROGRESS_INTERVAL_SECONDS", "value": "3"}],
            "nodeSelector": {node["label"]: "true"},
            "tolerations": [{"key": node["label"], "operator": "Exists", "effect": "NoSchedule"}],
        },
    }
    with helm.Config(kubeconfig_path=cluster.kubeconfig, namespace=release_namespace) as cfg:
        cfg.install(str(CHART_DIR), OPERATOR_RELEASE, values, namespace=release_namespace, create_namespace=True)
    core = k8s.client.CoreV1Api()
    try:
        _wait(lambda: _operator_pods(k8s, release_namespace, ready=True), "the operator pod ready", 180)
        yield release_namespace
    finally:
        api = k8s.client.CustomObjectsApi()
        api.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        _wait(lambda: not api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"], "cleanup")
        for pod in _operator_pods(k8s, release_namespace):
            print(
                f"--- operator {pod.metadata.name}\n"
                + core.read_namespaced_pod_log(pod.metadata.name, release_namespace)[-5000:]
            )
        with helm.Config(kubeconfig_path=cluster.kubeconfig, namespace=release_namespace) as cfg:
            cfg.uninstall(OPERATOR_RELEASE)
        core.delete_namespace(release_namespace)


def _operator_pods(k8s: Any, namespace: str, ready: bool = False) -> list[Any]:
    pods = k8s.client.CoreV1Api().list_namespaced_pod(namespace, label_selector=OPERATOR_SELECTOR).items
    if ready:
        pods = [p for p in pods if any(c.ready for c in p.status.container_statuses or ())]
    return pods


def _trainingjob(
    name: str, namespace: str, node: dict[str, Any], steps: int, interval: int, job: str = "tiny-local.yaml"
) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "jobs" / job).read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    spec = doc["spec"]
    spec["data"]["uri"] = f"gs://{BUCKET}/{namespace}/{name}/data"
    spec["training"].update(steps=steps)
    spec["training"]["checkpoint"] = {"uri": f"gs://{BUCKET}/{namespace}/{name}/checkpoints", "interval": interval}
    spec["optimizer"]["warmupSteps"] = 2
    spec["maxRestarts"] = 3
    spec["resources"] = {
        **({"backend": spec["resources"]["backend"]} if "backend" in spec["resources"] else {}),
        "cpu": {"nodes": 2, "devicesPerNode": 1},
        "nodeSelector": {node["label"]: "true"},
        "tolerations": [{"key": node["label"], "operator": "Exists", "effect": "NoSchedule"}],
    }
    return doc


def _wait(check: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
    return wait_for(check, what, timeout)


def _status(k8s: Any, namespace: str, name: str) -> dict[str, Any]:
    job = k8s.client.CustomObjectsApi().get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    return job.get("status") or {}


def _checkpoint_steps(storage: str, prefix: str, files: str = "") -> set[int]:
    """Steps with a checkpoint under ``prefix``: orbax's ``N/`` or DCP's ``step_NNNNNNNN/`` folders (with DCP, only
    those holding every one of ``files``)."""
    from google.cloud import storage as gcs

    os.environ["STORAGE_EMULATOR_HOST"] = storage
    client = gcs.Client(project="wanloom-test")
    found: dict[int, set[str]] = {}
    for blob in client.list_blobs(BUCKET, prefix=prefix):
        folder, _, rest = blob.name[len(prefix) :].partition("/")
        if folder.removeprefix("step_").isdigit():
            found.setdefault(int(folder.removeprefix("step_")), set()).add(rest)
    return {step for step, names in found.items() if set(files.split()) <= names}


def _pods(k8s: Any, namespace: str, name: str) -> list[Any]:
    return k8s.client.CoreV1Api().list_namespaced_pod(namespace, label_selector=f"wanloom.dev/trainingjob={name}").items


def _rank0_log(k8s: Any, namespace: str, name: str) -> str:
    """The log of the job's rank-0 pod: "" while there is none or its container has not started (the API server
    answers 400 for a container still being created)."""
    index = "batch.kubernetes.io/job-completion-index"
    pods = [p for p in _pods(k8s, namespace, name) if p.metadata.annotations.get(index) == "0"]
    try:
        return (k8s.client.CoreV1Api().read_namespaced_pod_log(pods[0].metadata.name, namespace) or "") if pods else ""
    except k8s.client.exceptions.ApiException:
        return ""


def _logs(k8s: Any, namespace: str, pods: list[Any]) -> str:
    core = k8s.client.CoreV1Api()
    return "\n".join(
        f"--- {p.metadata.name}\n{core.read_namespaced_pod_log(p.metadata.name, namespace)[-3000:]}" for p in pods
    )


def test_the_node_keeps_only_the_images_of_this_build(node: dict[str, Any]) -> None:
    # Each `make images` re-imports the trainer image; the builds before it must leave containerd's store, or it
    # grows by gigabytes a build until the disk is full (it did: CI failed with ENOSPC).
    ctr = [node["ctr"], "--address", node["socket"], "-n", "k8s.io"]
    names = subprocess.run([*ctr, "images", "ls", "-q"], check=True, capture_output=True, text=True).stdout.split()
    tags = [n for n in names if not n.startswith("sha256:")]
    assert set(node["images"]) <= set(tags)
    assert [t for t in tags if t not in node["images"]] == [
        next(t for t in tags if t.startswith("registry.k8s.io/pause:"))
    ]
    # One ID per tag (the CRI names each image by its ID too); a stale build would add one.
    assert len([n for n in names if n.startswith("sha256:")]) == len(tags), names


def test_two_jax_pods_train_on_gcs_and_resume_after_a_pod_is_killed(
    k8s: Any, namespace: str, node: dict[str, Any], storage: str, prometheus: tuple[str, Path], operator: str
) -> None:
    # The operator runs in a real container on the real node, on the chart's ServiceAccount, its probes passing.
    (operator_pod,) = _operator_pods(k8s, operator, ready=True)
    assert operator_pod.spec.node_name == node["name"]
    assert operator_pod.spec.service_account_name == OPERATOR_RELEASE
    assert operator_pod.status.container_statuses[0].image == node["images"][0]

    name, steps, interval = "tiny-two-pods", 150, 50
    api = k8s.client.CustomObjectsApi()
    api.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, _trainingjob(name, namespace, node, steps, interval)
    )
    prefix = f"{namespace}/{name}/checkpoints/"

    # Both ranks' pods (rank 0's may start after rank 1's): the series scraped below comes from rank 0's.
    running = lambda: [p for p in _pods(k8s, namespace, name) if p.status.phase == "Running"]
    pods = _wait(lambda: len(r := running()) == 2 and r, "both pods running")
    assert {p.spec.node_name for p in pods} == {node["name"]}
    url, targets = prometheus
    _discover(k8s, namespace, operator, targets)
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
    # ...and the operator's own metrics, scraped through its Service's endpoints, count it.
    restarts = _wait(lambda: _query(url, 'wanloom_operator_job_restarts{component="operator"} >= 1'), "restarts", 60)
    assert float(restarts[0]["value"][1]) == 1
    assert _operator_pods(k8s, operator)[0].status.container_statuses[0].restart_count == 0
    assert {interval, steps} <= _checkpoint_steps(storage, prefix)
    # The second attempt's rank 0 resumed after a committed checkpoint instead of starting over.
    rank0 = next(p for p in pods if p.metadata.annotations.get(index) == "0")
    log = k8s.client.CoreV1Api().read_namespaced_pod_log(rank0.metadata.name, namespace)
    first = int(re.search(rf"step (\d+)/{steps}", log).group(1))
    assert first - 1 in (interval, 2 * interval), [line for line in log.splitlines() if "step" in line][:5]


def test_two_torch_pods_train_through_the_gpu_images_launcher(
    k8s: Any, namespace: str, node: dict[str, Any], storage: str, operator: str
) -> None:
    """The GPU image's path on CPU: each pod's launcher starts one worker, the two join one gloo group through
    rank 0's JobSet hostname (the launcher's static rendezvous), train and checkpoint to gs://."""
    if GPU_IMAGE not in node["images"]:
        why = f'{GPU_IMAGE} is not built here (make images IMAGES="operator tpu gpu"; 6 GB, not built in CI)'
        pytest.skip(why)
    name, steps, interval = "tiny-torch-pods", 20, 10
    k8s.client.CustomObjectsApi().create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, _trainingjob(name, namespace, node, steps, interval, "tiny-local-torch.yaml")
    )
    status = _wait(
        lambda: (s := _status(k8s, namespace, name)).get("phase") in ("Succeeded", "Failed") and s,
        "the torch job to finish",
    )
    pods = _pods(k8s, namespace, name)
    assert status["phase"] == "Succeeded", (status, _logs(k8s, namespace, pods))
    assert status.get("restarts", 0) == 0
    assert {p.spec.containers[0].image for p in pods} == {GPU_IMAGE}
    assert {tuple(p.spec.containers[0].command) for p in pods} == {("python", "-m", "wanloom_trainer.launcher")}
    # DCP checkpoints written by both ranks (one shard file each) and committed (.metadata last).
    files = "__0_0.distcp __1_0.distcp .metadata"
    assert {interval, steps} <= _checkpoint_steps(storage, f"{namespace}/{name}/checkpoints/", files)


def test_a_pod_whose_data_fails_ends_the_job_at_once_with_its_reason(
    k8s: Any, namespace: str, node: dict[str, Any], storage: str, operator: str, tmp_path: Path
) -> None:
    """Pod 1 finds a corrupt sample at its first step (maxBadSamples 0): a failure of the job's inputs, which a
    restart would repeat. Its trainer exits at once with the configuration-error status, the JobSet fails without
    restarting, and the TrainingJob says why; pod 0, blocked in a collective with it, does not hold the run for a
    restart cycle (it waited in jax.distributed's shutdown barrier for five minutes per attempt before)."""
    from wanloom_api.validation import parse_trainingjob
    from wanloom_trainer.checkpoint.gcs import GcsLocation, upload_dir

    name = "tiny-bad-data"
    doc = _trainingjob(name, namespace, node, steps=100, interval=50)
    doc["spec"]["data"]["maxBadSamples"] = 0
    sample = _tiny_job().corrupt_sample_of_rank(parse_trainingjob(doc), tmp_path / "data", 1, tmp_path / "run")
    os.environ["STORAGE_EMULATOR_HOST"] = storage
    os.environ.setdefault("GOOGLE_CLOUD_PROJECT", "wanloom-test")
    upload_dir(tmp_path / "data", GcsLocation.parse(doc["spec"]["data"]["uri"]))
    started = time.monotonic()
    k8s.client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    status = _wait(
        lambda: (s := _status(k8s, namespace, name)).get("phase") in ("Succeeded", "Failed") and s,
        "the job to fail",
    )
    took = time.monotonic() - started
    pods = _pods(k8s, namespace, name)
    print(f"injected: corrupt sample {sample} read by pod 1; found: {status['phase']} after {took:.0f} s, "
          f"{status.get('restarts', 0)} restarts: {status.get('message')!r}")  # fmt: skip
    assert status["phase"] == "Failed", (status, _logs(k8s, namespace, pods))
    assert status.get("restarts", 0) == 0
    index = "batch.kubernetes.io/job-completion-index"
    second = next(p.metadata.name for p in pods if p.metadata.annotations.get(index) == "1")
    assert status["message"].startswith(f"pod {second}: wanloom trainer: "), status["message"]
    assert "maxBadSamples" in status["message"], status["message"]
    assert took < 180, f"{took:.0f} s to fail"  # pods start in ~20 s; a restart cycle was 5 minutes


def _tiny_job() -> Any:
    """tests/trainer/train/scripts/tiny_job.py (its helpers build and break the tiny job's data)."""
    path = ROOT / "tests" / "trainer" / "train" / "scripts" / "tiny_job.py"
    spec = importlib.util.spec_from_file_location("wanloom_e2e_tiny_job", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_evicted_pod_checkpoints_its_step_and_the_restart_is_not_counted(
    k8s: Any, namespace: str, node: dict[str, Any], storage: str, operator: str
) -> None:
    """Preemption as a cluster delivers it: the Eviction API on one pod of a running job. The pod gets SIGTERM,
    both ranks checkpoint the current step (not the last interval's) and exit 143, the pod failure policy turns the
    eviction (condition DisruptionTarget) into a restart that does not count against maxRestarts, and the next
    attempt starts right after the preemption checkpoint."""
    name, steps, interval = "tiny-evicted", 120, 100
    doc = _trainingjob(name, namespace, node, steps, interval)
    doc["spec"]["maxRestarts"] = 0  # a counted restart would fail the job
    doc["spec"]["training"]["checkpoint"]["keep"] = 10  # the preemption checkpoint stays for the check
    k8s.client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    core = k8s.client.CoreV1Api()
    index = "batch.kubernetes.io/job-completion-index"

    def rank0_log() -> str:
        return _rank0_log(k8s, namespace, name)

    _wait(lambda: re.search(rf"step (\d\d+)/{steps}", rank0_log()), "step 10 on rank 0")
    victim = next(p for p in _pods(k8s, namespace, name) if p.metadata.annotations.get(index) == "1")
    eviction = k8s.client.V1Eviction(metadata=k8s.client.V1ObjectMeta(name=victim.metadata.name, namespace=namespace))
    core.create_namespaced_pod_eviction(victim.metadata.name, namespace, eviction)
    evicted_at = re.findall(rf"step (\d+)/{steps}", rank0_log())[-1]

    status = _wait(
        lambda: (s := _status(k8s, namespace, name)).get("phase") in ("Succeeded", "Failed") and s,
        "the job to finish",
    )
    pods = _pods(k8s, namespace, name)
    assert status["phase"] == "Succeeded", (status, _logs(k8s, namespace, pods))
    jobset = k8s.client.CustomObjectsApi().get_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", name
    )
    counted = (jobset.get("status") or {}).get("restartsCountTowardsMax", 0)
    saved = sorted(_checkpoint_steps(storage, f"{namespace}/{name}/checkpoints/"))
    preemption = [s for s in saved if s % interval and s != steps]  # the interval's and the final one aside
    rank0 = next(p for p in pods if p.metadata.annotations.get(index) == "0")
    first = int(re.search(rf"step (\d+)/{steps}", core.read_namespaced_pod_log(rank0.metadata.name, namespace))[1])
    print(f"injected: eviction of pod 1 near step {evicted_at}; found: restarts {status['restarts']} "
          f"({counted} counted), checkpoints {saved}, second attempt from step {first}")  # fmt: skip
    assert status["restarts"] == 1 and counted == 0
    assert len(preemption) == 1 and preemption[0] >= int(evicted_at), saved  # the step it was on, not step 100
    assert first - 1 == preemption[0]


def test_storage_gone_while_a_checkpoint_is_written_is_waited_out(
    k8s: Any, cluster: Any, namespace: str, node: dict[str, Any], storage: str, operator: str
) -> None:
    """Storage stops answering for 45 s from the first upload of checkpoint 20's arrays (a proxy of this test's
    own, on the host's address, in front of the emulator: other tests keep their storage). Training waits, nothing
    crashes or restarts, checkpoint 20 is never listed as committed, the state is saved again once storage is back,
    and a pod killed afterwards resumes from the last complete checkpoint."""
    from storage_proxy import FlakyProxy

    proxy = FlakyProxy(storage, fail_every=0, mode="drop", host=cluster.env["host_ip"])
    name, steps, interval, down_s = "tiny-storage-outage", 150, 20, 45.0
    prefix = f"{namespace}/{name}/checkpoints/"
    doc = _trainingjob(name, namespace, node, steps, interval)
    doc["spec"]["maxRestarts"] = 1  # the kill below, and nothing else
    doc["spec"]["training"]["checkpoint"]["keep"] = 20
    doc["spec"]["resources"]["env"] = [
        {"name": "STORAGE_EMULATOR_HOST", "value": proxy.address},
        {"name": "TENSORSTORE_GCS_HTTP_URL", "value": proxy.address},
    ]
    # From the first upload of the arrays: the bulk of a checkpoint, written after the save's first few ms (see
    # docs/reliability.md for an outage that starts within those).
    proxy.go_down_on(f"{prefix}{interval}/state/", down_s, method="POST")
    core = k8s.client.CoreV1Api()
    index = "batch.kubernetes.io/job-completion-index"

    def rank0_log() -> str:
        return _rank0_log(k8s, namespace, name)

    try:
        k8s.client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
        commits = lambda: [int(n) for n in re.findall(r"checkpoint for step (\d+) committed", rank0_log())]
        resaved = _wait(lambda: [n for n in commits() if n > interval], "a checkpoint committed after the outage")
        log = rank0_log()
        lost = [line[:300] for line in log.splitlines() if "commit" in line or "storage" in line]
        assert f"checkpoint for step {interval} not committed, storage did not answer" in log, (lost, proxy.outages)
        committed = _checkpoint_steps(storage, prefix, "commit_success.txt")
        assert interval not in committed and resaved[0] in committed, (committed, resaved)
        assert _status(k8s, namespace, name).get("restarts", 0) == 0
        # A later crash: the next attempt starts from the last complete checkpoint.
        victim = next(p for p in _pods(k8s, namespace, name) if p.metadata.annotations.get(index) == "1")
        before_kill = max(_checkpoint_steps(storage, prefix, "commit_success.txt"))
        core.delete_namespaced_pod(victim.metadata.name, namespace, grace_period_seconds=0)
        status = _wait(
            lambda: (s := _status(k8s, namespace, name)).get("phase") in ("Succeeded", "Failed") and s,
            "the job to finish",
        )
        pods = _pods(k8s, namespace, name)
        assert status["phase"] == "Succeeded", (status, _logs(k8s, namespace, pods))
        first = int(re.search(rf"step (\d+)/{steps}", rank0_log())[1])
        committed = _checkpoint_steps(storage, prefix, "commit_success.txt")
        print(f"injected: storage down {down_s:.0f} s from {proxy.outages[0][0]!r}, then pod 1 killed after "
              f"checkpoint {before_kill}; found: restarts {status['restarts']}, checkpoints {sorted(committed)}, "
              f"second attempt from step {first}, saved again at {resaved[0]}")  # fmt: skip
        assert len(proxy.outages) == 1 and status["restarts"] == 1
        assert interval not in committed and steps in committed
        assert first - 1 >= before_kill and first - 1 in committed
    finally:
        proxy.close()


def test_storage_gone_longer_than_storage_outage_seconds_fails_the_job_naming_storage(
    k8s: Any, cluster: Any, namespace: str, node: dict[str, Any], storage: str, operator: str
) -> None:
    """Storage stops answering from checkpoint 5's first array upload and does not come back within
    ``spec.data.storageOutageSeconds`` (10 s): the trainers stop waiting, the job fails without a restart, and its
    message names storage and the field, so the user knows what to fix and how long the run waited."""
    from storage_proxy import FlakyProxy

    proxy = FlakyProxy(storage, fail_every=0, mode="drop", host=cluster.env["host_ip"])
    name, steps, interval, limit_s, down_s = "tiny-storage-gone", 100, 5, 10, 120.0
    prefix = f"{namespace}/{name}/checkpoints/"
    doc = _trainingjob(name, namespace, node, steps, interval)
    doc["spec"]["maxRestarts"] = 0  # the failure is the job's: a restart would only wait again
    doc["spec"]["data"]["storageOutageSeconds"] = limit_s
    doc["spec"]["resources"]["env"] = [
        {"name": "STORAGE_EMULATOR_HOST", "value": proxy.address},
        {"name": "TENSORSTORE_GCS_HTTP_URL", "value": proxy.address},
    ]
    proxy.go_down_on(f"{prefix}{interval}/state/", down_s, method="POST")
    try:
        k8s.client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
        status = _wait(
            lambda: (s := _status(k8s, namespace, name)).get("phase") in ("Succeeded", "Failed") and s,
            "the job to fail",
        )
        pods = _pods(k8s, namespace, name)
        outage = proxy.outages[0] if proxy.outages else None
        print(f"injected: storage down {down_s:.0f} s from {outage and outage[0]!r} with storageOutageSeconds "
              f"{limit_s}; found: {status['phase']}, {status.get('restarts', 0)} restarts, "
              f"message {status.get('message')!r}")  # fmt: skip
        assert outage is not None and status["phase"] == "Failed", (status, _logs(k8s, namespace, pods))
        assert status.get("restarts", 0) == 0
        message = status.get("message") or ""
        assert "StorageOutage: storage for " in message and f"storageOutageSeconds={limit_s}" in message, message
        assert interval not in _checkpoint_steps(storage, prefix, "commit_success.txt")
    finally:
        proxy.close()


def _allowed(k8s: Any, user: str, verb: str, resource: str, namespace: str, group: str = "") -> bool:
    """The API server's own answer (SubjectAccessReview) to whether ``user`` may ``verb`` ``resource``."""
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{user.split(':')[2]}", "system:authenticated"]
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "groups": groups,
            "resourceAttributes": {"verb": verb, "resource": resource, "group": group, "namespace": namespace},
        },
    }
    return bool(k8s.client.AuthorizationV1Api().create_subject_access_review(review).status.allowed)


def test_bad_actors_are_kept_out(k8s: Any, namespace: str, operator: str, node: dict[str, Any]) -> None:
    """What the installed chart grants, as the API server decides it: the operator's ServiceAccount reads no Secret
    and creates no pod (JobSet does), nothing outside its watched namespace; a trainer pod's ServiceAccount cannot
    touch the operator's ConfigMaps; a TrainingJob in a namespace the operator does not watch is left alone."""
    operator_sa = f"system:serviceaccount:{operator}:{OPERATOR_RELEASE}"
    trainer_sa = f"system:serviceaccount:{namespace}:default"
    other = f"{namespace}-unwatched"
    checks = {
        ("operator", "list", "pods", namespace, ""): True,  # what it needs: the check can fail
        ("operator", "create", "jobsets", namespace, "jobset.x-k8s.io"): True,
        ("operator", "get", "secrets", namespace, ""): False,
        ("operator", "list", "secrets", operator, ""): False,
        ("operator", "create", "pods", namespace, ""): False,
        ("operator", "create", "jobsets", other, "jobset.x-k8s.io"): False,
        ("operator", "patch", "trainingjobs", other, GROUP): False,
        ("trainer", "patch", "configmaps", namespace, ""): False,
        ("trainer", "update", "configmaps", operator, ""): False,
        ("trainer", "patch", "trainingjobs", namespace, GROUP): False,
    }
    found = {key: _allowed(k8s, operator_sa if key[0] == "operator" else trainer_sa, *key[1:]) for key in checks}
    print("injected: SubjectAccessReviews; found:", {" ".join(k[:4]): v for k, v in found.items()})
    assert found == checks

    core = k8s.client.CoreV1Api()
    core.create_namespace({"metadata": {"name": other}})
    try:
        doc = _trainingjob("tiny-unwatched", other, node, 10, 10)
        k8s.client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, other, PLURAL, doc)
        time.sleep(15)  # five of the operator's progress intervals, and its watch is live (the fixture waited)
        jobsets = k8s.client.CustomObjectsApi().list_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", other, "jobsets"
        )["items"]
        status = _status(k8s, other, "tiny-unwatched")
        print(f"injected: a TrainingJob in {other}; found: {len(jobsets)} JobSets, status {status}")
        assert jobsets == [] and status == {}
    finally:
        core.delete_namespace(other)


def test_the_operator_restarted_mid_run_picks_the_job_up_again(
    k8s: Any, namespace: str, node: dict[str, Any], storage: str, operator: str
) -> None:
    """The in-cluster operator's pod deleted while a job runs (a node drain, an upgrade): its Deployment starts a
    new one, which adopts the JobSet it finds instead of creating another; progress resumes in the status, the job
    finishes once, and the phase read meanwhile is always a true one."""
    name, steps, interval = "tiny-operator-restart", 150, 75
    api, core = k8s.client.CustomObjectsApi(), k8s.client.CoreV1Api()
    doc = _trainingjob(name, namespace, node, steps, interval)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    _wait(lambda: ((_status(k8s, namespace, name).get("progress") or {}).get("step") or 0) >= 5, "progress")
    jobset = api.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", name)
    jobset_uid = jobset["metadata"]["uid"]
    (old,) = _operator_pods(k8s, operator, ready=True)
    core.delete_namespaced_pod(old.metadata.name, operator, grace_period_seconds=0)
    deleted = time.time()
    phases = set()

    def finished() -> dict[str, Any] | bool:
        status = _status(k8s, namespace, name)
        phases.add(status.get("phase"))
        return status.get("phase") in ("Succeeded", "Failed") and status

    status = _wait(finished, "the job to finish")
    new = [p for p in _operator_pods(k8s, operator, ready=True) if p.metadata.name != old.metadata.name]
    jobsets = api.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets")["items"]
    ours = [j for j in jobsets if j["metadata"]["name"] == name]
    updated = (status.get("progress") or {}).get("updatedAt")
    same = bool(ours) and ours[0]["metadata"]["uid"] == jobset_uid
    print(f"injected: the operator pod deleted mid-run; found: {status['phase']}, phases seen "
          f"{sorted(map(str, phases))}, a new operator pod {bool(new)}, JobSets {len(ours)} (same uid: {same}), "
          f"progress updated at {updated}")  # fmt: skip
    assert status["phase"] == "Succeeded", (status, _logs(k8s, namespace, _pods(k8s, namespace, name)))
    assert new and len(ours) == 1 and same
    assert status.get("restarts", 0) == 0
    assert phases <= {"Starting", "Running", "Succeeded"}, phases
    assert updated and _seconds(updated) > deleted  # the new operator read rank 0's progress


def _component(action: str, name: str) -> None:
    """Stop, start or restart one process of `make cluster` (.ci/cluster/component.py)."""
    subprocess.run([sys.executable, ROOT / ".ci" / "cluster" / "component.py", action, name], check=True)


class _PhaseWatch:
    """Every phase the TrainingJob's status showed, read once a second on a thread (reads that fail while the API
    server is away are counted, not recorded)."""

    def __init__(self, k8s: Any, namespace: str, name: str) -> None:
        self.k8s, self.namespace, self.name = k8s, namespace, name
        self.phases: list[str] = []
        self.unanswered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                phase = _status(self.k8s, self.namespace, self.name).get("phase")
            except Exception:  # the API server is away: that is the fault being injected
                self.unanswered += 1
                continue
            if phase and (not self.phases or self.phases[-1] != phase):
                self.phases.append(phase)

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join()
        return self.phases


def _answers(k8s: Any) -> bool:
    try:
        return bool(k8s.client.VersionApi().get_code(_request_timeout=2))
    except Exception:  # refused or reset while it starts
        return False


@pytest.mark.disruptive
def test_the_api_server_restarted_mid_run_loses_nothing(
    k8s: Any, namespace: str, node: dict[str, Any], storage: str, operator: str
) -> None:
    """kube-apiserver stopped and started again (an upgrade, a crash) under a running job: every client's watch
    (the operator's, the kubelet's, JobSet's) recovers, progress resumes in the status, the job finishes once with
    no restart and one JobSet, and the phase read meanwhile is always a true one."""
    name, steps, interval = "tiny-apiserver-restart", 150, 75
    api = k8s.client.CustomObjectsApi()
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _trainingjob(name, namespace, node, steps,
                                                                                          interval))  # fmt: skip
    watch = _PhaseWatch(k8s, namespace, name)
    try:
        step = lambda: (_status(k8s, namespace, name).get("progress") or {}).get("step") or 0
        before = _wait(lambda: (n := step()) >= 5 and n, "progress")
        jobset_uid = api.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", name)[
            "metadata"
        ]["uid"]
        stopped = time.monotonic()
        _component("restart", "kube-apiserver")
        _wait(lambda: _answers(k8s), "the API server back", 60)
        away_s = time.monotonic() - stopped
        restarted = time.time()
        resumed = _wait(
            lambda: (
                (p := _status(k8s, namespace, name).get("progress") or {}).get("step", 0) > before
                and _seconds(p["updatedAt"]) > restarted
                and p
            ),
            "progress after the restart",
        )
        status = _wait(
            lambda: (s := _status(k8s, namespace, name)).get("phase") in ("Succeeded", "Failed") and s,
            "the job to finish",
        )
    finally:
        phases = watch.stop()
    jobsets = api.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets")["items"]
    ours = [j["metadata"]["uid"] for j in jobsets if j["metadata"]["name"] == name]
    print(f"injected: kube-apiserver restarted at step {before} (away {away_s:.1f} s, {watch.unanswered} reads "
          f"unanswered); found: {status['phase']}, phases {phases}, progress step {resumed['step']} after it, "
          f"JobSets {ours} (first {jobset_uid}), restarts {status.get('restarts', 0)}")  # fmt: skip
    assert status["phase"] == "Succeeded", (status, _logs(k8s, namespace, _pods(k8s, namespace, name)))
    assert ours == [jobset_uid] and status.get("restarts", 0) == 0
    assert set(phases) <= {"Starting", "Running", "Succeeded"}, phases  # the watch may stop before it reads the end


def _node_ready(k8s: Any, name: str) -> str:
    node = k8s.client.CoreV1Api().read_node(name)
    return next((c.status for c in node.status.conditions or () if c.type == "Ready"), "Unknown")


@pytest.mark.disruptive
def test_a_node_lost_under_a_running_job_is_reported_and_the_job_finishes(
    k8s: Any, namespace: str, node: dict[str, Any], storage: str, operator: str
) -> None:
    """The real node's kubelet stopped until the node controller marks the node NotReady (its pods not ready), then
    started: the containers ran on meanwhile, so the job stays Running with Degraded=True (never Starting or
    Failed), finishes Succeeded without a restart and with one JobSet, and its checkpoint steps only increase."""
    name, steps, interval = "tiny-node-lost", 150, 25
    api = k8s.client.CustomObjectsApi()
    doc = _trainingjob(name, namespace, node, steps, interval)
    doc["spec"]["training"]["checkpoint"]["keep"] = 20
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    watch = _PhaseWatch(k8s, namespace, name)
    stopped = False
    try:
        _wait(lambda: ((_status(k8s, namespace, name).get("progress") or {}).get("step") or 0) >= 5, "progress")
        jobset_uid = api.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", name)[
            "metadata"
        ]["uid"]
        _component("stop", "kubelet")
        stopped, lost_at = True, time.monotonic()
        _wait(lambda: _node_ready(k8s, node["name"]) != "True", "the node NotReady", 180)
        not_ready_after = time.monotonic() - lost_at
        conditions = lambda: {c["type"]: c for c in _status(k8s, namespace, name).get("conditions") or ()}
        degraded = _wait(lambda: (c := conditions().get("Degraded")) and c["status"] == "True" and c, "Degraded", 60)
        phase_while_lost = _status(k8s, namespace, name)["phase"]
        _component("start", "kubelet")
        stopped = False
        lost_s = time.monotonic() - lost_at
        _wait(lambda: _node_ready(k8s, node["name"]) == "True", "the node Ready again", 120)
        status = _wait(
            lambda: (s := _status(k8s, namespace, name)).get("phase") in ("Succeeded", "Failed") and s,
            "the job to finish",
        )
    finally:
        if stopped:
            _component("start", "kubelet")
        phases = watch.stop()
    jobsets = api.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets")["items"]
    ours = [j["metadata"]["uid"] for j in jobsets if j["metadata"]["name"] == name]
    pods = _pods(k8s, namespace, name)
    index = "batch.kubernetes.io/job-completion-index"
    rank0 = next(p for p in pods if p.metadata.annotations.get(index) == "0")
    log = k8s.client.CoreV1Api().read_namespaced_pod_log(rank0.metadata.name, namespace)
    commits = [int(n) for n in re.findall(r"checkpoint for step (\d+) committed", log)]
    final = {c["type"]: c for c in status.get("conditions") or ()}
    print(f"injected: kubelet stopped {lost_s:.0f} s (node NotReady after {not_ready_after:.0f} s); found: "
          f"{status['phase']}, phases {phases}, phase while lost {phase_while_lost}, Degraded {degraded['message']!r} "
          f"then {final['Degraded']['status']}, restarts {status.get('restarts', 0)}, JobSets {len(ours)}, "
          f"checkpoints committed in order {commits}")  # fmt: skip
    assert status["phase"] == "Succeeded", (status, _logs(k8s, namespace, pods))
    assert phase_while_lost == "Running" and set(phases) <= {"Starting", "Running", "Succeeded"}, phases
    assert final["Degraded"]["status"] == "False"
    assert ours == [jobset_uid] and status.get("restarts", 0) == 0
    assert commits == sorted(set(commits)) and commits[-1] == steps  # one writer per step, steps only increase
    assert set(commits) <= _checkpoint_steps(storage, f"{namespace}/{name}/checkpoints/", "commit_success.txt")


def _seconds(rfc3339: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def _tiny_media() -> Any:
    """tests/trainer/data/tiny_media.py: the tiny encoders and the video writer of the data tests."""
    path = ROOT / "tests" / "trainer" / "data" / "tiny_media.py"
    spec = importlib.util.spec_from_file_location("wanloom_e2e_tiny_media", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _corpus(folder: Path, media: Any) -> tuple[list[dict[str, Any]], set[str]]:
    """40 manifest rows: images of assorted sizes and short mp4 clips, plus broken ones (corrupt, empty, missing,
    uncaptioned, too short for every bucket); returns the rows and the ids that must be skipped."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(7)
    words = list(media.TOKENIZER_WORDS)
    rows = []
    for i in range(30):
        name = f"img-{i:02d}.png"
        h, w = int(rng.integers(48, 120)), int(rng.integers(48, 120))
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / name)
        rows.append({"path": name, "caption": " ".join(rng.choice(words, 5)), "id": f"img-{i:02d}"})
    for i in range(5):
        name = f"clip-{i}.mp4"
        media.write_video(folder / name, frames=12 + 4 * i, height=64 + 8 * i, width=72, fps=16)
        rows.append({"path": name, "caption": f"the dog runs {i}", "id": f"clip-{i}"})
    (folder / "corrupt.png").write_bytes(b"\x89PNG not really")
    (folder / "empty.mp4").write_bytes(b"")
    media.write_video(folder / "short.mp4", frames=3, height=64, width=64, fps=16)  # shorter than every clip bucket
    rows += [
        {"path": "corrupt.png", "caption": "a cat", "id": "corrupt"},
        {"path": "empty.mp4", "caption": "a dog", "id": "empty"},
        {"path": "gone.png", "caption": "a bird", "id": "gone"},
        {"path": "img-00.png", "id": "uncaptioned"},
        {"path": "short.mp4", "caption": "a blue sky", "id": "short"},
    ]
    broken = {"corrupt", "empty", "gone", "uncaptioned", "short"}
    return rows, broken


def test_a_latentdataset_is_encoded_by_two_pods_and_a_trainingjob_trains_on_it(
    k8s: Any, namespace: str, node: dict[str, Any], storage: str, operator: str, tmp_path: Path
) -> None:
    """The LatentDataset path in real containers: a JSONL manifest and 40 media in the GCS emulator, the tiny
    encoders' weights there too; the operator plans, runs the Indexed encode Job as two pods of the TPU image (the
    JAX encoders on the CPU; no PyTorch in that image) and finalizes; one encode pod is deleted mid-run and its unit
    is redone. Every tensor equals a single-process `wanloom data prepare` of the same manifest, the skipped list
    names exactly the broken inputs, and a TrainingJob that named the dataset waited, then trained on it."""
    import numpy as np

    from wanloom_trainer.checkpoint.gcs import GcsLocation, upload_dir
    from wanloom_trainer.data.bucketing import parse_bucket
    from wanloom_trainer.data.prepare.pipeline import PrepareConfig, prepare
    from wanloom_trainer.data.reader import open_dataset

    os.environ["STORAGE_EMULATOR_HOST"] = storage
    os.environ.setdefault("GOOGLE_CLOUD_PROJECT", "wanloom-test")
    media = _tiny_media()
    root = f"gs://{BUCKET}/{namespace}"
    encoders = media.write_tiny_encoders(tmp_path / "encoders")
    upload_dir(encoders, GcsLocation.parse(f"{root}/encoders"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rows, broken = _corpus(corpus, media)
    (corpus / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    upload_dir(corpus, GcsLocation.parse(f"{root}/corpus"))

    placement = {"nodeSelector": {node["label"]: "true"},
                 "tolerations": [{"key": node["label"], "operator": "Exists", "effect": "NoSchedule"}]}  # fmt: skip
    buckets = [{"frames": 1, "height": 64, "width": 64}, {"frames": 9, "height": 64, "width": 64}]
    dataset = {
        "apiVersion": "wanloom.dev/v1alpha1",
        "kind": "LatentDataset",
        "metadata": {"name": "corpus", "namespace": namespace},
        "spec": {
            "source": {"manifest": f"{root}/corpus/manifest.jsonl"},
            "output": f"{root}/latents",
            "encoders": {"variant": "tiny", "weights": f"{root}/encoders", "batchSize": 2},
            "buckets": buckets,
            "dtype": "float32",
            "samplesPerShard": 10,
            "workers": 2,
            "maxBadSamples": 10,
            "resources": {"cpu": {"cpu": "750m", "memory": "2Gi"}, "image": node["images"][1], **placement},
        },
    }
    api = k8s.client.CustomObjectsApi()
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "latentdatasets", dataset)
    job = _trainingjob("on-corpus", namespace, node, steps=6, interval=3)
    job["spec"]["data"] = {"dataset": "corpus"}
    job["spec"]["resources"]["cpu"] = {"nodes": 1, "devicesPerNode": 1}
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)

    def dataset_status() -> dict[str, Any]:
        obj = api.get_namespaced_custom_object(GROUP, VERSION, namespace, "latentdatasets", "corpus")
        return obj.get("status") or {}

    # Mid-encode: one of the two encode pods deleted; its unit is retried by the Indexed Job.
    core = k8s.client.CoreV1Api()
    selector = "wanloom.dev/latentdataset=corpus,wanloom.dev/dataset-step=encode"
    running = _wait(lambda: [p for p in core.list_namespaced_pod(namespace, label_selector=selector).items
                             if p.status.phase == "Running"] or None, "a running encode pod")  # fmt: skip
    assert _status(k8s, namespace, "on-corpus").get("phase") == "Pending"  # waits for its data
    victim = running[0].metadata.name
    core.delete_namespaced_pod(victim, namespace, grace_period_seconds=0)
    status = _wait(lambda: (s := dataset_status()).get("phase") in ("Ready", "Failed") and s, "the dataset Ready")
    pods = core.list_namespaced_pod(namespace, label_selector="wanloom.dev/latentdataset=corpus").items
    print(f"injected: encode pod {victim} deleted mid-run; found: {status.get('phase')}, {status.get('message')!r}")
    assert status["phase"] == "Ready", (status, _logs(k8s, namespace, pods))
    assert status["shardsTotal"] == status["shardsDone"] == 4 and status["inputs"] == 40
    assert status["samplesEncoded"] == 35 and sum(status["skipped"].values()) == len(broken), status
    # Each encode pod logs a line per unit it wrote: samples, skips and seconds per stage (decoded on its pool).
    encoded = [p for p in pods if p.metadata.labels.get("wanloom.dev/dataset-step") == "encode"
               and p.status.phase == "Succeeded"]  # fmt: skip
    logs = [core.read_namespaced_pod_log(p.metadata.name, namespace) for p in encoded]
    assert all(re.search(r"unit \d+: \d+ samples, \d+ skipped; read .* write ", log) for log in logs), logs

    # The same manifest prepared in one process here (the JAX encoders, as in the pods): the same tensors.
    config = PrepareConfig(
        inputs=f"{root}/corpus/manifest.jsonl", output=str(tmp_path / "single"), model=encoders, variant="tiny",
        buckets=tuple(parse_bucket(f"{b['frames']}x{b['height']}x{b['width']}") for b in buckets), batch_size=2,
        samples_per_shard=10, dtype="float32", encoders="jax",
    )  # fmt: skip
    single = prepare(config, progress=False)
    assert {s["source"] for s in single.skipped} == broken
    from wanloom_trainer.data.storage import open_storage

    skipped = json.loads(open_storage(f"{root}/latents").read("skipped.json"))
    assert {s["source"] for s in skipped} == broken, skipped
    with (
        open_dataset(f"{root}/latents", max_bad_samples=0) as built,
        open_dataset(str(tmp_path / "single"), max_bad_samples=0) as ref,
    ):
        assert list(built.index.sources) == list(ref.index.sources)
        for i, shape in enumerate(ref.index.latent_shapes.tolist()):
            a, b = built.load([i], tuple(shape)), ref.load([i], tuple(shape))
            np.testing.assert_allclose(a.latents, b.latents, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(a.text_embeds, b.text_embeds, rtol=1e-5, atol=1e-6)

    trained = _wait(
        lambda: (s := _status(k8s, namespace, "on-corpus")).get("phase") in ("Succeeded", "Failed") and s,
        "the TrainingJob on the dataset to finish",
    )
    assert trained["phase"] == "Succeeded", (trained, _logs(k8s, namespace, _pods(k8s, namespace, "on-corpus")))
    ready = next(c for c in trained["conditions"] if c["type"] == "DataReady")
    assert ready["status"] == "True", trained
