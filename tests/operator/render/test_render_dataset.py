"""LatentDataset -> ConfigMap + plan / encode / finalize Jobs: the shapes Kubernetes' Job controller acts on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from wanloom_api import keys
from wanloom_api.validation import load_latentdataset_file, validate_latentdataset
from wanloom_operator.render.dataset import CONTAINER_NAME, GPU_RESOURCE, render_dataset
from wanloom_operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "jobs" / "datasets" / "tiny-corpus.yaml"


def _dataset(**spec: Any) -> Any:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["namespace"] = "media"
    doc["spec"] |= spec
    result = validate_latentdataset(doc)
    assert result.job is not None, result.errors
    return result.job


def test_the_encode_job_is_indexed_one_completion_per_unit_with_per_index_retries() -> None:
    made = render_dataset(_dataset(workers=4, backoffLimitPerIndex=2), OperatorSettings(), owner_uid="u-1")
    job = made.job("encode", units=10)
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 10, 4)
    assert spec["backoffLimitPerIndex"] == 2 and spec["maxFailedIndexes"] == 0
    assert made.job("encode", units=3)["spec"]["parallelism"] == 3  # never more pods than units
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [keys.EXIT_CONFIG_ERROR]
    assert rules[1] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # what a pod failure policy requires
    [container] = pod["containers"]
    assert container["name"] == CONTAINER_NAME
    assert container["command"][-2:] == ["--step", "encode"] and container["command"][:3] == [
        "wanloom",
        "data",
        "build",
    ]
    assert container["resources"]["limits"] == {"cpu": "2", "memory": "4Gi"}
    assert {"name": "JAX_PLATFORMS", "value": "cpu"} in container["env"]  # the TPU image looks for a TPU first
    # Scraped by the chart's PodMonitor (operator label, a port named metrics); decoding on 2 CPUs less the main one.
    assert job["spec"]["template"]["metadata"]["labels"][keys.LABEL_MANAGED_BY] == keys.MANAGED_BY
    assert container["ports"] == [{"name": "metrics", "containerPort": keys.DEFAULT_METRICS_PORT}]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env[keys.ENV_METRICS_PORT] == str(keys.DEFAULT_METRICS_PORT)
    assert env[keys.ENV_DECODE_WORKERS] == "1" and env["OMP_NUM_THREADS"] == "2"
    assert job["metadata"]["ownerReferences"][0] | {"uid": "u-1"} == job["metadata"]["ownerReferences"][0]
    assert job["metadata"]["namespace"] == "media" and not spec["suspend"]
    mounted = yaml.safe_load(made.configmap["data"]["latentdataset.yaml"])
    assert mounted["spec"]["samplesPerShard"] == 16 and "suspend" not in mounted["spec"]


def test_plan_and_finalize_are_one_small_pod_each() -> None:
    made = render_dataset(_dataset(), OperatorSettings())
    for step in ("plan", "finalize"):
        spec = made.job(step)["spec"]
        assert (spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (1, 1, 3)
        assert "completionMode" not in spec
        assert spec["template"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}}
        assert "ports" not in spec["template"]["spec"]["containers"][0]  # nothing to scrape: no encoding


def test_gpu_encoders_get_the_gpus_the_node_selector_and_a_host_share() -> None:
    resources = {"gpu": {"type": "h100", "perPod": 2}, "queueName": "prep", "serviceAccountName": "reader"}
    made = render_dataset(_dataset(resources=resources), OperatorSettings())
    job = made.job("encode", units=8)
    pod = job["spec"]["template"]["spec"]
    limits = pod["containers"][0]["resources"]
    assert limits["limits"] == {GPU_RESOURCE: "2"}
    assert limits["requests"] == {GPU_RESOURCE: "2", "cpu": "16", "memory": "128Gi"}
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env[keys.ENV_DECODE_WORKERS] == "15"
    quarter = _dataset(resources={"cpu": {"cpu": "1500m"}})
    cpu_env = render_dataset(quarter, OperatorSettings()).job("encode", units=1)["spec"]["template"]["spec"]
    assert {"name": keys.ENV_DECODE_WORKERS, "value": "1"} in cpu_env["containers"][0]["env"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["serviceAccountName"] == "reader"
    assert job["metadata"]["labels"][keys.KUEUE_QUEUE_NAME] == "prep"
    assert job["spec"]["suspend"]  # created suspended: Kueue admits it


def test_tpu_encoders_get_one_host_of_a_single_host_slice_and_the_jax_image() -> None:
    resources = {"tpu": {"topology": "2x2x1"}}
    made = render_dataset(_dataset(resources=resources), OperatorSettings(trainer_image_jax="tpu-image:1"))
    pod = made.job("encode", units=4)["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "tpu-image:1"
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": "4"}
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu7x",
        "cloud.google.com/gke-tpu-topology": "2x2x1",
    }
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["spec"]["resources"] = {"tpu": {"topology": "2x2x2"}}  # two hosts: not one pod's
    refused = validate_latentdataset(doc)
    assert [e.path for e in refused.errors] == ["spec.resources.tpu.topology"]


def test_long_names_fit_and_the_spec_hash_follows_the_spec() -> None:
    long = _dataset()
    long = long.model_copy(update={"metadata": long.metadata.model_copy(update={"name": "x" * 200})})
    made = render_dataset(long, OperatorSettings())
    for step in ("plan", "encode", "finalize"):
        name = made.job_name(step)
        assert len(f"{name}-999999-abcde") <= 63, name  # an Indexed Job's pod: <job>-<index>-<random>
    base = render_dataset(_dataset(), OperatorSettings())
    assert render_dataset(_dataset(suspend=True), OperatorSettings()).spec_hash == base.spec_hash
    assert render_dataset(_dataset(fps=24.0), OperatorSettings()).spec_hash != base.spec_hash


def test_wanloom_render_shows_a_datasets_objects() -> None:
    code = "from wanloom_cli import main; main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "render", str(SAMPLE), "--units", "5"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    objects = list(yaml.safe_load_all(proc.stdout))
    assert [o["kind"] for o in objects] == ["ConfigMap", "Job", "Job", "Job"]
    assert objects[2]["spec"]["completions"] == 5
    assert load_latentdataset_file(SAMPLE).metadata.name == "tiny-corpus"
