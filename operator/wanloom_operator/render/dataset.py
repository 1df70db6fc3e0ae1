"""LatentDataset -> a ConfigMap (the dataset file) and its three batch Jobs: plan, encode (Indexed), finalize.

Why three plain Jobs and not one JobSet with ``dependsOn``: the encode Job's completions are the number of work
units, which only a pod that reads the manifest knows, so the operator creates each Job when the one before it has
succeeded and it has read that pod's summary (its termination message). Plain batch Jobs also give what this
workload needs from Kubernetes directly: ``backoffLimitPerIndex`` (a unit is retried on its own) and a pod failure
policy under which evictions and preemptions cost nothing. Kueue admits each Job through its queue-name label.

Pure, like the TrainingJob render: ``wanloom render`` of a dataset file shows what the operator creates.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from wanloom_api import keys
from wanloom_api.latentdataset import API_VERSION, KIND, DatasetResources, LatentDataset
from wanloom_api.topology import ACCELERATOR_TYPES, tpu7x_slice
from wanloom_operator.render.jobset import PLACEHOLDER_UID
from wanloom_operator.render.names import MAX_LABEL, POD_SUFFIX, fit_dns1035, fit_label_value
from wanloom_operator.render.pods import TPU_ACCELERATOR_LABEL, TPU_RESOURCE, TPU_TOPOLOGY_LABEL
from wanloom_operator.settings import OperatorSettings

Step = Literal["plan", "encode", "finalize"]
STEPS: tuple[Step, ...] = ("plan", "encode", "finalize")
CONTAINER_NAME = "wanloom-data"
LABEL_DATASET = "wanloom.dev/latentdataset"
LABEL_STEP = "wanloom.dev/dataset-step"
DATASET_FILE = "latentdataset.yaml"
GPU_RESOURCE = "nvidia.com/gpu"
WEIGHTS_CACHE = f"{keys.RUN_DIR}/weights"
# Plan and finalize are one short pod each: a few retries cover a node going away; their real failures (a bad
# manifest, too many bad inputs) exit EXIT_CONFIG_ERROR and fail at once.
SINGLE_POD_BACKOFF = 3
_SUFFIXES = {
    "": 1.0,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
}
_INDEX_DIGITS = 6  # room for the completion index in pod hostnames (<job>-<index>)
_LONGEST_STEP = max(len(f"-{s}") for s in STEPS)


@dataclass(frozen=True)
class RenderedDataset:
    configmap: dict[str, Any]
    spec_hash: str
    base_name: str
    dataset: LatentDataset
    settings: OperatorSettings
    owner_uid: str

    def job_name(self, step: Step) -> str:
        return f"{self.base_name}-{step}"

    def job(self, step: Step, units: int = 1) -> dict[str, Any]:
        """The Job of ``step``; ``units`` (encode) is its completions."""
        spec = self.dataset.spec
        job_spec: dict[str, Any] = {
            "template": {"metadata": {"labels": self._labels(step)}, "spec": self._pod_spec(step)},
            "podFailurePolicy": _pod_failure_policy(),
            "suspend": spec.suspend or bool(spec.resources.queue_name),
        }
        if step == "encode":
            job_spec |= {
                "completionMode": "Indexed",
                "completions": units,
                "parallelism": min(spec.workers, units),
                "backoffLimitPerIndex": spec.backoff_limit_per_index,
                "maxFailedIndexes": 0,  # a unit that cannot be written leaves the dataset incomplete
            }
        else:
            job_spec |= {"completions": 1, "parallelism": 1, "backoffLimit": SINGLE_POD_BACKOFF}
        labels = self._labels(step)
        if spec.resources.queue_name:
            labels[keys.KUEUE_QUEUE_NAME] = spec.resources.queue_name
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": self.job_name(step),
                "namespace": self._namespace,
                "labels": labels,
                "annotations": {keys.ANNOTATION_SPEC_HASH: self.spec_hash},
                "ownerReferences": [self._owner],
            },
            "spec": job_spec,
        }

    @property
    def _namespace(self) -> str:
        return self.dataset.metadata.namespace or "default"

    @property
    def _owner(self) -> dict[str, Any]:
        return _owner_reference(self.dataset, self.owner_uid)

    def _labels(self, step: Step) -> dict[str, str]:
        return {
            keys.LABEL_MANAGED_BY: keys.MANAGED_BY,
            keys.LABEL_COMPONENT: f"dataset-{step}",
            LABEL_DATASET: fit_label_value(self.dataset.metadata.name),
            LABEL_STEP: step,
        }

    def _pod_spec(self, step: Step) -> dict[str, Any]:
        spec, settings = self.dataset.spec, self.settings
        resources = spec.resources
        node_selector, tolerations, container_resources = _placement(self.dataset, settings, step)
        env = [{"name": "WANLOOM_WEIGHTS_CACHE", "value": WEIGHTS_CACHE}]
        if resources.cpu is not None:  # the TPU image looks for a TPU first
            env.append({"name": "JAX_PLATFORMS", "value": "cpu"})
        ports: list[dict[str, Any]] = []
        if step == "encode":  # the chart's PodMonitor scrapes it like a trainer pod
            env.append({"name": keys.ENV_METRICS_PORT, "value": str(keys.DEFAULT_METRICS_PORT)})
            ports.append({"name": "metrics", "containerPort": keys.DEFAULT_METRICS_PORT})
            cpus = _cpu_request(resources)
            if cpus is not None:  # read and decode on the CPUs the main process does not need
                env.append({"name": keys.ENV_DECODE_WORKERS, "value": str(max(1, math.ceil(cpus) - 1))})
                # PyTorch would start a thread per node core; a pod's CPU limit makes those fight over its share.
                env.append({"name": "OMP_NUM_THREADS", "value": str(max(1, math.ceil(cpus)))})
        env += [{"name": v.name, "value": v.value} for v in (*settings.trainer_pods.env, *resources.env)]
        pod: dict[str, Any] = {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": CONTAINER_NAME,
                    "image": resources.image
                    or (settings.trainer_image_jax if resources.tpu else settings.trainer_image_torch),
                    "imagePullPolicy": settings.image_pull_policy,
                    "command": ["wanloom", "data", "build", f"{keys.CONFIG_MOUNT_DIR}/{DATASET_FILE}", "--step", step],
                    "env": env,
                    **({"ports": ports} if ports else {}),
                    "resources": container_resources,
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "volumeMounts": [
                        {"name": "wanloom-config", "mountPath": keys.CONFIG_MOUNT_DIR, "readOnly": True},
                        {"name": "wanloom-run", "mountPath": keys.RUN_DIR},
                    ],
                }
            ],
            "volumes": [
                {"name": "wanloom-config", "configMap": {"name": self.configmap["metadata"]["name"]}},
                {"name": "wanloom-run", "emptyDir": {}},
            ],
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},
        }
        if node_selector:
            pod["nodeSelector"] = node_selector
        if tolerations:
            pod["tolerations"] = tolerations
        if resources.service_account_name:
            pod["serviceAccountName"] = resources.service_account_name
        if resources.priority_class_name:
            pod["priorityClassName"] = resources.priority_class_name
        if settings.trainer_pods.image_pull_secrets:
            pod["imagePullSecrets"] = [{"name": s} for s in settings.trainer_pods.image_pull_secrets]
        return pod


def render_dataset(
    dataset: LatentDataset, settings: OperatorSettings, *, owner_uid: str | None = None
) -> RenderedDataset:
    """Render a validated LatentDataset (the Jobs come from :meth:`RenderedDataset.job`)."""
    base = fit_dns1035(dataset.metadata.name, MAX_LABEL - _LONGEST_STEP - _INDEX_DIGITS - 1 - POD_SUFFIX)
    document = _dataset_document(dataset)
    digest = hashlib.sha256(json.dumps(document["spec"], sort_keys=True).encode()).hexdigest()[:16]
    uid = owner_uid or (dataset.metadata.model_extra or {}).get("uid") or PLACEHOLDER_UID
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{base}-dataset",
            "namespace": dataset.metadata.namespace or "default",
            "labels": {keys.LABEL_MANAGED_BY: keys.MANAGED_BY, LABEL_DATASET: fit_label_value(dataset.metadata.name)},
            "annotations": {keys.ANNOTATION_SPEC_HASH: digest},
            "ownerReferences": [_owner_reference(dataset, uid)],
        },
        "data": {DATASET_FILE: yaml.safe_dump(document, sort_keys=False, width=120)},
    }
    return RenderedDataset(configmap, digest, base, dataset, settings, uid)


def _owner_reference(dataset: LatentDataset, uid: str) -> dict[str, Any]:
    """Controller reference: garbage collection removes the ConfigMap and Jobs with the dataset."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": dataset.metadata.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _dataset_document(dataset: LatentDataset) -> dict[str, Any]:
    """The dataset as its pods read it: defaults filled in, ``suspend`` left out (it changes no pod's work)."""
    spec = dataset.spec.model_dump(by_alias=True, mode="json", exclude_none=True, exclude={"suspend"})
    metadata = {"name": dataset.metadata.name}
    if dataset.metadata.namespace:
        metadata["namespace"] = dataset.metadata.namespace
    return {"apiVersion": dataset.api_version, "kind": dataset.kind, "metadata": metadata, "spec": spec}


