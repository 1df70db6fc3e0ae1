"""TrainingJob -> the objects the operator creates: one ConfigMap (the trainer's config) and one JobSet.

Pure: no API calls, no clock, no randomness; ``wanloom render`` and the operator call the same function, so the
preview is exactly what gets created. The chain below reads top to bottom; each step is one small function.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from wanloom_api import keys
from wanloom_api.trainingjob import API_VERSION, KIND, TrainingJob
from wanloom_api.validation import FieldError, InvalidTrainingJob
from wanloom_operator.render import env, overrides, policy
from wanloom_operator.render.configmap import configmap_data, spec_hash
from wanloom_operator.render.names import Names, job_names
from wanloom_operator.render.pods import (
    CONTAINER_NAME,
    PodShape,
    dns_policy,
    pod_shape,
    trainer_command,
    trainer_image,
)
from wanloom_operator.render.templating import render_yaml
from wanloom_operator.settings import OperatorSettings

COMPONENT = "trainer"
PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"  # `wanloom render` of a file: the API server assigns it


@dataclass(frozen=True)
class Rendered:
    configmap: dict[str, Any]
    jobset: dict[str, Any]
    names: Names
    shape: PodShape
    spec_hash: str

    @property
    def objects(self) -> list[dict[str, Any]]:
        """In creation order: the pods mount the ConfigMap."""
        return [self.configmap, self.jobset]


def render_trainingjob(job: TrainingJob, settings: OperatorSettings, *, owner_uid: str | None = None) -> Rendered:
    """Render a validated TrainingJob.

    Raises:
        InvalidTrainingJob: when the user's overrides clash with what the operator renders (field paths given).
    """
    shape = pod_shape(job.spec, settings)  # 1. accelerator shape: replicas x pods, placement, devices
    names = job_names(job.metadata.name, shape.replicated_job, shape.replicas, shape.pods_per_job)  # 2. names
    digest = spec_hash(job)
    meta = _common_metadata(job, names, digest, owner_uid)  # 3. labels, annotations, owner reference
    configmap = render_yaml("configmap.yaml.j2", names=names, data=configmap_data(job), **meta)  # 4. config
    jobset = _jobset_skeleton(job, shape, names, settings, meta)  # 5. the JobSet from its template
    _fill_pod(jobset, job, shape, names, settings)  # 6. env, volumes and the user's overrides
    return Rendered(configmap=configmap, jobset=jobset, names=names, shape=shape, spec_hash=digest)


def pod_spec(jobset: dict[str, Any]) -> dict[str, Any]:
    """The (single) replicated job's pod spec."""
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def trainer_container(jobset: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod_spec(jobset)["containers"] if c["name"] == CONTAINER_NAME)


def _common_metadata(job: TrainingJob, names: Names, digest: str, owner_uid: str | None) -> dict[str, Any]:
    uid = owner_uid or job.metadata.model_extra.get("uid") or PLACEHOLDER_UID
    owner = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.metadata.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,  # deleting the TrainingJob in the foreground waits for its JobSet
    }
    return {
        "namespace": job.metadata.namespace or "default",
        "labels": object_labels(names),
        "annotations": {keys.ANNOTATION_SPEC_HASH: digest},
        "owner_references": [owner],
    }


def object_labels(names: Names) -> dict[str, str]:
    return {
        keys.LABEL_JOB_NAME: names.job_label,
        keys.LABEL_MANAGED_BY: keys.MANAGED_BY,
        keys.LABEL_COMPONENT: COMPONENT,
        "app.kubernetes.io/name": "wanloom",
    }


def _jobset_skeleton(
    job: TrainingJob, shape: PodShape, names: Names, settings: OperatorSettings, meta: dict[str, Any]
) -> dict[str, Any]:
    res = job.spec.resources
    labels = dict(meta["labels"])
    if res.queue_name:
        labels[keys.KUEUE_QUEUE_NAME] = res.queue_name
    annotations = dict(meta["annotations"])
    if shape.exclusive_topology:
        annotations[keys.JOBSET_EXCLUSIVE_TOPOLOGY] = shape.exclusive_topology
    command, args = trainer_command(shape, env.GIB_NCCL_ENV_SCRIPT if _gib(shape, settings) else None)
    return render_yaml(
        "jobset.yaml.j2",
        names=names,
        namespace=meta["namespace"],
        labels=labels,
        annotations=annotations,
        owner_references=meta["owner_references"],
        pod_labels=meta["labels"],
        suspend=job.spec.suspend or res.queue_name is not None,  # Kueue admits by unsuspending
        spec=job.spec,
        shape=shape,
        settings=settings,
        success_policy=policy.success_policy(),
        failure_policy=policy.failure_policy(job.spec),
        pod_failure_policy=policy.pod_failure_policy(),
        dns_policy=dns_policy(shape, settings),
        container_name=CONTAINER_NAME,
        image=trainer_image(job.spec, settings),
        command=command,
        args=args,
        run_dir=keys.RUN_DIR,
    )


