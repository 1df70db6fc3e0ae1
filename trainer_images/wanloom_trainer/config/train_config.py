"""The trainer's typed configuration: frozen dataclasses built from a TrainingJob and the pod environment.

``from_trainingjob(job, env)`` is the only place the TrainingJob spec and the ``WANLOOM_*`` environment are read;
both backends (JAX and PyTorch) and every phase of ``train.run`` receive the typed pieces below instead. Pure
Python: no jax, no torch, no I/O besides ``load_train_config`` reading the mounted TrainingJob file.

Environment (names in ``wanloom_api.keys``; docs/startup-contract.md):

    WANLOOM_CONFIG               path of the TrainingJob YAML (``load_train_config`` only)
    WANLOOM_COORDINATOR_ADDRESS  host:port of process 0; unset = one process
    WANLOOM_NUM_SLICES           slices (TPU multi-slice replicas); default 1
    WANLOOM_SLICE_INDEX          this pod's slice; default 0
    WANLOOM_HOSTS_PER_SLICE      pods per slice; default 1
    WANLOOM_HOST_INDEX           this pod's index within its slice; default 0
    WANLOOM_DEVICES_PER_HOST     accelerator devices per pod (informational; checked against jax)
    WANLOOM_METRICS_PORT         Prometheus port (overrides spec.metricsPort; 0 disables the exporter)
    WANLOOM_RUN_DIR              local scratch for plots and the loss log; default runs/<job name>
    WANLOOM_JOB_NAME, WANLOOM_NAMESPACE   labels for metrics
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from wanloom_api import keys
from wanloom_api.trainingjob import TrainingJob, TrainingJobSpec
from wanloom_api.validation import device_count, load_trainingjob_file, resolve_parallelism
from wanloom_trainer.config.variants import WanVariant, get_variant

MESH_AXES = ("data", "fsdp", "context", "tensor")


@dataclass(frozen=True)
class ModelConfig:
    """Which transformer to build and how it computes (``attention`` is resolved: never ``auto``)."""

    variant: str
    weights: str | None
    param_dtype: Literal["float32", "bfloat16"]
    compute_dtype: Literal["float32", "bfloat16"]
    adaln: Literal["fused", "reference"]
    attention: Literal["xla", "splash", "sdpa", "flash"]
    remat: Literal["none", "full", "save-matmuls", "save-attention"]
    num_layers: int | None = None  # fewer blocks than the variant has (wanloom compile --layers); None: all

    @property
    def wan(self) -> WanVariant:
        variant = get_variant(self.variant)
        return variant if self.num_layers is None else dataclasses.replace(variant, num_layers=self.num_layers)

    @property
    def num_experts(self) -> int:
        return 2 if self.wan.two_experts else 1


@dataclass(frozen=True)
class RoutingConfig:
    """Timestep distribution and expert routing; ``boundary_ratio`` is the effective one (None: one model)."""

    boundary_ratio: float | None
    mode: Literal["per-sample", "per-batch"]
    sampling: Literal["uniform", "logit-normal"]
    logit_mean: float
    logit_std: float
    shift: float
    loss_weighting: Literal["none", "bell"]

    def router(self):  # -> routing.Router (imported lazily: scipy is only needed once a run starts)
        from wanloom_trainer.routing import Router, TimestepSampler

        sampler = TimestepSampler(self.sampling, self.shift, self.logit_mean, self.logit_std)
        return Router(sampler, self.boundary_ratio, self.mode)

    def expected_shares(self) -> tuple[float, ...]:
        """Fraction of samples each expert id receives under this distribution: (high, low), or (1,) for one model."""
        high = self.router().high_noise_share
        return (high,) if self.boundary_ratio is None else (high, 1.0 - high)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW per expert; the schedule follows the global step (see ``train.optimizer_jax``)."""

    learning_rate: float
    schedule: Literal["constant", "cosine", "linear"]
    warmup_steps: int
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    clip_grad_norm: float | None
    per_expert_lr_scaling: bool


@dataclass(frozen=True)
class ParallelConfig:
    """Resolved mesh degrees (their product is the job's device count) and the remat policy."""

    data: int
    fsdp: int
    context: int
    tensor: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.data, self.fsdp, self.context, self.tensor)

    @property
    def num_devices(self) -> int:
        return self.data * self.fsdp * self.context * self.tensor

    @property
    def batch_ranks(self) -> int:
        """Data-parallel ranks (data × fsdp): each holds its own samples; context/tensor peers share them."""
        return self.data * self.fsdp


@dataclass(frozen=True)
class SyntheticConfig:
    samples: int
    seed: int


@dataclass(frozen=True)
class DataConfig:
    """Where the latents are (``uri``/``index``), whether to synthesise them first, and loader limits."""

    uri: str
    index: str | None
    synthetic: SyntheticConfig | None
    prefetch: int
    max_bad_samples: int
    storage_outage_seconds: float = 600.0


