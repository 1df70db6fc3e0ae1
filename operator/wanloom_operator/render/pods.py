"""What one trainer pod looks like on each accelerator: counts, placement, device requests, command.

TPU v7x follows xpk's slice JobSet (one replicated job, replicas = slices, one pod per 4-chip VM, host networking);
GPU nodes run one pod per node with all its GPUs, whose launcher starts a worker per GPU (torchrun's variables);
CPU pods are for smoke tests (kind).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from wanloom_api import keys
from wanloom_api.topology import ACCELERATOR_TYPES, REQUEST_FRACTION, Machine, tpu7x_slice
from wanloom_api.trainingjob import TrainingJobSpec
from wanloom_operator.settings import OperatorSettings

TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
GPU_RESOURCE = "nvidia.com/gpu"
GKE_NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"  # the exclusive-topology domain: one slice per node pool
CONTAINER_NAME = "trainer"


@dataclass(frozen=True)
class PodShape:
    """The accelerator-specific part of the JobSet: replicas x pods, placement and the container's devices."""

    accelerator: Literal["tpu", "gpu", "cpu"]
    backend: Literal["jax", "torch"]
    replicated_job: str  # "slice" on TPU (one Job per slice), "node" otherwise
    replicas: int  # Jobs: TPU slices, else 1
    pods_per_job: int  # Job parallelism = completions: hosts per slice, or nodes
    devices_per_pod: int  # JAX devices (TPU: 2 per chip) or GPUs / CPU processes per pod
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, str], ...] = ()
    resources: dict[str, dict[str, str]] = field(default_factory=dict)
    host_network: bool = False
    exclusive_topology: str | None = None  # the JobSet exclusive-placement domain (TPU: one slice per node pool)
    coordinator_port: int = keys.JAX_COORDINATOR_PORT

    @property
    def pods(self) -> int:
        return self.replicas * self.pods_per_job


def pod_shape(spec: TrainingJobSpec, settings: OperatorSettings) -> PodShape:
    """The shape for the spec's accelerator (``spec`` is validated: exactly one of tpu, gpu or cpu is set)."""
    res = spec.resources
    if res.tpu is not None:
        return _tpu_shape(spec)
    if res.gpu is not None:
        return _gpu_shape(spec, settings)
    return _cpu_shape(spec, settings)


def _tpu_shape(spec: TrainingJobSpec) -> PodShape:
    tpu = spec.resources.tpu
    assert tpu is not None
    slice_ = tpu7x_slice(tpu.topology)
    accelerator = ACCELERATOR_TYPES[tpu.type]
    chips = str(slice_.chips_per_host)
    host_network = True if spec.resources.host_network is None else spec.resources.host_network
    return PodShape(
        accelerator="tpu",
        backend="jax",
        replicated_job="slice",
        replicas=tpu.slices,
        pods_per_job=slice_.hosts,
        devices_per_pod=slice_.devices // slice_.hosts,
        node_selector={TPU_ACCELERATOR_LABEL: accelerator.gke_label, TPU_TOPOLOGY_LABEL: tpu.topology},
        tolerations=({"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},),
        resources={
            "requests": {
                TPU_RESOURCE: chips,
                **_host_share(ACCELERATOR_TYPES[tpu.type].machine, slice_.chips_per_host),
            },
            "limits": {TPU_RESOURCE: chips},
        },
        host_network=host_network,
        exclusive_topology=GKE_NODEPOOL_LABEL,
    )


def _gpu_shape(spec: TrainingJobSpec, settings: OperatorSettings) -> PodShape:
    gpu = spec.resources.gpu
    assert gpu is not None
    known = ACCELERATOR_TYPES.get(gpu.type)
    label = gpu.accelerator_label or (known.gke_label if known else None)
    backend = spec.resources.resolved_backend
    gpus = str(gpu.per_node)
    return PodShape(
        accelerator="gpu",
        backend=backend,
        replicated_job="node",
        replicas=1,
        pods_per_job=gpu.nodes,
        devices_per_pod=gpu.per_node,
        # type 'other' without a label: no accelerator selector; spec.resources.nodeSelector places the pods.
        node_selector={settings.gpu_accelerator_label_key: label} if label else {},
        tolerations=({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},),
        resources={
            "requests": {
                GPU_RESOURCE: gpus,
                **(_host_share(known.machine, gpu.per_node) if known else {}),
            },
            "limits": {GPU_RESOURCE: gpus},
        },
        host_network=bool(spec.resources.host_network),
        coordinator_port=keys.TORCH_MASTER_PORT if backend == "torch" else keys.JAX_COORDINATOR_PORT,
    )


def _cpu_shape(spec: TrainingJobSpec, settings: OperatorSettings) -> PodShape:
    cpu = spec.resources.cpu
    assert cpu is not None
    backend = spec.resources.resolved_backend
    return PodShape(
        accelerator="cpu",
        backend=backend,
        replicated_job="node",
        replicas=1,
        pods_per_job=cpu.nodes,
        devices_per_pod=cpu.devices_per_node,
        resources={"requests": dict(settings.cpu_pod_requests)},
        host_network=bool(spec.resources.host_network),
        coordinator_port=keys.TORCH_MASTER_PORT if backend == "torch" else keys.JAX_COORDINATOR_PORT,
    )


def _host_share(machine: Machine, accelerators: int) -> dict[str, str]:
    """CPU and memory requests for a pod using ``accelerators`` of ``machine``'s: its share, less what GKE keeps
    (``REQUEST_FRACTION``), so the pod is Burstable, not BestEffort, and Kueue can account for it. GPU type
    'other' has no known machine and requests only GPUs."""
    share = REQUEST_FRACTION * accelerators / machine.accelerators
    return {"cpu": str(int(machine.vcpus * share)), "memory": f"{int(machine.memory_gb * share)}G"}


def trainer_image(spec: TrainingJobSpec, settings: OperatorSettings) -> str:
    if spec.resources.image:
        return spec.resources.image
    return settings.trainer_image_torch if spec.resources.resolved_backend == "torch" else settings.trainer_image_jax


def trainer_command(shape: PodShape, nccl_env_script: str | None = None) -> tuple[list[str], list[str]]:
    """(command, args): the trainer module for jax, the torch launcher for torch (one worker per device; it keeps
    preemption: SIGTERM is forwarded and waited for within the grace, and the pod exits with the workers' status).

    ``nccl_env_script``: a shell script whose exported settings the workers must start with (GKE's gIB plugin ships
    its tuned NCCL settings that way, on the host); the shell gets the script as $0 and execs the launcher.
    """
    if shape.backend == "jax":
        return ["python", "-m", "wanloom_trainer"], []
    launcher = ["python", "-m", "wanloom_trainer.launcher"]
    if nccl_env_script:
        return ["bash", "-c", f'source "$0" && exec {" ".join(launcher)}'], [nccl_env_script]
    return launcher, []


def dns_policy(shape: PodShape, settings: OperatorSettings) -> str:
    """Host-network pods still need cluster DNS to resolve their peers' JobSet hostnames."""
    if settings.dns_policy:
        return settings.dns_policy
    return "ClusterFirstWithHostNet" if shape.host_network else "ClusterFirst"
