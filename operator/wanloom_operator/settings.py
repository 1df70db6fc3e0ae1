"""OperatorSettings: everything the operator reads from its environment, read once at start-up.

Each field names its environment variable in ``ENV``; :func:`OperatorSettings.from_env` is the only reader, and a
bad value fails with the variable's name and what is valid. The Helm chart sets the trainer images; the rest have
defaults that suit GKE.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from importlib import metadata
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from wanloom_api.trainingjob import EnvVar, check_labels, no_reserved_pod_keys


def _version() -> str:
    try:
        return metadata.version("wanloom")
    except metadata.PackageNotFoundError:
        return "0.1.0"


VERSION = _version()


class TrainerPodDefaults(BaseModel):
    """What every trainer pod gets from the chart (``trainerPods``), under a TrainingJob's own spec.resources."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)

    image_pull_secrets: tuple[str, ...] = ()
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    env: tuple[EnvVar, ...] = Field(
        (), description="Added to every trainer container (proxies, credentials, storage endpoints)."
    )

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        return check_labels(no_reserved_pod_keys(labels))

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, annotations: dict[str, str]) -> dict[str, str]:
        return no_reserved_pod_keys(annotations)

    @field_validator("env")
    @classmethod
    def _env(cls, env: tuple[EnvVar, ...]) -> tuple[EnvVar, ...]:
        contract = sorted(v.name for v in env if v.name.startswith("WANLOOM_"))
        if contract:
            raise ValueError(f"{', '.join(contract)}: WANLOOM_* variables are the operator's start-up contract")
        return env


class OperatorSettings(BaseModel):
    """Operator configuration (rendering defaults, watched namespaces, endpoints, progress scraping)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trainer_image_jax: str = Field(
        f"ghcr.io/wanloom/wanloom-trainer-tpu:{VERSION}", description="Trainer image for the jax backend."
    )
    trainer_image_torch: str = Field(
        f"ghcr.io/wanloom/wanloom-trainer-gpu:{VERSION}", description="Trainer image for the torch backend."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    namespaces: tuple[str, ...] = Field((), description="Namespaces to watch; empty watches all of them.")
    metrics_port: int = Field(8000, ge=0, le=65535, description="Port of the operator's own /metrics (0: off).")
    liveness_port: int = Field(8080, ge=0, le=65535, description="Port of the operator's /healthz (0: off).")
    peering_name: str | None = Field(None, description="kopf peering object; set when more than one replica runs.")
    peering_priority: int | None = Field(None, description="This replica's peering priority; random when unset.")
    api_server: str | None = Field(
        None, description="Talk to this API server URL without credentials (kubectl proxy, tests); else kubeconfig."
    )
    log_format: Literal["json", "plain", "full"] = "json"
    progress_interval_seconds: float = Field(30.0, gt=0, description="How often rank 0's metrics are read.")
    progress_timeout_seconds: float = Field(3.0, gt=0, description="Timeout of one metrics read.")
    rank0_address: str = Field(
        "pod-ip",
        description="How to reach rank 0: pod-ip (from the API), dns (pod FQDN; operator in the cluster), "
        "or static:HOST (port-forwards, tests).",
    )
    gpu_accelerator_label_key: str = Field(
        "cloud.google.com/gke-accelerator", description="Node label that selects the GPU type (GKE's by default)."
    )
    gpu_nccl_profile: Literal["default", "gib"] = Field(
        "default",
        description="gib: GPUDirect RDMA on GKE A3 Ultra (h200) / A4 (b200) nodes: the pods attach "
        "gpu_network_interfaces, mount the host's gIB NCCL plugin and source its NCCL settings.",
    )
    gpu_network_interfaces: tuple[str, ...] = Field(
        (),
        description="GKE Network objects attached as eth1, eth2, ... with the gib profile (the node pool's gVNIC "
        "network, then its eight RDMA networks), in that order.",
    )
    dns_policy: str | None = Field(
        None, description="Pod dnsPolicy; defaults to ClusterFirstWithHostNet on hostNetwork."
    )
    megascale_port: int | None = Field(None, ge=1, le=65535, description="MEGASCALE_PORT for multi-slice TPU jobs.")
    cpu_pod_requests: dict[str, str] = Field(
        default_factory=lambda: {"cpu": "500m", "memory": "1Gi"}, description="Requests of CPU-only trainer pods."
    )
    trainer_pods: TrainerPodDefaults = Field(
        default_factory=TrainerPodDefaults,
        description="Pull secrets, labels, annotations and environment of every trainer pod (JSON).",
    )
    termination_grace_seconds: int = Field(
        300,
        ge=30,
        le=3600,
        description="Trainer pods' terminationGracePeriodSeconds: SIGTERM checkpoints after the current step, "
        "which must commit within it (a spot VM's preemption notice is 30 s whatever this says).",
    )

    @model_validator(mode="after")
    def _check_gib(self) -> OperatorSettings:
        if self.gpu_nccl_profile == "gib" and not self.gpu_network_interfaces:
            raise ValueError(
                "WANLOOM_GPU_NCCL_PROFILE=gib needs WANLOOM_GPU_NETWORK_INTERFACES (the chart's "
                "gpuNetworking.interfaces): the GKE Networks of the node pool's gVNIC and RDMA NICs, e.g. "
                "gvnic-1,rdma-0,...,rdma-7; without them NCCL has no RDMA NIC to use"
            )
        return self

    @field_validator("rank0_address")
    @classmethod
    def _check_rank0(cls, value: str) -> str:
        if value in ("pod-ip", "dns") or (value.startswith("static:") and len(value) > len("static:")):
            return value
        raise ValueError(f"must be pod-ip, dns or static:HOST (got {value!r})")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> OperatorSettings:
        """Read the ``ENV`` variables (unset ones keep their defaults); ``overrides`` win over the environment.

        Raises:
            ValueError: naming the environment variable and what is valid.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field, var in ENV.items():
            raw = environ.get(var)
            if raw is not None and raw != "":
                values[field] = _parse(field, raw)
        values.update(overrides)
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = []
            for err in exc.errors(include_url=False):
                field = str(err["loc"][0]) if err["loc"] else "<settings>"
                where = ENV.get(field, field) if field not in overrides else field
                problems.append(f"{where}: {err['msg']}")
            raise ValueError("invalid operator settings:\n  " + "\n  ".join(problems)) from None