def _placement(
    dataset: LatentDataset, settings: OperatorSettings, step: Step
) -> tuple[dict[str, str], list[dict[str, Any]], dict[str, Any]]:
    """Node selector, tolerations and container resources: encode pods get the accelerator, plan and finalize a
    small CPU pod (they only read manifests and write JSON)."""
    resources = dataset.spec.resources
    selector = dict(resources.node_selector)
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in resources.tolerations]
    if step != "encode":
        return selector, tolerations, {"requests": {"cpu": "500m", "memory": "1Gi"}}
    if resources.tpu is not None:
        chips = str(tpu7x_slice(resources.tpu.topology).chips)
        selector |= {TPU_ACCELERATOR_LABEL: ACCELERATOR_TYPES[resources.tpu.type].gke_label,
                     TPU_TOPOLOGY_LABEL: resources.tpu.topology}  # fmt: skip
        tolerations.append({"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
        return selector, tolerations, {"requests": {TPU_RESOURCE: chips}, "limits": {TPU_RESOURCE: chips}}
    if resources.gpu is None:
        cpu = resources.cpu
        assert cpu is not None
        quantity = {"cpu": cpu.cpu, "memory": cpu.memory}
        return selector, tolerations, {"requests": quantity, "limits": quantity}
    gpu = resources.gpu
    known = ACCELERATOR_TYPES.get(gpu.type)
    label = gpu.accelerator_label or (known.gke_label if known else None)
    if label:
        selector[settings.gpu_accelerator_label_key] = label
    tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    requests = {
        GPU_RESOURCE: str(gpu.per_pod),
        "cpu": gpu.cpu or str(8 * gpu.per_pod),
        "memory": gpu.memory or f"{64 * gpu.per_pod}Gi",
    }
    return selector, tolerations, {"requests": requests, "limits": {GPU_RESOURCE: str(gpu.per_pod)}}


def _cpu_request(resources: DatasetResources) -> float | None:
    """CPUs an encode pod requests (None for TPU pods: the pod sizes its pool from the CPUs it sees)."""
    if resources.cpu is not None:
        return _cpus(resources.cpu.cpu)
    if resources.gpu is not None:
        return _cpus(resources.gpu.cpu) if resources.gpu.cpu else 8.0 * resources.gpu.per_pod
    return None


def _cpus(quantity: str) -> float:
    """A CPU quantity ("2", "1.5", "500m"; any suffix of ``QUANTITY_PATTERN``) in CPUs."""
    number = quantity.rstrip("kMGTi")
    if number.endswith("m"):
        return float(number[:-1]) / 1000
    return float(number) * _SUFFIXES[quantity[len(number) :]]


def _pod_failure_policy() -> dict[str, Any]:
    """A configuration error (exit 3: the manifest, the weights, too many bad inputs) fails the Job at once; a
    disrupted pod (evicted, preempted, node drained) is retried without counting against the backoff limits."""
    return {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": CONTAINER_NAME, "operator": "In", "values": [keys.EXIT_CONFIG_ERROR]},
            },
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }
