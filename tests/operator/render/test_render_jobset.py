"""render_trainingjob: every example and a table of held-out specs give the documented structure
(docs/startup-contract.md) and validate against the JobSet CRD and Kubernetes schemas."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from wanloom_api import keys
from wanloom_api.trainingjob import TrainingJob
from wanloom_api.validation import InvalidTrainingJob, load_trainingjob_file, parse_trainingjob
from wanloom_operator.render.jobset import Rendered, pod_spec, render_trainingjob, trainer_container
from wanloom_operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "jobs").glob("*.yaml"))
CONTRACT_ENV = {
    keys.ENV_CONFIG,
    keys.ENV_JOB_NAME,
    keys.ENV_NAMESPACE,
    keys.ENV_METRICS_PORT,
    keys.ENV_COORDINATOR_ADDRESS,
    keys.ENV_NUM_SLICES,
    keys.ENV_SLICE_INDEX,
    keys.ENV_HOSTS_PER_SLICE,
    keys.ENV_HOST_INDEX,
    keys.ENV_DEVICES_PER_HOST,
}

# Held-out specs: shapes and options no example uses. (id, resources, extra spec fields, expected)
# expected: (replicas, pods per Job, device resource, devices per pod)
HELD_OUT: list[tuple[str, dict[str, Any], dict[str, Any], tuple[int, int, str | None, str | None]]] = [
    ("tpu-single-host-2x2x1", {"tpu": {"topology": "2x2x1"}}, {}, (1, 1, "google.com/tpu", "4")),
    ("tpu-one-chip-1x1x1", {"tpu": {"topology": "1x1x1"}}, {}, (1, 1, "google.com/tpu", "1")),
    ("tpu-2x2x4", {"tpu": {"topology": "2x2x4"}}, {}, (1, 4, "google.com/tpu", "4")),
    (
        "tpu-4-slices-8x8x8-kueue",
        {
            "tpu": {"topology": "8x8x8", "slices": 4},
            "queueName": "tpu-q",
            "priorityClassName": "high",
            "serviceAccountName": "trainer",
            "hostNetwork": False,
        },
        {"maxRestarts": 0, "ttlSecondsAfterFinished": 600, "activeDeadlineSeconds": 86400},
        (4, 128, "google.com/tpu", "4"),
    ),
    ("gpu-b200-16-nodes", {"gpu": {"type": "b200", "nodes": 16}}, {"suspend": True}, (1, 16, "nvidia.com/gpu", "8")),
    (
        "gpu-other",
        {"gpu": {"type": "other", "perNode": 4, "nodes": 3, "acceleratorLabel": "a100"}},
        {"kernels": {"attention": "sdpa"}},
        (1, 3, "nvidia.com/gpu", "4"),
    ),
    ("cpu-torch-2-nodes", {"cpu": {"nodes": 2}, "backend": "torch"}, {}, (1, 2, None, None)),
    ("cpu-jax", {"cpu": {"nodes": 1, "devicesPerNode": 4}}, {}, (1, 1, None, None)),
]


def _env(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in trainer_container(rendered.jobset)["env"]}


def _assert_documented_structure(rendered: Rendered, job: TrainingJob) -> None:
    js, cm = rendered.jobset, rendered.configmap
    assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert (cm["apiVersion"], cm["kind"]) == ("v1", "ConfigMap")
    for obj in (js, cm):
        [owner] = obj["metadata"]["ownerReferences"]
        assert owner["kind"] == "TrainingJob" and owner["name"] == job.metadata.name and owner["controller"] is True
        assert obj["metadata"]["labels"][keys.LABEL_MANAGED_BY] == keys.MANAGED_BY
        assert obj["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH] == rendered.spec_hash
    [rjob] = js["spec"]["replicatedJobs"]
    job_spec = rjob["template"]["spec"]
    assert job_spec["backoffLimit"] == 0 and job_spec["parallelism"] == job_spec["completions"]
    config_error, disruption, stopped = job_spec["podFailurePolicy"]["rules"]
    assert config_error["onExitCodes"]["values"] == [keys.EXIT_CONFIG_ERROR]
    assert disruption["onPodConditions"][0]["type"] == "DisruptionTarget"
    assert stopped["onExitCodes"]["values"] == [keys.EXIT_STOPPED] == [143]
    failure = js["spec"]["failurePolicy"]
    assert failure["maxRestarts"] == job.spec.max_restarts
    # A configuration error fails at once; any other pod-rule failure (a disruption) restarts for free.
    assert [r["action"] for r in failure["rules"]] == ["FailJobSet", "FailJobSet", "RestartJobSetAndIgnoreMaxRestarts"]
    assert [r["onJobFailureReasons"] for r in failure["rules"]] == [["PodFailurePolicy"], ["DeadlineExceeded"],
                                                                    ["PodFailurePolicy"]]  # fmt: skip
    assert js["spec"]["suspend"] is (job.spec.suspend or job.spec.resources.queue_name is not None)
    env = _env(rendered)
    assert set(env) >= CONTRACT_ENV
    assert env[keys.ENV_CONFIG]["value"] == f"{keys.CONFIG_MOUNT_DIR}/{keys.CONFIG_FILE_NAME}"
    assert env[keys.ENV_HOSTS_PER_SLICE]["value"] == str(job_spec["parallelism"])
    spec, container = pod_spec(js), trainer_container(js)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    # The operator's volumes are the ones the contract reserves, mounted where it says.
    ours = {m["name"]: m["mountPath"] for m in container["volumeMounts"] if m["name"] in keys.OPERATOR_VOLUMES}
    assert ours and ours == {name: keys.OPERATOR_VOLUMES[name] for name in ours}
    assert volumes[mounts[keys.CONFIG_MOUNT_DIR]]["configMap"]["name"] == cm["metadata"]["name"]
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    requests = trainer_container(js)["resources"]["requests"]
    if requests.get("memory", "").endswith("G"):  # an accelerator machine: a quarter of the memory request
        assert shm["sizeLimit"] == f"{int(requests['memory'][:-1]) // 4}G"
        assert int(requests["cpu"]) > 0  # never BestEffort
    assert {"name": "metrics", "containerPort": job.spec.metrics_port, "protocol": "TCP"} in container["ports"]
    # The trainer's reason for failing reaches the TrainingJob's status through the termination message.
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # The trainer reads back exactly the validated spec (suspend is the operator's business).
    config = parse_trainingjob(yaml.safe_load(cm["data"][keys.CONFIG_FILE_NAME]))
    assert config.spec == job.spec.model_copy(update={"suspend": False})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_render_valid_objects(
    path: Path, settings: OperatorSettings, check_jobset: Callable[..., None], check_core: Callable[..., None]
) -> None:
    job = load_trainingjob_file(path)
    rendered = render_trainingjob(job, settings, owner_uid="4d1c3b9e-0000-4000-8000-000000000001")
    _assert_documented_structure(rendered, job)
    check_jobset(rendered.jobset)
    check_core(rendered.configmap)


@pytest.mark.parametrize(("case", "resources", "extra", "expected"), HELD_OUT, ids=[c[0] for c in HELD_OUT])
def test_held_out_specs(
    case: str,
    resources: dict[str, Any],
    extra: dict[str, Any],
    expected: tuple[int, int, str | None, str | None],
    make_job: Callable[..., TrainingJob],
    settings: OperatorSettings,
    check_jobset: Callable[..., None],
    check_core: Callable[..., None],
) -> None:
    job = make_job(resources, name=case, **extra)
    rendered = render_trainingjob(job, settings)
    _assert_documented_structure(rendered, job)
    check_jobset(rendered.jobset)
    check_core(rendered.configmap)
    replicas, pods, resource, count = expected
    [rjob] = rendered.jobset["spec"]["replicatedJobs"]
    assert (rjob["replicas"], rjob["template"]["spec"]["parallelism"]) == (replicas, pods)
    limits = trainer_container(rendered.jobset)["resources"].get("limits", {})
    assert (limits.get(resource) if resource else None) == count


def test_tpu_multislice(make_job: Callable[..., TrainingJob], settings: OperatorSettings) -> None:
    job = make_job({"tpu": {"topology": "4x4x4", "slices": 3}}, name="ms", kernels={"attention": "splash"})
    rendered = render_trainingjob(job, settings)
    js, env = rendered.jobset, _env(rendered)
    spec = pod_spec(js)
    assert js["metadata"]["annotations"][keys.JOBSET_EXCLUSIVE_TOPOLOGY] == "cloud.google.com/gke-nodepool"
    assert spec["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu7x",
        "cloud.google.com/gke-tpu-topology": "4x4x4",
    }
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    label = "metadata.labels['{}']"
    for name, key in [
        (keys.ENV_NUM_SLICES, keys.JOBSET_REPLICATEDJOB_REPLICAS),
        ("MEGASCALE_NUM_SLICES", keys.JOBSET_REPLICATEDJOB_REPLICAS),
        (keys.ENV_SLICE_INDEX, keys.JOBSET_JOB_INDEX),
        ("MEGASCALE_SLICE_ID", keys.JOBSET_JOB_INDEX),
    ]:
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == label.format(key)
    assert env[keys.ENV_HOST_INDEX]["valueFrom"]["fieldRef"]["fieldPath"] == (
        f"metadata.annotations['{keys.JOB_COMPLETION_INDEX}']"
    )
    assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"] == "ms-slice-0-0.ms"
    assert env[keys.ENV_COORDINATOR_ADDRESS]["value"] == f"ms-slice-0-0.ms:{keys.JAX_COORDINATOR_PORT}"
    assert env[keys.ENV_DEVICES_PER_HOST]["value"] == "8"  # 4 chips x 2 TensorCores
    assert env["JAX_PLATFORMS"]["value"] == "tpu,cpu"
    assert trainer_container(js)["command"] == ["python", "-m", "wanloom_trainer"]


def test_tpu_single_slice_has_no_megascale(make_job: Callable[..., TrainingJob], settings: OperatorSettings) -> None:
    env = _env(render_trainingjob(make_job({"tpu": {"topology": "2x2x2"}}), settings))
    assert not any(name.startswith("MEGASCALE_") for name in env)


def test_gpu_pods_run_the_launcher(make_job: Callable[..., TrainingJob], settings: OperatorSettings) -> None:
    job = make_job({"gpu": {"type": "h100", "nodes": 4}}, name="g")
    js = render_trainingjob(job, settings).jobset
    container, env = trainer_container(js), {v["name"]: v for v in trainer_container(js)["env"]}
    assert pod_spec(js)["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod_spec(js)["tolerations"]
    assert env["MASTER_ADDR"]["value"] == "g-node-0-0.g" and env["MASTER_PORT"]["value"] == "29500"
    assert (env["NNODES"]["value"], env["NPROC_PER_NODE"]["value"]) == ("4", "8")
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"].endswith(f"['{keys.JOB_COMPLETION_INDEX}']")
    assert env[keys.ENV_NUM_SLICES] == {"name": keys.ENV_NUM_SLICES, "value": "1"}
    assert env["NCCL_DEBUG"]["value"] == "WARN" and "NCCL_NET" not in env
    assert container["command"] == ["python", "-m", "wanloom_trainer.launcher"] and container.get("args", []) == []
    # The launcher lets the workers checkpoint for the pod's grace less a margin, then reports their status.
    grace = pod_spec(js)["terminationGracePeriodSeconds"]
    assert env[keys.ENV_SHUTDOWN_SECONDS]["value"] == str(grace - 15)


def test_gpu_label_key_and_gib_profile_come_from_settings(make_job: Callable[..., TrainingJob]) -> None:
    networks = ["gvnic-1", *(f"rdma-{i}" for i in range(8))]
    settings = OperatorSettings.from_env({
        "WANLOOM_GPU_ACCELERATOR_LABEL_KEY": "nvidia.com/gpu.product",
        "WANLOOM_GPU_NCCL_PROFILE": "gib",
        "WANLOOM_GPU_NETWORK_INTERFACES": ",".join(networks),
    })  # fmt: skip
    js = render_trainingjob(make_job({"gpu": {"type": "h200", "nodes": 2}}), settings).jobset
    container = trainer_container(js)
    env = {v["name"]: v for v in container["env"]}
    assert pod_spec(js)["nodeSelector"] == {"nvidia.com/gpu.product": "nvidia-h200-141gb"}
    assert env["NCCL_NET"]["value"] == "gIB"
    assert {"name": "gib", "mountPath": "/usr/local/gib"} in container["volumeMounts"]
    # The plugin's own NCCL settings are sourced before the launcher (and so every worker) starts.
    assert container["command"] == ["bash", "-c", 'source "$0" && exec python -m wanloom_trainer.launcher']
    assert container["args"] == ["/usr/local/gib/scripts/set_nccl_env.sh"]
    annotations = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["networking.gke.io/default-interface"] == "eth0"
    attached = json.loads(annotations["networking.gke.io/interfaces"])
    assert [a["network"] for a in attached] == ["default", *networks]
    assert [a["interfaceName"] for a in attached] == [f"eth{i}" for i in range(10)]
    assert pod_spec(js)["hostNetwork"] is False


def test_gib_profile_refuses_what_it_cannot_network(make_job: Callable[..., TrainingJob]) -> None:
    settings = OperatorSettings.from_env({"WANLOOM_GPU_NCCL_PROFILE": "gib", "WANLOOM_GPU_NETWORK_INTERFACES": "r0"})
    with pytest.raises(InvalidTrainingJob) as info:
        render_trainingjob(make_job({"gpu": {"type": "h100", "nodes": 2}, "hostNetwork": True}), settings)
    assert [e.path for e in info.value.errors] == ["spec.resources.gpu.type", "spec.resources.hostNetwork"]
    assert "h200 and b200" in info.value.errors[0].message
    with pytest.raises(ValueError, match="WANLOOM_GPU_NETWORK_INTERFACES"):
        OperatorSettings.from_env({"WANLOOM_GPU_NCCL_PROFILE": "gib"})


def test_images_per_backend(make_job: Callable[..., TrainingJob]) -> None:
    settings = OperatorSettings.from_env({"WANLOOM_TRAINER_IMAGE_JAX": "j:1", "WANLOOM_TRAINER_IMAGE_TORCH": "t:1"})
    image = lambda job: trainer_container(render_trainingjob(job, settings).jobset)["image"]
    assert image(make_job({"tpu": {"topology": "2x2x1"}})) == "j:1"
    assert image(make_job({"gpu": {"type": "h100"}})) == "t:1"
    assert image(make_job({"gpu": {"type": "h100"}, "image": "mine:2"})) == "mine:2"


def test_render_is_deterministic_and_hash_ignores_suspend(
    make_job: Callable[..., TrainingJob], settings: OperatorSettings
) -> None:
    a = render_trainingjob(make_job({"gpu": {"type": "h100"}}), settings)
    b = render_trainingjob(make_job({"gpu": {"type": "h100"}}), settings)
    c = render_trainingjob(make_job({"gpu": {"type": "h100"}}, suspend=True), settings)
    d = render_trainingjob(make_job({"gpu": {"type": "h100", "nodes": 2}}), settings)
    assert a.objects == b.objects
    assert a.spec_hash == c.spec_hash and a.configmap["data"] == c.configmap["data"]
    assert a.spec_hash != d.spec_hash


@pytest.mark.parametrize(
    ("case", "mutate"),
    [
        ("unknown pod field", lambda js: pod_spec(js).update(hostNetworking=True)),
        ("unknown jobset field", lambda js: js["spec"].update(maxRestarts=3)),
        ("wrong type", lambda js: js["spec"]["replicatedJobs"][0].update(replicas="two")),
        ("bad env entry", lambda js: trainer_container(js)["env"].append({"value": "x"})),
        ("name too long", lambda js: js["metadata"].update(name="x" * 60)),
        ("bad rule name", lambda js: js["spec"]["failurePolicy"]["rules"][0].update(name="no spaces allowed")),
    ],
)
def test_validators_reject_broken_jobsets(
    case: str,
    mutate: Callable[[dict[str, Any]], None],
    make_job: Callable[..., TrainingJob],
    settings: OperatorSettings,
    check_jobset: Callable[..., None],
) -> None:
    jobset = render_trainingjob(make_job({"gpu": {"type": "h100"}}), settings).jobset
    check_jobset(jobset)
    mutate(jobset)
    with pytest.raises(Exception):  # noqa: B017 - jsonschema, kubernetes-validate or assertion errors
        check_jobset(jobset)


def test_the_gib_command_sources_the_script_then_runs_the_launcher(
    tmp_path: Path, make_job: Callable[..., TrainingJob]
) -> None:
    """The rendered command run by a real shell: the script's exports reach the launcher, started as rendered."""
    import subprocess

    settings = OperatorSettings.from_env({"WANLOOM_GPU_NCCL_PROFILE": "gib", "WANLOOM_GPU_NETWORK_INTERFACES": "r0"})
    container = trainer_container(render_trainingjob(make_job({"gpu": {"type": "b200", "nodes": 2}}), settings).jobset)
    script = tmp_path / "set_nccl_env.sh"
    script.write_text("export NCCL_TUNED='from the plugin'\n")
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\nprintf "%s\\n" "$NCCL_TUNED" "$@"\n')
    python.chmod(0o755)
    out = subprocess.run([*container["command"], str(script)], env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.splitlines() == ["from the plugin", "-m", "wanloom_trainer.launcher"]