ENV: dict[str, str] = {
    "trainer_image_jax": "WANLOOM_TRAINER_IMAGE_JAX",
    "trainer_image_torch": "WANLOOM_TRAINER_IMAGE_TORCH",
    "image_pull_policy": "WANLOOM_TRAINER_IMAGE_PULL_POLICY",
    "namespaces": "WANLOOM_NAMESPACES",
    "metrics_port": "WANLOOM_OPERATOR_METRICS_PORT",
    "liveness_port": "WANLOOM_OPERATOR_LIVENESS_PORT",
    "peering_name": "WANLOOM_PEERING_NAME",
    "peering_priority": "WANLOOM_PEERING_PRIORITY",
    "api_server": "WANLOOM_KUBE_API_SERVER",
    "log_format": "WANLOOM_LOG_FORMAT",
    "progress_interval_seconds": "WANLOOM_PROGRESS_INTERVAL_SECONDS",
    "progress_timeout_seconds": "WANLOOM_PROGRESS_TIMEOUT_SECONDS",
    "rank0_address": "WANLOOM_RANK0_ADDRESS",
    "gpu_accelerator_label_key": "WANLOOM_GPU_ACCELERATOR_LABEL_KEY",
    "gpu_nccl_profile": "WANLOOM_GPU_NCCL_PROFILE",
    "gpu_network_interfaces": "WANLOOM_GPU_NETWORK_INTERFACES",
    "dns_policy": "WANLOOM_DNS_POLICY",
    "megascale_port": "WANLOOM_MEGASCALE_PORT",
    "cpu_pod_requests": "WANLOOM_CPU_POD_REQUESTS",
    "termination_grace_seconds": "WANLOOM_TERMINATION_GRACE_SECONDS",
    "trainer_pods": "WANLOOM_TRAINER_POD_DEFAULTS",
}


def _parse(field: str, raw: str) -> Any:
    """Environment strings -> field values: comma lists for tuples, key=value lists for dicts."""
    if field in ("namespaces", "gpu_network_interfaces"):
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    if field == "trainer_pods":
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV[field]}: not JSON ({exc})") from None
    if field == "cpu_pod_requests":
        pairs = [item.split("=", 1) for item in raw.split(",") if item.strip()]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"{ENV[field]}: expected key=value[,key=value] (got {raw!r})")
        return {k.strip(): v.strip() for k, v in pairs}
    return raw