@dataclass(frozen=True)
class AdaptiveLoadConfig:
    enabled: bool
    scheduler: Literal["balanced", "paper", "equal-tokens"]
    memory_budget_tokens: int
    compute_budget: float | None
    exponent: float | None
    cost_model: Literal["auto", "power", "two-term"]
    bench_file: str | None
    buckets: tuple[tuple[int, int, int], ...] | None  # pixel (frames, height, width)
    refit_every_steps: int = 0


@dataclass(frozen=True)
class CheckpointConfig:
    uri: str | None  # gs://... or an absolute path; None disables checkpoints
    interval: int
    keep: int


@dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits in the job (the operator's pod environment)."""

    coordinator_address: str | None
    num_slices: int
    slice_index: int
    hosts_per_slice: int
    host_index: int
    devices_per_host: int | None
    # torchrun's LOCAL_RANK: several trainer processes share a GPU pod (and its metrics port); 0 elsewhere.
    local_rank: int = 0

    @property
    def num_processes(self) -> int:
        return self.num_slices * self.hosts_per_slice

    @property
    def process_id(self) -> int:
        return keys.global_process_id(self.slice_index, self.hosts_per_slice, self.host_index)

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


@dataclass(frozen=True)
class TrainConfig:
    """Everything one trainer process needs, typed; built by :func:`from_trainingjob`."""

    job_name: str
    namespace: str | None
    backend: Literal["jax", "torch"]
    accelerator: Literal["tpu", "gpu", "cpu"]
    accelerator_type: str | None  # flops.ACCELERATORS key for MFU ("tpu7x-tensorcore", "h100", ...); None on CPU
    model: ModelConfig
    routing: RoutingConfig
    optimizer: OptimizerConfig
    parallel: ParallelConfig
    data: DataConfig
    adaptive_load: AdaptiveLoadConfig
    checkpoint: CheckpointConfig
    distributed: DistributedConfig
    steps: int
    global_batch: int
    seed: int
    # Share of video samples a unified TI2V model trains as image-to-video (train.objective); 0 otherwise.
    image_to_video_fraction: float
    log_every: int
    metrics_port: int  # 0 disables the exporter
    run_dir: str

    def __post_init__(self) -> None:
        if self.global_batch < self.parallel.batch_ranks:
            raise ValueError(
                f"spec.training.globalBatch={self.global_batch} cannot feed {self.parallel.batch_ranks} data-parallel "
                "ranks (data x fsdp)"
            )
        if self.parallel.num_devices % self.distributed.num_processes:
            raise ValueError(
                f"{self.parallel.num_devices} devices do not split evenly over {self.distributed.num_processes} "
                "processes (WANLOOM_NUM_SLICES x WANLOOM_HOSTS_PER_SLICE)"
            )


def from_trainingjob(job: TrainingJob, env: Mapping[str, str]) -> TrainConfig:
    """Build the trainer's configuration from a validated TrainingJob and the process environment.

    Raises:
        ValueError: naming the field or environment variable when a value cannot be used.
    """
    spec = job.spec
    return TrainConfig(
        job_name=env.get(keys.ENV_JOB_NAME) or job.metadata.name,
        namespace=env.get(keys.ENV_NAMESPACE) or job.metadata.namespace,
        backend=spec.resources.resolved_backend,
        accelerator=spec.resources.accelerator,
        accelerator_type=_accelerator_type(spec),
        model=_model(spec),
        routing=_routing(spec),
        optimizer=_optimizer(spec),
        parallel=_parallel(spec),
        data=_data(spec),
        adaptive_load=_adaptive_load(spec),
        checkpoint=_checkpoint(spec),
        distributed=_distributed(env),
        steps=spec.training.steps,
        global_batch=spec.training.global_batch,
        seed=spec.training.seed,
        image_to_video_fraction=spec.image_to_video_fraction,
        log_every=spec.training.log_every,
        metrics_port=_env_int(env, keys.ENV_METRICS_PORT, spec.metrics_port, minimum=0),
        run_dir=_local_path(env.get(keys.ENV_RUN_DIR) or str(Path("runs") / job.metadata.name)),
    )


def load_train_config(env: Mapping[str, str]) -> TrainConfig:
    """The pod entry point's view: read the TrainingJob named by ``WANLOOM_CONFIG`` and build the config."""
    path = env.get(keys.ENV_CONFIG)
    if not path:
        raise ValueError(f"{keys.ENV_CONFIG} is not set; it must name the mounted TrainingJob YAML")
    return from_trainingjob(load_trainingjob_file(path), env)


def _accelerator_type(spec: TrainingJobSpec) -> str | None:
    res = spec.resources
    if res.tpu is not None:
        return "tpu7x-tensorcore"  # one JAX device per TensorCore: MFU counts devices, so per-device peak
    if res.gpu is not None and res.gpu.type != "other":
        return res.gpu.type
    if res.cpu is not None:
        return "cpu"  # nominal per-core peak (flops.ACCELERATORS): local runs report a stated, honest MFU
    return None


def _model(spec: TrainingJobSpec) -> ModelConfig:
    attention = spec.kernels.attention
    if attention == "auto":
        if spec.resources.resolved_backend == "torch":
            attention = "sdpa"
        else:
            attention = "splash" if spec.resources.accelerator == "tpu" else "xla"
    return ModelConfig(
        variant=spec.model.variant,
        weights=_uri(spec.model.weights),
        param_dtype=spec.model.param_dtype,
        compute_dtype=spec.model.compute_dtype,
        adaln=spec.kernels.adaln,
        attention=attention,
        remat=spec.parallelism.remat,
    )


def _routing(spec: TrainingJobSpec) -> RoutingConfig:
    r = spec.routing
    sampling, shift = spec.timestep_sampling
    return RoutingConfig(
        boundary_ratio=spec.boundary_ratio,
        mode=r.mode,
        sampling=sampling,
        logit_mean=r.logit_mean,
        logit_std=r.logit_std,
        shift=shift,
        loss_weighting=r.loss_weighting,
    )


def _optimizer(spec: TrainingJobSpec) -> OptimizerConfig:
    o = spec.optimizer
    return OptimizerConfig(
        learning_rate=o.learning_rate,
        schedule=o.schedule,
        warmup_steps=o.warmup_steps,
        betas=(float(o.betas[0]), float(o.betas[1])),
        eps=o.eps,
        weight_decay=o.weight_decay,
        clip_grad_norm=o.clip_grad_norm,
        per_expert_lr_scaling=o.per_expert_lr_scaling,
    )


def _parallel(spec: TrainingJobSpec) -> ParallelConfig:
    devices = device_count(spec)
    if devices is None:
        raise ValueError("spec.resources: cannot count the job's devices (check tpu.topology)")
    try:
        degrees = resolve_parallelism(spec.parallelism.degrees(), devices)
    except ValueError as exc:
        raise ValueError(f"spec.parallelism: {exc}") from None
    return ParallelConfig(**degrees)


def _data(spec: TrainingJobSpec) -> DataConfig:
    d = spec.data
    return DataConfig(
        uri=_uri(d.uri),
        index=_uri(d.index),
        synthetic=SyntheticConfig(d.synthetic.samples, d.synthetic.seed) if d.synthetic else None,
        prefetch=d.prefetch,
        max_bad_samples=d.max_bad_samples,
        storage_outage_seconds=d.storage_outage_seconds,
    )


def _adaptive_load(spec: TrainingJobSpec) -> AdaptiveLoadConfig:
    a = spec.adaptive_load
    buckets = None if a.buckets is None else tuple((b.frames, b.height, b.width) for b in a.buckets)
    return AdaptiveLoadConfig(
        enabled=a.enabled,
        scheduler=a.scheduler,
        memory_budget_tokens=a.memory_budget_tokens,
        compute_budget=a.compute_budget,
        exponent=a.exponent,
        cost_model=a.cost_model,
        bench_file=_uri(a.bench_file),
        buckets=buckets,
        refit_every_steps=a.refit_every_steps,
    )


def _checkpoint(spec: TrainingJobSpec) -> CheckpointConfig:
    c = spec.training.checkpoint
    return CheckpointConfig(uri=_uri(c.uri), interval=c.interval, keep=c.keep)


def _distributed(env: Mapping[str, str]) -> DistributedConfig:
    num_slices = _env_int(env, keys.ENV_NUM_SLICES, 1, minimum=1)
    hosts = _env_int(env, keys.ENV_HOSTS_PER_SLICE, 1, minimum=1)
    slice_index = _env_int(env, keys.ENV_SLICE_INDEX, 0, minimum=0)
    host_index = _env_int(env, keys.ENV_HOST_INDEX, 0, minimum=0)
    if slice_index >= num_slices:
        raise ValueError(f"{keys.ENV_SLICE_INDEX}={slice_index} must be below {keys.ENV_NUM_SLICES}={num_slices}")
    if host_index >= hosts:
        raise ValueError(f"{keys.ENV_HOST_INDEX}={host_index} must be below {keys.ENV_HOSTS_PER_SLICE}={hosts}")
    coordinator = env.get(keys.ENV_COORDINATOR_ADDRESS) or None
    if num_slices * hosts > 1 and coordinator is None:
        raise ValueError(f"{keys.ENV_COORDINATOR_ADDRESS} must be set (host:port) when the job has several processes")
    if coordinator is not None and not _is_host_port(coordinator):
        raise ValueError(f"{keys.ENV_COORDINATOR_ADDRESS}={coordinator!r} is not host:port")
    devices = env.get(keys.ENV_DEVICES_PER_HOST)
    return DistributedConfig(
        coordinator_address=coordinator,
        num_slices=num_slices,
        slice_index=slice_index,
        hosts_per_slice=hosts,
        host_index=host_index,
        devices_per_host=None if not devices else _env_int(env, keys.ENV_DEVICES_PER_HOST, 1, minimum=1),
        local_rank=_env_int(env, "LOCAL_RANK", 0, minimum=0),
    )


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def _env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _uri(uri: str | None) -> str | None:
    """gs:// URIs stay as they are; local paths become absolute (relative ones resolve against the cwd)."""
    if uri is None or uri.startswith("gs://"):
        return uri
    return _local_path(uri)


def _local_path(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))