def _fill_pod(
    jobset: dict[str, Any], job: TrainingJob, shape: PodShape, names: Names, settings: OperatorSettings
) -> None:
    res, defaults = job.spec.resources, settings.trainer_pods
    spec, container = pod_spec(jobset), trainer_container(jobset)
    template = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    requests = container["resources"].get("requests")
    if requests is not None:
        container["resources"]["requests"] = requests = overrides.merge_requests(requests, res)
    volumes, mounts = _operator_volumes(names, shape, settings, (requests or {}).get("memory"))
    annotations = {}
    if _gib(shape, settings):
        gib_errors = tuple(_gib_errors(job, shape))
        if gib_errors:
            raise InvalidTrainingJob(gib_errors, job.metadata.name)
        annotations = _network_annotations(settings.gpu_network_interfaces)
    template["metadata"]["labels"] = {**defaults.labels, **res.pod_labels, **template["metadata"]["labels"]}
    annotations = {**defaults.annotations, **res.pod_annotations, **annotations}
    if annotations:
        template["metadata"]["annotations"] = annotations
    secrets = overrides.merge_pull_secrets(defaults.image_pull_secrets, res.image_pull_secrets)
    if secrets:
        spec["imagePullSecrets"] = secrets
    rendered_env = env.contract_env(shape, names, job.metadata.name, job.spec.metrics_port, settings)
    container["env"] = overrides.merge_env(rendered_env, defaults.env, res.env)
    spec["volumes"], container["volumeMounts"] = overrides.merge_volumes(volumes, mounts, res)
    spec["nodeSelector"] = overrides.merge_node_selector(spec["nodeSelector"], res.node_selector)
    spec["tolerations"] = overrides.merge_tolerations(spec["tolerations"], res)


def _gib(shape: PodShape, settings: OperatorSettings) -> bool:
    return shape.accelerator == "gpu" and settings.gpu_nccl_profile == "gib"


def _gib_errors(job: TrainingJob, shape: PodShape) -> list[FieldError]:
    gpu = job.spec.resources.gpu
    errors = []
    if gpu is not None and gpu.type not in env.GIB_GPU_TYPES:
        errors.append(FieldError(
            "spec.resources.gpu.type",
            f"the operator's gib NCCL profile (GPUDirect RDMA) is for {' and '.join(env.GIB_GPU_TYPES)} nodes "
            f"(A3 Ultra, A4); {gpu.type} nodes do not have its RDMA NICs: run them under an operator with the "
            f"default profile",
        ))  # fmt: skip
    if shape.host_network:
        errors.append(FieldError(
            "spec.resources.hostNetwork",
            "GKE attaches the RDMA networks (gib profile) to pod networking only: hostNetwork must be false",
        ))  # fmt: skip
    return errors


def _network_annotations(interfaces: tuple[str, ...]) -> dict[str, str]:
    """GKE multi-networking: eth0 stays the pod network, the node pool's extra networks follow as eth1..ethN."""
    attached = [{"interfaceName": "eth0", "network": "default"}]
    attached += [{"interfaceName": f"eth{i}", "network": name} for i, name in enumerate(interfaces, start=1)]
    return {
        keys.GKE_DEFAULT_INTERFACE: "eth0",
        keys.GKE_INTERFACES: json.dumps(attached, separators=(",", ":")),
    }


_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                   "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}  # fmt: skip


def _shm_limit(memory: str | None) -> dict[str, str]:
    """/dev/shm (data-loader workers, NCCL) counts against the pod's memory: bound it at a quarter of the request."""
    match = re.fullmatch(r"(\d+)(k|M|G|T|Ki|Mi|Gi|Ti)?", memory or "")
    if match is None:
        return {}
    number, unit = int(match[1]), match[2] or ""
    quarter = f"{number // 4}{unit}" if number % 4 == 0 or unit == "G" else str(number * _QUANTITY_UNITS[unit] // 4)
    return {"sizeLimit": quarter}


def _operator_volumes(
    names: Names, shape: PodShape, settings: OperatorSettings, memory: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The config mount, shared memory for data-loader workers and NCCL, and a scratch run directory."""
    sources: dict[str, dict[str, Any]] = {
        "wanloom-config": {"configMap": {"name": names.configmap}},
        "dshm": {"emptyDir": {"medium": "Memory", **_shm_limit(memory)}},
        "wanloom-run": {"emptyDir": {}},
    }
    if _gib(shape, settings):
        sources["gib"] = {"hostPath": {"path": "/home/kubernetes/bin/gib"}}
    volumes = [{"name": name, **source} for name, source in sources.items()]
    mounts = [{"name": name, "mountPath": keys.OPERATOR_VOLUMES[name]} for name in sources]
    mounts[0]["readOnly"] = True  # the config
    return volumes, mounts
