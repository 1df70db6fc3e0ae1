"""The trainer's typed configuration: the TrainingJob's frozen spec models, plus what is resolved from them.

``from_trainingjob(job, env)`` is the only place the TrainingJob spec and the ``WANLOOM_*`` environment are read.
Spec sections the trainer uses as written (optimizer, data, AdaptiveLoad, checkpoints) are passed through as the
API's frozen models, local paths made absolute; dataclasses hold only resolved values: the model (attention
resolved, the variant's architecture), routing (the variant's defaults), the mesh degrees (``-1`` filled), and
where the process sits (``config.environment``). Pure Python: no jax, no torch, no I/O besides
``load_train_config`` reading the mounted TrainingJob file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from wanloom_api import keys
from wanloom_api.metrics import EXPERT_LABELS
from wanloom_api.trainingjob import (
    AdalnImpl,
    AdaptiveLoadSpec,
    CheckpointSpec,
    DataSpec,
    ExportSpec,
    LoraSpec,
    OptimizerSpec,
    Remat,
    TrackingSpec,
    TrainingJob,
    TrainingJobSpec,
    ValidationSpec,
)
from wanloom_api.validation import device_count, load_trainingjob_file, resolve_parallelism
from wanloom_trainer.config.environment import DistributedConfig, distributed_from_env, env_int
from wanloom_trainer.config.variants import WanVariant, get_variant

MESH_AXES = ("data", "fsdp", "context", "tensor")


@dataclass(frozen=True)
class ModelConfig:
    """Which transformer to build and how it computes (``attention`` is resolved: never ``auto``)."""

    variant: str
    weights: str | None
    param_dtype: Literal["float32", "bfloat16"]
    compute_dtype: Literal["float32", "bfloat16"]
    adaln: AdalnImpl
    attention: Literal["xla", "splash", "sdpa", "flash"]
    remat: Remat
    compile_blocks: bool = False  # torch: torch.compile each transformer block (spec.kernels.compile: blocks)
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
    only_expert: int | None = None  # LoRA on one expert (spec.lora.experts): every sample goes to it

    def router(self):  # -> routing.Router (imported lazily: scipy is only needed once a run starts)
        from wanloom_trainer.routing import Router, TimestepSampler

        sampler = TimestepSampler(self.sampling, self.shift, self.logit_mean, self.logit_std)
        return Router(sampler, self.boundary_ratio, self.mode, only=self.only_expert)

    def expected_shares(self) -> tuple[float, ...]:
        """Fraction of samples each expert id receives under this distribution: (high, low), or (1,) for one model."""
        high = self.router().high_noise_share
        return (high,) if self.boundary_ratio is None else (high, 1.0 - high)


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
class TrainConfig:
    """Everything one trainer process needs, typed; built by :func:`from_trainingjob`."""

    job_name: str
    namespace: str | None
    backend: Literal["jax", "torch"]
    accelerator: Literal["tpu", "gpu", "cpu"]
    accelerator_type: str | None  # flops.ACCELERATORS key for MFU ("tpu7x-tensorcore", "h100", ...); None on CPU
    model: ModelConfig
    routing: RoutingConfig
    optimizer: OptimizerSpec
    lora: LoraSpec | None  # low-rank adapters on frozen base weights; None: full training
    parallel: ParallelConfig
    data: DataSpec  # uri and index: gs:// or absolute
    adaptive_load: AdaptiveLoadSpec  # benchFile: gs:// or absolute
    checkpoint: CheckpointSpec  # uri: gs://, absolute or None
    tracking: TrackingSpec  # tensorboardUri: gs://, absolute or None
    validation: ValidationSpec | None
    export: ExportSpec | None  # uri: gs:// or absolute
    distributed: DistributedConfig
    steps: int
    global_batch: int
    seed: int
    # Share of video samples a unified TI2V model trains as image-to-video (backends.objective); 0 otherwise.
    image_to_video_fraction: float
    # Share of samples trained on the dataset's empty-prompt embedding (backends.objective.caption_dropped).
    caption_dropout: float
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

    @property
    def adapted_experts(self) -> tuple[bool, ...]:
        """Per expert (routing id): does it train LoRA adapters? (``adapted_experts``)."""
        return adapted_experts(self.model, self.lora)

    @property
    def evaluation_config(self) -> EvaluationConfig | None:
        """The sections validation is built from (``EvaluationConfig``); None without ``spec.validation``."""
        if self.validation is None:
            return None
        return EvaluationConfig(
            spec=self.validation,
            model=self.model,
            boundary_ratio=self.routing.boundary_ratio,
            seed=self.seed,
            steps=self.steps,
            batch_ranks=self.parallel.batch_ranks,
            checkpoint_uri=self.checkpoint.uri,
            run_dir=self.run_dir,
        )

    @property
    def tracking_config(self) -> TrackingConfig:
        """The sections the trackers are built from (``TrackingConfig``)."""
        return TrackingConfig(
            spec=self.tracking,
            job_name=self.job_name,
            namespace=self.namespace,
            run_dir=self.run_dir,
            checkpoint_uri=self.checkpoint.uri,
            summary={"variant": self.model.variant, "global_batch": self.global_batch, "steps": self.steps},
        )

    @property
    def backend_config(self) -> BackendConfig:
        """The sections a backend is built from (``BackendConfig``)."""
        return BackendConfig(
            model=self.model,
            parallel=self.parallel,
            optimizer=self.optimizer,
            lora=self.lora,
            checkpoint=self.checkpoint,
            distributed=self.distributed,
            seed=self.seed,
            run_dir=self.run_dir,
        )


@dataclass(frozen=True)
class EvaluationConfig:
    """What held-out validation and its videos are built from: ``spec.validation`` and what they read of the run.

    Attributes:
        spec: ``spec.validation``.
        model: the model section (variant, weights, latent geometry).
        boundary_ratio: the expert boundary (None: one model); it splits the validation timesteps into bands.
        seed: the run's seed (held-out choice, noise).
        steps: the run's length (a validation follows the last step).
        batch_ranks: data-parallel ranks (a validation slot holds a row per rank).
        checkpoint_uri, run_dir: where the videos go (``tracking.artifact_dir``) and weights are staged.
    """

    spec: ValidationSpec
    model: ModelConfig
    boundary_ratio: float | None
    seed: int
    steps: int
    batch_ranks: int
    checkpoint_uri: str | None
    run_dir: str


@dataclass(frozen=True)
class TrackingConfig:
    """What the experiment trackers are built from: ``spec.tracking`` and the run as they name it.

    Attributes:
        spec: ``spec.tracking`` (TensorBoard, W&B).
        job_name, namespace: the TrainingJob (W&B's run name and resumable id).
        run_dir: the local run directory (W&B's offline files).
        checkpoint_uri: the checkpoint root; artifacts (TensorBoard, sample videos) go beside a gs:// one.
        summary: the numbers W&B records with the run (variant, globalBatch, steps).
    """

    spec: TrackingSpec
    job_name: str
    namespace: str | None
    run_dir: str
    checkpoint_uri: str | None
    summary: Mapping[str, object]


@dataclass(frozen=True)
class BackendConfig:
    """What a training backend is built from: the model, parallelism, optimizer, LoRA and checkpoint sections and
    the process layout, not the whole run (data, AdaptiveLoad, validation, export and reporting are the driver's).

    Attributes:
        seed: parameter initialisation and the backend's own random stream (LoRA dropout).
        run_dir: where the backend keeps its local files (compile caches).
    """

    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerSpec
    lora: LoraSpec | None
    checkpoint: CheckpointSpec
    distributed: DistributedConfig
    seed: int
    run_dir: str

    @property
    def adapted_experts(self) -> tuple[bool, ...]:
        return adapted_experts(self.model, self.lora)


def adapted_experts(model: ModelConfig, lora: LoraSpec | None) -> tuple[bool, ...]:
    """Per expert (routing id): does it train LoRA adapters (``spec.lora.experts``; a single-model variant's one
    model whenever LoRA is on)? All False for full training."""
    n = model.num_experts
    if lora is None:
        return (False,) * n
    if lora.experts == "both" or n == 1:
        return (True,) * n
    return tuple(label == lora.experts for label in EXPERT_LABELS[:n])


def from_trainingjob(job: TrainingJob, env: Mapping[str, str]) -> TrainConfig:
    """Build the trainer's configuration from a validated TrainingJob and the process environment.

    Raises:
        ValueError: naming the field or environment variable when a value cannot be used.
    """
    spec = job.spec
    if spec.data.uri is None:
        raise ValueError(
            f"spec.data.dataset: LatentDataset {spec.data.dataset!r} is resolved by the operator on a cluster; "
            "to run here, set spec.data.uri to its output (after `wanloom data build DATASET.yaml`)"
        )
    return TrainConfig(
        job_name=env.get(keys.ENV_JOB_NAME) or job.metadata.name,
        namespace=env.get(keys.ENV_NAMESPACE) or job.metadata.namespace,
        backend=spec.resources.resolved_backend,
        accelerator=spec.resources.accelerator,
        accelerator_type=_accelerator_type(spec),
        model=_model(spec),
        routing=_routing(spec),
        optimizer=spec.optimizer,
        lora=spec.lora,
        parallel=_parallel(spec),
        data=spec.data.model_copy(update={"uri": _uri(spec.data.uri), "index": _uri(spec.data.index)}),
        adaptive_load=spec.adaptive_load.model_copy(update={"bench_file": _uri(spec.adaptive_load.bench_file)}),
        checkpoint=spec.training.checkpoint.model_copy(
            update={"uri": _output_dir(spec.training.checkpoint.uri, "spec.training.checkpoint.uri")}
        ),
        validation=spec.validation,
        export=None
        if spec.export is None
        else spec.export.model_copy(update={"uri": _output_dir(spec.export.uri, "spec.export.uri")}),
        tracking=spec.tracking.model_copy(
            update={"tensorboard_uri": _output_dir(spec.tracking.tensorboard_uri, "spec.tracking.tensorboardUri")}
        ),
        distributed=distributed_from_env(env),
        steps=spec.training.steps,
        global_batch=spec.training.global_batch,
        seed=spec.training.seed,
        image_to_video_fraction=spec.image_to_video_fraction,
        caption_dropout=spec.caption_dropout,
        log_every=spec.training.log_every,
        metrics_port=env_int(env, keys.ENV_METRICS_PORT, spec.metrics_port, minimum=0),
        run_dir=_output_dir(env.get(keys.ENV_RUN_DIR) or str(Path("runs") / job.metadata.name), keys.ENV_RUN_DIR),
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
        compile_blocks=spec.kernels.compile == "blocks",
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
        only_expert=None
        if spec.lora is None or spec.lora.experts == "both"
        else EXPERT_LABELS.index(spec.lora.experts),
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


def _uri(uri: str | None) -> str | None:
    """gs:// URIs stay as they are; local paths become absolute (relative ones resolve against the cwd)."""
    if uri is None or uri.startswith("gs://"):
        return uri
    return _local_path(uri)


def _output_dir(uri: str | None, field: str) -> str | None:
    """``_uri`` for a directory the run writes: a local one must not be, or lie under, a regular file."""
    uri = _uri(uri)
    if uri is None or uri.startswith("gs://"):
        return uri
    for folder in (Path(uri), *Path(uri).parents):
        if folder.exists():
            if not folder.is_dir():
                where = "is a file" if folder == Path(uri) else f"lies under {folder}, which is a file"
                raise ValueError(f"{field}: {uri} {where}, not a directory; name a directory")
            break
    return uri


def _local_path(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))
