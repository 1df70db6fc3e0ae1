"""The trainer's start-up environment (docs/startup-contract.md): names from ``api.keys``, one pod template for all
ranks.

Per-pod values come from the downward API: the slice index and slice count from JobSet's pod labels, the host
index from the Job completion index. The trainer combines them with :func:`keys.global_process_id`, which stays
unique across slices (unlike the per-Job completion index alone).
"""

from __future__ import annotations

from typing import Any

from wanloom_api import keys
from wanloom_operator.render.names import Names
from wanloom_operator.render.pods import PodShape
from wanloom_operator.settings import OperatorSettings

EnvVar = dict[str, Any]
GIB_NCCL_ENV_SCRIPT = f"{keys.GIB_DIR}/scripts/set_nccl_env.sh"  # shipped with the plugin: NCCL_NET=gIB and its tuning
GIB_GPU_TYPES = ("h200", "b200")  # A3 Ultra and A4: RDMA NICs; A3 High (h100) is GPUDirect-TCPX, not set up here
SHUTDOWN_MARGIN_S = 15  # inside terminationGracePeriodSeconds: the launcher's last kill and exit


def contract_env(
    shape: PodShape, names: Names, job_name: str, metrics_port: int, settings: OperatorSettings
) -> list[EnvVar]:
    """Every variable the operator sets, in an order where ``$(VAR)`` references only point backwards."""
    env = _wanloom_env(shape, names, job_name, metrics_port)
    if shape.accelerator == "tpu":
        env += _tpu_env(shape, names, settings)
    elif shape.backend == "torch":
        env += _torch_env(shape, names, settings)
    else:
        env += _jax_process_env(shape, names)
    if shape.accelerator == "gpu":
        env += _nccl_env(settings)
    if shape.accelerator == "cpu" and shape.backend == "jax":
        env += [
            _value("JAX_PLATFORMS", "cpu"),
            _value("XLA_FLAGS", f"--xla_force_host_platform_device_count={shape.devices_per_pod}"),
        ]
    return env


def _wanloom_env(shape: PodShape, names: Names, job_name: str, metrics_port: int) -> list[EnvVar]:
    coordinator = f"{names.pod_fqdn()}:{shape.coordinator_port}"
    if shape.accelerator == "tpu":
        num_slices = _label(keys.JOBSET_REPLICATEDJOB_REPLICAS, keys.ENV_NUM_SLICES)
    else:
        num_slices = _value(keys.ENV_NUM_SLICES, "1")
    return [
        _value(keys.ENV_CONFIG, f"{keys.CONFIG_MOUNT_DIR}/{keys.CONFIG_FILE_NAME}"),
        _value(keys.ENV_JOB_NAME, job_name),
        _field(keys.ENV_NAMESPACE, "metadata.namespace"),
        _value(keys.ENV_METRICS_PORT, str(metrics_port)),
        _value(keys.ENV_RUN_DIR, keys.RUN_DIR),
        _value(keys.ENV_COORDINATOR_ADDRESS, coordinator),
        num_slices,
        _label(keys.JOBSET_JOB_INDEX, keys.ENV_SLICE_INDEX),
        _value(keys.ENV_HOSTS_PER_SLICE, str(shape.pods_per_job)),
        _annotation(keys.JOB_COMPLETION_INDEX, keys.ENV_HOST_INDEX),
        _value(keys.ENV_DEVICES_PER_HOST, str(shape.devices_per_pod)),
    ]


def _tpu_env(shape: PodShape, names: Names, settings: OperatorSettings) -> list[EnvVar]:
    env = [_value("JAX_PLATFORMS", "tpu,cpu")]
    if shape.replicas > 1:
        # Multi-slice over DCN. Explicit values from the same labels GKE would use, so either source agrees.
        env += [
            _value("MEGASCALE_COORDINATOR_ADDRESS", names.pod_fqdn()),
            _label(keys.JOBSET_REPLICATEDJOB_REPLICAS, "MEGASCALE_NUM_SLICES"),
            _label(keys.JOBSET_JOB_INDEX, "MEGASCALE_SLICE_ID"),
        ]
        if settings.megascale_port is not None:
            env.append(_value("MEGASCALE_PORT", str(settings.megascale_port)))
    return env


def shutdown_seconds(termination_grace_seconds: int) -> int:
    """How long the torch launcher waits for checkpointing workers after SIGTERM: the pod's grace less a margin in
    which it kills what is left and exits with the workers' status before the kubelet's SIGKILL."""
    return max(1, termination_grace_seconds - SHUTDOWN_MARGIN_S)


def _torch_env(shape: PodShape, names: Names, settings: OperatorSettings) -> list[EnvVar]:
    """The launcher's static rendezvous (torchrun's names): the master is pod 0; the node rank is the completion
    index; and how long it lets the workers checkpoint after SIGTERM."""
    return [
        _value(keys.ENV_SHUTDOWN_SECONDS, str(shutdown_seconds(settings.termination_grace_seconds))),
        _value("MASTER_ADDR", names.pod_fqdn()),
        _value("MASTER_PORT", str(keys.TORCH_MASTER_PORT)),
        _value("NNODES", str(shape.pods_per_job)),
        _value("NPROC_PER_NODE", str(shape.devices_per_pod)),
        _annotation(keys.JOB_COMPLETION_INDEX, "NODE_RANK"),
    ]


def _jax_process_env(shape: PodShape, names: Names) -> list[EnvVar]:
    """jax.distributed on GPU/CPU: one replicated job, so the completion index is already global."""
    return [
        _value("JAX_COORDINATOR_ADDRESS", f"{names.pod_fqdn()}:{keys.JAX_COORDINATOR_PORT}"),
        _value("JAX_NUM_PROCESSES", str(shape.pods)),
        _annotation(keys.JOB_COMPLETION_INDEX, "JAX_PROCESS_ID"),
    ]


def _nccl_env(settings: OperatorSettings) -> list[EnvVar]:
    env = [_value("NCCL_DEBUG", "WARN"), _value("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")]
    if settings.gpu_nccl_profile == "gib":
        env += [
            _value("NCCL_NET", "gIB"),
            _value("LD_LIBRARY_PATH", f"{keys.GIB_DIR}/lib64:/usr/local/nvidia/lib64"),
        ]
    return env


def _value(name: str, value: str) -> EnvVar:
    return {"name": name, "value": value}


def _field(name: str, path: str) -> EnvVar:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _label(key: str, name: str) -> EnvVar:
    return _field(name, f"metadata.labels['{key}']")


def _annotation(key: str, name: str) -> EnvVar:
    return _field(name, f"metadata.annotations['{key}']")
