"""The TrainingJob API (wanloom.dev/v1alpha1): the single source of truth for the CRD, the operator and the trainer.

Every field's description becomes its CRD description. Per-field rules (types, enums, bounds) live on the fields;
rules that span fields live in ``validation.py`` and, where CEL can express them, in ``x-kubernetes-validations``
on the owning model (``cel_rules`` below) so the API server rejects them too.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from wanloom_api import keys
from wanloom_api.conditions import Phase
from wanloom_api.topology import (
    GPUS_PER_NODE,
    TENSORCORES_PER_TPU7X_CHIP,
    TPU7X_TOPOLOGY_MAX_LENGTH,
    tpu7x_chips_cel,
    tpu7x_topology_cel,
    valid_tpu7x_topologies,
)

GROUP = "wanloom.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ("tj",)

# The tiny variants are CPU-sized stand-ins for the three Wan 2.2 modes: tiny (two experts, text-to-video),
# tiny-i2v (two experts, image condition channels) and tiny-ti2v (one model, per-token timesteps). The mini variants
# are the same modes shaped like the real models at their smallest (head_dim 128, freq_dim 256, text_dim 4096, the
# real channel counts, two layers): what tools that read a model's size off its weights (ComfyUI) accept.
Variant = Literal[
    "wan2.2-t2v-a14b",
    "wan2.2-i2v-a14b",
    "wan2.2-ti2v-5b",
    "tiny",
    "tiny-i2v",
    "tiny-ti2v",
    "mini-t2v",
    "mini-i2v",
    "mini-ti2v",
]
# Inference boundary between the experts as a fraction of the 1000-step schedule (official Wan 2.2 configs);
# None marks a single-model variant, for which routing has no boundary.
DEFAULT_BOUNDARY_RATIO: dict[str, float | None] = {
    "wan2.2-t2v-a14b": 0.875,
    "wan2.2-i2v-a14b": 0.900,
    "wan2.2-ti2v-5b": None,
    "tiny": 0.875,
    "tiny-i2v": 0.900,
    "tiny-ti2v": None,
    "mini-t2v": 0.875,
    "mini-i2v": 0.900,
    "mini-ti2v": None,
}
# Training timestep distribution per variant when spec.routing leaves it unset: DiffSynth-Studio's Wan 2.2 recipe
# (examples/wanvideo/model_training: FlowMatchScheduler with shift 5, timestep index drawn uniformly; its A14B
# scripts split the experts at index fraction 0.358 = t 900 for I2V). Uniform with shift 5 sends 41.7% of T2V
# samples to the high-noise expert (t >= 875) and 35.7% of I2V ones (t >= 900); logit-normal with shift 1 sent 2.6%.
DEFAULT_TIMESTEPS: dict[str, tuple[Literal["uniform", "logit-normal"], float]] = {
    "wan2.2-t2v-a14b": ("uniform", 5.0),
    "wan2.2-i2v-a14b": ("uniform", 5.0),
    "wan2.2-ti2v-5b": ("uniform", 5.0),
    "tiny": ("uniform", 1.0),
    "tiny-i2v": ("uniform", 1.0),
    "tiny-ti2v": ("uniform", 1.0),
    "mini-t2v": ("uniform", 1.0),
    "mini-i2v": ("uniform", 1.0),
    "mini-ti2v": ("uniform", 1.0),
}
# Share of video samples a unified text/image-to-video model (per-token timesteps) trains as image-to-video when
# spec.training.imageToVideoFraction is unset; None marks variants without that mode. Wan 2.2 trains TI2V-5B on
# both tasks and publishes no ratio: an even split is our default.
DEFAULT_IMAGE_TO_VIDEO_FRACTION: dict[str, float | None] = {
    "wan2.2-t2v-a14b": None,
    "wan2.2-i2v-a14b": None,
    "wan2.2-ti2v-5b": 0.5,
    "tiny": None,
    "tiny-i2v": None,
    "tiny-ti2v": 0.5,
    "mini-t2v": None,
    "mini-i2v": None,
    "mini-ti2v": 0.5,
}
# Share of samples trained on the empty prompt (classifier-free guidance) when spec.data.captionDropout is unset:
# 10% for full fine-tuning of the Wan models, the share classifier-free-guidance training commonly drops; none for
# the tiny models, whose synthetic datasets exist to check the trainer, not to be sampled with guidance.
DEFAULT_CAPTION_DROPOUT: dict[str, float] = {
    "wan2.2-t2v-a14b": 0.1,
    "wan2.2-i2v-a14b": 0.1,
    "wan2.2-ti2v-5b": 0.1,
    "tiny": 0.0,
    "tiny-i2v": 0.0,
    "tiny-ti2v": 0.0,
    "mini-t2v": 0.0,
    "mini-i2v": 0.0,
    "mini-ti2v": 0.0,
}
# Sampling defaults for validation videos per variant, (steps, shift, guidance (high-noise, low-noise)): the Wan 2.2
# release's inference configs (wan/configs: t2v_A14B 40 steps, shift 12, guide (4.0 high, 3.0 low); i2v_A14B 40,
# shift 5, guide 3.5; ti2v_5B 50, shift 5, guide 5), which sample with UniPC (spec.validation.sampler's default);
# the tiny models were trained unshifted.
DEFAULT_SAMPLING: dict[str, tuple[int, float, tuple[float, float]]] = {
    "wan2.2-t2v-a14b": (40, 12.0, (4.0, 3.0)),
    "wan2.2-i2v-a14b": (40, 5.0, (3.5, 3.5)),
    "wan2.2-ti2v-5b": (50, 5.0, (5.0, 5.0)),
    "tiny": (8, 1.0, (3.0, 3.0)),
    "tiny-i2v": (8, 1.0, (3.0, 3.0)),
    "tiny-ti2v": (8, 1.0, (3.0, 3.0)),
    "mini-t2v": (8, 1.0, (3.0, 3.0)),
    "mini-i2v": (8, 1.0, (3.0, 3.0)),
    "mini-ti2v": (8, 1.0, (3.0, 3.0)),
}
# What splitting a sample's sequence over ranks depends on, per variant: (attention heads, pixels per token along
# frames, height and width = VAE stride × patch). Ulysses context parallelism splits the heads, so the context degree
# must divide them; a sample of F×H×W pixels is ((F − 1)/4 + 1)·(H/ph)·(W/pw) tokens, which the context × tensor
# degree must divide wherever a micro-batch holds whole samples (everything but packed rows).
SEQUENCE_GEOMETRY: dict[str, tuple[int, tuple[int, int, int]]] = {
    "wan2.2-t2v-a14b": (40, (4, 16, 16)),
    "wan2.2-i2v-a14b": (40, (4, 16, 16)),
    "wan2.2-ti2v-5b": (24, (4, 32, 32)),
    "tiny": (2, (4, 16, 16)),
    "tiny-i2v": (2, (4, 16, 16)),
    "tiny-ti2v": (2, (4, 16, 16)),
    "mini-t2v": (2, (4, 16, 16)),
    "mini-i2v": (2, (4, 16, 16)),
    "mini-ti2v": (2, (4, 32, 32)),
}


def tokens_per_sample(variant: str, frames: int, height: int, width: int) -> int:
    """Transformer tokens of one F×H×W sample (``SEQUENCE_GEOMETRY``; the trainer's ``config.variants`` agrees)."""
    _, (ft, fh, fw) = SEQUENCE_GEOMETRY[variant]
    return ((frames - 1) // ft + 1) * (height // fh) * (width // fw)


# Toy models: random weights are fine (and a small random VAE decodes their validation videos).
TINY_VARIANTS: tuple[str, ...] = ("tiny", "tiny-i2v", "tiny-ti2v", "mini-t2v", "mini-i2v", "mini-ti2v")
# Variants conditioned on an image (the I2V layout): they cannot generate from a text prompt alone.
IMAGE_CONDITIONED_VARIANTS: tuple[str, ...] = ("wan2.2-i2v-a14b", "tiny-i2v", "mini-i2v")
PROMPTS_NEED_TEXT_TO_VIDEO = "validation.promptSize: an image-to-video variant cannot generate from a prompt alone"
DType = Literal["float32", "bfloat16"]
AdalnImpl = Literal["fused", "reference"]
Remat = Literal["none", "full", "save-matmuls", "save-attention"]
ADALN_IMPLS: tuple[str, ...] = get_args(AdalnImpl)
REMAT_POLICIES: tuple[str, ...] = get_args(Remat)


# A dataset, weights or checkpoint location: gs://bucket[/prefix] or a path. The CEL rule mirrors
# validation._check_uris so `kubectl apply` refuses what `wanloom validate` refuses.
# Anything that starts like a URI scheme ("gs:/b", "s3://b") must be gs://bucket[...]; the rest is a path.
URI_SCHEME_PATTERN = r"^[a-zA-Z][a-zA-Z0-9+.-]*:"
GCS_URI_PATTERN = r"^gs://[^/]+"
STORAGE_URI = "use gs://bucket/prefix or a path (no other scheme, and a bucket after gs://)"
StorageURI = Annotated[
    str,
    Field(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"!self.matches('{URI_SCHEME_PATTERN}') || self.matches('{GCS_URI_PATTERN}')",
                    "message": STORAGE_URI,
                }
            ]
        }
    ),
]


GPU_NEEDS_TORCH = "gpu runs the torch backend only (the JAX trainer image is built for TPU)"
PARALLELISM_PRODUCT = (
    "the parallelism degrees (data x fsdp x context x tensor) must multiply to the job's devices, or with one -1 "
    "divide them (devices: 2 per tpu7x chip x slices; gpu perNode x nodes; cpu nodes x devicesPerNode)"
)
GLOBAL_BATCH_PER_RANK = "globalBatch must give every data-parallel rank (data x fsdp) at least one sample"
MAX_DEGREE = 1 << 20  # bounds the CEL product below int64
MAX_VOLUMES = 32  # bounds the CEL rules' cost (the duplicate check is quadratic)
MAX_POD_METADATA = 64  # labels or annotations a TrainingJob adds to its pods (bounds the CEL rules' cost)
# Label and annotation keys of trainer pods that wanloom, JobSet, Kubernetes and GKE set: a TrainingJob (or the
# chart's trainerPods) may not set them.
RESERVED_POD_KEY_PREFIXES = (
    "wanloom.dev/", "jobset.sigs.k8s.io/", "batch.kubernetes.io/", "kueue.x-k8s.io/", "networking.gke.io/",
    "app.kubernetes.io/",
)  # fmt: skip
RESERVED_POD_KEY = f"keys under {', '.join(RESERVED_POD_KEY_PREFIXES)} are set by wanloom, JobSet, Kueue or GKE"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"
VOLUME_NEEDS_NAME = "every volume needs a name"
RESERVED_VOLUME = f"the operator's volumes are reserved ({', '.join(keys.OPERATOR_VOLUMES)})"
DUPLICATE_VOLUME = "volume names must be unique"
MOUNT_NEEDS_NAME_AND_PATH = "a volumeMount needs name and mountPath"
MOUNT_OF_NO_VOLUME = "a volumeMount must name a volume of spec.resources.volumes"
RESERVED_MOUNT_PATH = f"the operator's mount paths are reserved ({', '.join(keys.OPERATOR_VOLUMES.values())})"
_RESERVED_PATH_REGEX = "^(" + "|".join(keys.OPERATOR_VOLUMES.values()) + ")/*$"  # paths hold no regex syntax


def _parallelism_cel() -> tuple[str, str]:
    """CEL on the spec for the device-count rules: (the degrees multiply to the devices, as
    validation.resolve_parallelism decides; globalBatch covers data x fsdp ranks, a -1 filled from the devices).

    Products are built one factor at a time, each bounded by the device count before the next multiplies, so no
    intermediate overflows. Where the accelerator block or the TPU topology is refused by its own rule, or the
    degrees by ParallelismSpec's, these rules stand aside.
    """
    tpu, gpu, cpu = "self.resources.tpu", "self.resources.gpu", "self.resources.cpu"
    devices = (
        f"(has({tpu}) ? {tpu7x_chips_cel(tpu + '.topology')} * {TENSORCORES_PER_TPU7X_CHIP} * {tpu}.slices : "
        f"has({gpu}) ? {gpu}.perNode * {gpu}.nodes : {cpu}.nodes * {cpu}.devicesPerNode)"
    )
    degrees = [f"self.parallelism.{d}" for d in ("data", "fsdp", "context", "tensor")]
    listed = "[" + ", ".join(degrees) + "]"
    factors = [f"({d} == -1 ? 1 : {d})" for d in degrees]
    partial = [" * ".join(factors[: i + 1]) for i in range(4)]
    fixed = partial[-1]  # the product of the degrees that are not -1
    not_applicable = (
        f"!([has({tpu}), has({gpu}), has({cpu})].filter(x, x).size() == 1) || "
        f"(has({tpu}) && !{tpu7x_topology_cel(tpu + '.topology')}) || "
        f"{listed}.filter(d, d == -1).size() > 1 || {listed}.exists(d, d == 0)"
    )
    product_ok = " && ".join(f"{p} <= {devices}" for p in partial) + (
        f" && ({listed}.exists(d, d == -1) ? {devices} % ({fixed}) == 0 : {fixed} == {devices})"
    )
    ranks = " * ".join(f"({d} == -1 ? {devices} / ({fixed}) : {d})" for d in degrees[:2])
    return (
        f"{not_applicable} || ({product_ok})",
        f"{not_applicable} || !({product_ok}) || self.training.globalBatch >= {ranks}",
    )


def _cel_list(values: Any) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


INT64_MAX = (1 << 63) - 1


class _Model(BaseModel):
    """Base: camelCase on the wire (only), snake_case in Python, unknown fields rejected, and the API server's
    types: no coercion (``"200"`` is not an integer, ``1`` not a boolean), integers within int64, finite floats."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=False,
        serialize_by_alias=False,
        extra="forbid",
        validate_default=True,
        frozen=True,
        strict=True,
        allow_inf_nan=False,
    )
    # CEL rules emitted into the CRD: (rule, message) or (rule, message, fieldPath), the field path relative to
    # this object so the API server's error names the field (spec.routing.boundaryRatio), not the object.
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        # The API server prunes `field: null` (none of these fields is nullable); an unknown key stays, and fails.
        if not isinstance(data, dict):
            return data
        known = {field.alias or name for name, field in cls.model_fields.items()}
        return {k: v for k, v in data.items() if not (v is None and k in known)}

    @field_validator("*", mode="after")
    @classmethod
    def _within_int64(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise ValueError(f"must fit in a 64-bit integer, as the API server stores it (got {value})")
        return value


class ModelSpec(_Model):
    variant: Variant = Field(
        description="Wan model to train; 'tiny', 'tiny-i2v' and 'tiny-ti2v' are toy models of the three modes for "
        "CPU runs; 'mini-t2v', 'mini-i2v' and 'mini-ti2v' the same modes shaped like the real models at their smallest "
        "(head_dim 128, text_dim 4096, the real channels; two layers), whose exports ComfyUI's loaders accept."
    )
    weights: StorageURI | None = Field(
        None,
        description="Diffusers-layout checkpoint root (gs:// or a path) with transformer/ (high-noise expert) and "
        "transformer_2/ (low-noise); unset starts from random weights.",
    )
    param_dtype: DType = Field("float32", description="Master weight and optimizer state dtype.")
    compute_dtype: DType = Field("bfloat16", description="Matmul and activation dtype.")


class RoutingSpec(_Model):
    boundary_ratio: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="High-noise expert takes t >= boundaryRatio*1000. Defaults per variant (0.875 T2V, 0.900 I2V); "
        "must be unset for the single-model wan2.2-ti2v-5b.",
    )
    mode: Literal["per-sample", "per-batch"] = Field(
        "per-sample", description="per-sample: each sample's t picks its expert; per-batch: one draw per step."
    )
    sampling: Literal["uniform", "logit-normal"] | None = Field(
        None, description="Timestep distribution. Default per variant: uniform (DiffSynth-Studio's Wan 2.2 recipe)."
    )
    logit_mean: float = Field(0.0, description="Mean of the logit-normal sampler.")
    logit_std: float = Field(1.0, gt=0.0, description="Standard deviation of the logit-normal sampler.")
    shift: float | None = Field(
        None,
        gt=0.0,
        description="Time shift s: sigma' = s*sigma/(1+(s-1)*sigma); 1 disables it. Default per variant: 5 for Wan 2.2 "
        "(DiffSynth-Studio's recipe: 42% of T2V samples reach the high-noise expert), 1 for the tiny and mini "
        "variants.",
    )
    loss_weighting: Literal["none", "bell"] = Field(
        "none", description="Per-timestep loss weight, normalised over the 1000-point grid."
    )


class SyntheticDataSpec(_Model):
    samples: int = Field(64, ge=1, le=10_000_000, description="Number of synthetic samples to generate.")
    seed: int = Field(0, ge=0, description="Seed of the synthetic generator.")


DATA_URI_OR_DATASET = "set exactly one of data.uri or data.dataset"


class DataSpec(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = (("has(self.uri) != has(self.dataset)", DATA_URI_OR_DATASET),)
    uri: StorageURI | None = Field(
        None,
        min_length=1,
        description="Dataset root (gs://bucket/prefix or a path) holding WebDataset shards of precomputed latents.",
    )
    dataset: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="A LatentDataset in this namespace, instead of uri: the job waits (Pending) until it is Ready, "
        "then trains on its output, and fails with its reason if it fails.",
    )
    index: StorageURI | None = Field(None, description="Shape index file; defaults to <uri>/index.json.")
    synthetic: SyntheticDataSpec | None = Field(
        None, description="Generate a synthetic mixed-shape dataset at uri first if none is there (local runs)."
    )
    prefetch: int = Field(4, ge=0, le=64, description="Micro-batches prefetched ahead of the step.")
    caption_dropout: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="Share of samples trained with the empty-prompt embedding (the unconditional branch "
        "classifier-free guidance needs; `wanloom data prepare` stores it with the dataset). Default per variant: "
        "0.1 for the Wan models, 0 for the tiny and mini variants.",
    )
    max_bad_samples: int = Field(
        100, ge=0, description="Distinct corrupt or missing samples skipped (and counted) before the run fails."
    )
    storage_outage_seconds: int = Field(
        600,
        ge=0,
        le=86_400,
        description="How long storage may stay unreachable before the run fails: the loader waits with backoff, "
        "skipping nothing, and a checkpoint storage lost is made again at the next step once it answers.",
    )


FRAMES_4K_PLUS_1 = "frames must be 4k+1 (1, 5, ..., 81) to match the VAE's temporal stride"
MULTIPLE_OF_16 = "must be a multiple of 16 (VAE stride 8 x patch 2)"
WARMUP_WITHIN_STEPS = "optimizer.warmupSteps must not exceed training.steps"
BATCH_WITHIN_EPOCH = (
    "training.globalBatch must not exceed the synthetic dataset's samples less the validation hold-out (a step "
    "holds at most one epoch)"
)
MAX_GLOBAL_BATCH = 1 << 20
EXPORT_NEEDS_CHECKPOINTS = "export needs training.checkpoint.uri: the final checkpoint is what it exports"
EXPORT_EMA_NEEDS_EMA = "export.ema needs optimizer.ema: without it no EMA weights are kept"
EXPORT_MERGE_NEEDS_LORA = "export.merge folds LoRA adapters into model.weights: it needs spec.lora and model.weights"
SPLASH_NEEDS_TPU = "splash attention needs tpu resources"
TORCH_ATTENTION = "sdpa and flash attention need the torch backend; use auto or xla for jax"
XLA_ATTENTION = "xla attention needs the jax backend; use auto, sdpa or flash"
COMPILE_NEEDS_TORCH = "kernels.compile: blocks is for the torch backend (the jax backend compiles its whole step)"
# The backend the trainer runs (ResourcesSpec.resolved_backend), in CEL on the spec.
_BACKEND_CEL = "(has(self.resources.backend) ? self.resources.backend : (has(self.resources.gpu) ? 'torch' : 'jax'))"


class BucketSpec(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("(self.frames - 1) % 4 == 0", FRAMES_4K_PLUS_1, ".frames"),
        ("self.height % 16 == 0", MULTIPLE_OF_16, ".height"),
        ("self.width % 16 == 0", MULTIPLE_OF_16, ".width"),
    )
    frames: int = Field(ge=1, description="Pixel frames (1 for images).")
    height: int = Field(ge=16, description="Pixel height.")
    width: int = Field(ge=16, description="Pixel width.")

    @property
    def pixels(self) -> tuple[int, int, int]:
        return (self.frames, self.height, self.width)


class AdaptiveLoadSpec(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = (
        (
            "self.costModel != 'power' || has(self.computeBudget) || has(self.benchFile)",
            "costModel 'power' needs computeBudget (and exponent) or a benchFile to fit them from",
            ".costModel",
        ),
    )
    enabled: bool = Field(True, description="Plan per-rank work with AdaptiveLoad; off means equal-token batches.")
    scheduler: Literal["balanced", "paper", "equal-tokens"] = Field(
        "balanced",
        description="balanced: a window of steps planned together, every micro-batch slot balanced across ranks "
        "(backend jax: samples of any shapes packed into rows of two shapes); paper: one bucket per micro-batch with "
        "the dual-constraint batch sizes; equal-tokens: one bucket per micro-batch, B*S = memoryBudgetTokens (the "
        "bucket sampler).",
    )
    memory_budget_tokens: int = Field(
        32_768,
        ge=1,
        description="M_mem: tokens one rank holds in a micro-batch (B*S <= M_mem; with packing, the longest row).",
    )
    compute_budget: float | None = Field(None, gt=0.0, description="M_comp in B*S^p <= M_comp; fitted when unset.")
    exponent: float | None = Field(None, ge=1.0, le=3.0, description="p in B*S^p <= M_comp; fitted when unset.")
    cost_model: Literal["auto", "power", "two-term"] = Field(
        "auto",
        description="Step-time model: power t=a+b*B*S^p, two-term t=a+B*(alpha*S+beta*S^2), auto picks by "
        "held-out error (analytic FLOPs when no benchmark exists).",
    )
    bench_file: StorageURI | None = Field(None, description="Shape-benchmark JSON (wanloom plan --bench) to fit from.")
    refit_every_steps: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Refit the cost model from the run's own slot timings every N steps and plan with the fit "
        "when it beats the analytic FLOP model held out (plans then depend on measured times, so a rerun or a "
        "resumed run may plan differently); 0: measure and report the fit only.",
    )
    buckets: list[BucketSpec] | None = Field(
        None, description="Shape buckets; derived from the dataset's shape index when unset."
    )
    window_samples_per_rank: int = Field(
        256,
        ge=0,
        le=1_000_000,
        description="balanced: samples per data-parallel rank planned together (at most one epoch); the window's "
        "slots are dealt to its steps, each a copy of the window's mix, in a seeded order. 0: each step planned "
        "alone, exactly globalBatch samples in stream order.",
    )
    step_budget: Literal["samples", "tokens"] = Field(
        "samples",
        description="balanced: what every step holds the same amount of. samples: globalBatch samples (within a "
        "few percent), each weighing 1/globalBatch in the gradient; tokens: globalBatch times the dataset's mean "
        "tokens per sample, each token weighing the same (a step's sample count varies; faster where few samples "
        "per rank cannot fill micro-batches, see wanloom plan).",
    )


class KernelsSpec(_Model):
    adaln: AdalnImpl = Field(
        "reference", description="fused: Pallas (TPU) / Triton (GPU) LayerNorm+modulate; reference: framework ops."
    )
    attention: Literal["auto", "xla", "splash", "sdpa", "flash"] = Field(
        "auto", description="auto: splash on TPU, sdpa on GPU, xla elsewhere."
    )
    compile: Literal["none", "blocks"] = Field(
        "none",
        description="torch backend: blocks compiles each transformer block with torch.compile (regional "
        "compilation: one compile serves every layer, the first step pays for it); the jax backend always compiles.",
    )


class ParallelismSpec(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = (
        (
            "[self.data, self.fsdp, self.context, self.tensor].filter(d, d == -1).size() <= 1",
            "at most one parallelism degree may be -1 (fill the remaining devices)",
        ),
        ("[self.data, self.fsdp, self.context, self.tensor].all(d, d != 0)", "degrees must be >= 1 or -1"),
    )
    data: int = Field(
        1, ge=-1, le=MAX_DEGREE, description="Pure data-parallel (replicated) degree; -1 fills the remaining devices."
    )
    fsdp: int = Field(
        -1, ge=-1, le=MAX_DEGREE, description="Fully-sharded data-parallel degree; -1 fills the remaining devices."
    )
    context: int = Field(1, ge=-1, le=MAX_DEGREE, description="Context (sequence) parallel degree.")
    tensor: int = Field(1, ge=-1, le=MAX_DEGREE, description="Tensor parallel degree.")
    remat: Remat = Field(
        "save-attention",
        description="Activation rematerialisation: none, full, save-matmuls (save matmul outputs without a batch "
        "dimension), save-attention (save attention outputs, recompute the rest).",
    )

    def degrees(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "context": self.context, "tensor": self.tensor}


class EmaSpec(_Model):
    decay: float = Field(
        0.999, gt=0.0, lt=1.0, description="Per-step decay: ema = decay*ema + (1-decay)*weights after each step."
    )
    start_step: int = Field(
        0, ge=0, description="Steps before this one copy the weights into the EMA instead of averaging them."
    )


class OptimizerSpec(_Model):
    learning_rate: float = Field(1e-5, gt=0.0, le=1.0, description="Peak AdamW learning rate.")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="Decay after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.999), description="AdamW (beta1, beta2)."
    )
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled weight decay.")
    clip_grad_norm: float | None = Field(None, gt=0.0, description="Global-norm clipping per expert; unset disables.")
    per_expert_lr_scaling: bool = Field(
        False, description="Scale each expert's learning rate by its expected share of steps."
    )
    ema: EmaSpec | None = Field(
        None,
        description="Exponential moving average of both experts' weights (float32, sharded like them, checkpointed; "
        "`wanloom export --ema`); unset disables it.",
    )

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_from_a_list(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value  # YAML and JSON have lists, not tuples


# Linear layers of a Wan block LoRA adapts, by their diffusers names (relative to blocks.<i>): self-attention
# (attn1) and cross-attention (attn2) q, k, v and output projections, and the FFN's two matrices.
LoraTarget = Literal[
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "ffn.net.0.proj", "ffn.net.2",
]  # fmt: skip
LORA_TARGETS: tuple[str, ...] = get_args(LoraTarget)
LORA_NEEDS_WEIGHTS = "lora adapts trained weights: set model.weights (only the tiny variants start from random ones)"
LORA_EXPERT_OF_ONE_MODEL = "lora.experts: a single-model variant has one model; use both"
LORA_DROPOUT_NEEDS_TORCH = "lora.dropout: the jax backend trains adapters without dropout; set 0 or use backend torch"


class LoraSpec(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = (
        (
            "!has(self.targets) || self.targets.all(t, self.targets.filter(u, u == t).size() == 1)",
            "lora.targets must be unique",
            ".targets",
        ),
    )
    rank: int = Field(32, ge=1, le=1024, description="Adapter rank r.")
    alpha: float | None = Field(
        None, gt=0.0, le=65536.0, description="Adapters add (alpha / rank)·B·A·x; default: the rank (scale 1)."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input while training.")
    targets: list[LoraTarget] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        max_length=len(LORA_TARGETS),
        description="Linear layers of every block to adapt, by diffusers name: attn1/attn2 .to_q .to_k .to_v "
        ".to_out.0 and ffn.net.0.proj, ffn.net.2 (default: all ten).",
    )
    experts: Literal["both", "high_noise", "low_noise"] = Field(
        "both",
        description="Which experts get adapters. One expert: every sample's timestep is drawn within that expert's "
        "band (the configured distribution restricted to it), so every step trains it; the other stays frozen.",
    )

    @property
    def scale(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank


class CheckpointSpec(_Model):
    uri: StorageURI | None = Field(None, description="Checkpoint root (gs:// or a path); unset disables checkpoints.")
    interval: int = Field(1000, ge=1, description="Steps between checkpoints.")
    keep: int = Field(3, ge=1, description="Checkpoints retained (oldest deleted first).")


class ValidationSpec(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("self.videos <= self.samples", "videos are generated from held-out samples: at most samples", ".videos"),
    )

    every_steps: int = Field(ge=1, description="Steps between validations (and one after the last step).")
    samples: int = Field(
        8, ge=1, le=4096, description="Dataset samples held out of training (a seeded choice) and validated on."
    )
    timesteps_per_expert: int = Field(
        4,
        ge=1,
        le=64,
        description="Fixed timesteps per expert band (the midpoints of equal parts of the band) each held-out "
        "sample is scored at, with fixed noise: the validation loss is deterministic.",
    )
    videos: int = Field(
        1,
        ge=0,
        le=64,
        description="Held-out samples generated from their text (and I2V image) at each validation, decoded to "
        "mp4 and a contact sheet under <run dir>/samples/step-NNNNNN/ (beside a gs:// checkpoint root on a "
        "cluster); 0 disables generation.",
    )
    sampler: Literal["unipc", "euler"] = Field(
        "unipc",
        description="unipc: the multistep solver Wan 2.2's release and diffusers' Wan pipelines sample with (the "
        "videos preview what inference gives); euler: first-order flow-matching steps.",
    )
    inference_steps: int | None = Field(
        None,
        ge=1,
        le=1000,
        description="Sampler steps. Default per variant, as the Wan 2.2 release samples: 40 (A14B), 50 (TI2V-5B), "
        "8 (tiny, mini). The shift is the release's: 12 (T2V-A14B), 5 (I2V-A14B, TI2V-5B), 1 (tiny, mini).",
    )
    guidance_scale: float | None = Field(
        None,
        ge=1.0,
        le=30.0,
        description="Classifier-free guidance for both experts. Default per variant: Wan 2.2's (T2V-A14B 4.0 "
        "high-noise / 3.0 low-noise, I2V-A14B 3.5, TI2V-5B 5.0; tiny and mini 3.0).",
    )
    negative_prompt: bool = Field(
        False,
        description="Guide the videos away from the dataset's negative prompt (`wanloom data prepare "
        "--negative-prompt TEXT`, e.g. the Wan release's) instead of the empty prompt the pipelines use by default.",
    )
    prompt_size: BucketSpec | None = Field(
        None,
        description="Also generate one video per prompt of the dataset's prompts.npz (`wanloom data prepare "
        "--prompts`) at this pixel size at each validation; unset: none. Text-to-video variants only.",
    )
    vae: StorageURI | None = Field(
        None,
        description="Diffusers AutoencoderKLWan folder the videos are decoded with. Default: <model.weights>/vae; "
        "the tiny variants without weights use a small random VAE (shapes only).",
    )


class ExportSpec(_Model):
    uri: StorageURI = Field(min_length=1, description="Destination folder (gs:// or a path) of the exported model.")
    format: Literal["diffusers", "wan"] = Field(
        "diffusers",
        description="diffusers: transformer/ (+ transformer_2/) folders; wan: one original-Wan-keys safetensors file "
        "per expert (ComfyUI).",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="dtype of every tensor written.")
    ema: bool = Field(False, description="Export the EMA weights (needs spec.optimizer.ema).")
    merge: bool = Field(
        False,
        description="LoRA jobs: write full weights with the adapters merged into model.weights instead of the "
        "adapter files.",
    )


class WandbSpec(_Model):
    project: str = Field(min_length=1, max_length=128, description="W&B project the run logs to.")
    entity: str | None = Field(None, min_length=1, description="W&B team or user; unset: the API key's default.")
    mode: Literal["online", "offline"] = Field(
        "online", description="offline writes the run under the run directory for a later `wandb sync`."
    )


class TrackingSpec(_Model):
    tensorboard: bool = Field(True, description="Write TensorBoard event files (the per-step scalars).")
    tensorboard_uri: StorageURI | None = Field(
        None,
        description="Where the event files go. Default: <run dir>/tensorboard for a local checkpoint root, else a "
        "tensorboard/ folder beside the gs:// checkpoint root.",
    )
    wandb: WandbSpec | None = Field(
        None, description="Also log to Weights & Biases (WANDB_API_KEY from the environment); unset disables it."
    )


class TrainingSpec(_Model):
    steps: int = Field(
        ge=1,
        description="Total optimizer steps. Changed on resume (or by wanloom run --steps), the learning rate stays "
        "continuous: it goes on from the rate reached and its decay is re-laid over the steps that remain.",
    )
    global_batch: int = Field(
        ge=1,
        le=MAX_GLOBAL_BATCH,
        description="Samples per global step, over all ranks; at most one epoch of the dataset (the trainer refuses "
        "more before planning).",
    )
    seed: int = Field(0, ge=0, description="Seed of parameters, data order, timesteps and noise.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Where and how often to save.")
    log_every: int = Field(1, ge=1, description="Steps between metric updates.")
    image_to_video_fraction: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Share of video samples trained as image-to-video by a unified model (wan2.2-ti2v-5b, "
        "tiny-ti2v, mini-ti2v): the first latent frame is given clean with timestep 0 on its tokens and left out of "
        "the loss. "
        "Default 0.5 there; must be unset for other variants.",
    )


class TPUSpec(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = (
        (tpu7x_topology_cel("self.topology"), f"not a tpu7x topology; {valid_tpu7x_topologies()}", ".topology"),
    )
    type: Literal["tpu7x"] = Field("tpu7x", description="TPU generation (Ironwood).")
    topology: str = Field(
        pattern=r"^[1-9][0-9]*x[1-9][0-9]*x[1-9][0-9]*$",
        max_length=TPU7X_TOPOLOGY_MAX_LENGTH,
        description="Slice topology AxBxC.",
    )
    slices: int = Field(1, ge=1, le=1024, description="Number of slices (multi-slice over DCN).")


class GPUSpec(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = tuple(
        (f"self.type != '{kind}' || {n} % self.perNode == 0", f"{kind} nodes have {n} GPUs; perNode must divide {n}",
         ".perNode")
        for kind, n in GPUS_PER_NODE.items()
    )  # fmt: skip
    type: Literal["h100", "h200", "b200", "other"] = Field(description="GPU model; sets the node selector.")
    per_node: int = Field(8, ge=1, le=16, description="GPUs per node (pod).")
    nodes: int = Field(1, ge=1, le=4096, description="Nodes (pods).")
    accelerator_label: str | None = Field(
        None,
        description="Value for cloud.google.com/gke-accelerator; defaults per type; unset with 'other' adds no "
        "accelerator selector (use nodeSelector).",
    )


class CPUSpec(_Model):
    nodes: int = Field(1, ge=1, le=64, description="Pods (processes).")
    devices_per_node: int = Field(1, ge=1, le=64, description="Host devices per process.")


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(_Model):
    name: str = Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str = ""


KubeObject = Annotated[dict[str, Any], Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})]


def _kube_object_with(**fields: tuple[int, str]) -> Any:
    """A pass-through Kubernetes object whose named string fields (max length, description) the CRD declares, so
    its CEL rules can read them (the lengths bound the rules' cost)."""
    properties = {
        name: {"type": "string", "maxLength": length, "description": description}
        for name, (length, description) in fields.items()
    }
    extra = {"x-kubernetes-preserve-unknown-fields": True, "properties": properties}
    return Annotated[dict[str, Any], Field(json_schema_extra=extra)]


Volume = _kube_object_with(name=(63, "Volume name (core/v1 Volume; the rest passes through)."))
VolumeMount = _kube_object_with(name=(63, "The volume mounted."), mountPath=(1024, "Where, in the trainer container."))


class PodRequests(_Model):
    cpu: str | None = Field(None, pattern=QUANTITY_PATTERN, max_length=32, description="CPU request, e.g. 200 or 500m.")
    memory: str | None = Field(
        None, pattern=QUANTITY_PATTERN, max_length=32, description="Memory request, e.g. 1800G or 64Gi."
    )


def _no_reserved_keys_cel(field: str) -> str:
    prefixes = " || ".join(f"k.startsWith('{p}')" for p in RESERVED_POD_KEY_PREFIXES)
    return f"!has(self.{field}) || self.{field}.all(k, !({prefixes}))"


class ResourcesSpec(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = (
        (_no_reserved_keys_cel("podLabels"), RESERVED_POD_KEY, ".podLabels"),
        (_no_reserved_keys_cel("podAnnotations"), RESERVED_POD_KEY, ".podAnnotations"),
        (
            "[has(self.tpu), has(self.gpu), has(self.cpu)].filter(x, x).size() == 1",
            "exactly one of tpu, gpu or cpu must be set",
        ),
        ("!has(self.tpu) || !has(self.backend) || self.backend == 'jax'", "tpu needs backend jax", ".backend"),
        ("!has(self.gpu) || !has(self.backend) || self.backend == 'torch'", GPU_NEEDS_TORCH, ".backend"),
        ("!has(self.volumes) || self.volumes.all(v, has(v.name) && v.name != '')", VOLUME_NEEDS_NAME, ".volumes"),
        (
            "!has(self.volumes) || "
            f"self.volumes.all(v, !has(v.name) || !(v.name in {_cel_list(keys.OPERATOR_VOLUMES)}))",
            RESERVED_VOLUME,
            ".volumes",
        ),
        (
            "!has(self.volumes) || "
            "self.volumes.all(v, !has(v.name) || self.volumes.filter(w, has(w.name) && w.name == v.name).size() == 1)",
            DUPLICATE_VOLUME,
            ".volumes",
        ),
        (
            "!has(self.volumeMounts) || self.volumeMounts.all(m, has(m.name) && has(m.mountPath))",
            MOUNT_NEEDS_NAME_AND_PATH,
            ".volumeMounts",
        ),
        (
            "!has(self.volumeMounts) || self.volumeMounts.all(m, !has(m.name) || "
            "(has(self.volumes) && self.volumes.exists(v, has(v.name) && v.name == m.name)))",
            MOUNT_OF_NO_VOLUME,
            ".volumeMounts",
        ),
        (
            "!has(self.volumeMounts) || "
            f"self.volumeMounts.all(m, !has(m.mountPath) || !m.mountPath.matches('{_RESERVED_PATH_REGEX}'))",
            RESERVED_MOUNT_PATH,
            ".volumeMounts",
        ),
        (
            "!has(self.cpu) || !has(self.backend) || self.backend != 'torch' || self.cpu.devicesPerNode == 1",
            "the torch backend on cpu runs one process per device: devicesPerNode must be 1 (use nodes)",
            ".cpu.devicesPerNode",
        ),
    )
    tpu: TPUSpec | None = Field(None, description="TPU v7x slices (JAX backend).")
    gpu: GPUSpec | None = Field(None, description="NVIDIA GPU nodes.")
    cpu: CPUSpec | None = Field(None, description="CPU only: local runs and cluster smoke tests.")
    backend: Literal["jax", "torch"] | None = Field(
        None, description="Trainer backend; defaults to jax for tpu and cpu, torch for gpu."
    )
    image: str | None = Field(None, description="Trainer image; defaults to the operator's image for the backend.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Added to the rendered node selector.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Added to the rendered tolerations.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra trainer environment; overrides defaults.")
    volumes: list[Volume] = Field(
        default_factory=list, max_length=MAX_VOLUMES, description="Extra pod volumes (core/v1 Volume)."
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=MAX_VOLUMES, description="Extra trainer volumeMounts."
    )
    queue_name: str | None = Field(None, description="Kueue LocalQueue; the JobSet is created suspended for Kueue.")
    priority_class_name: str | None = Field(None, description="Pod priority class.")
    service_account_name: str | None = Field(None, description="Pod service account.")
    host_network: bool | None = Field(None, description="Pod host networking; defaults to true on TPU.")
    image_pull_secrets: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="Secrets (in the job's namespace) to pull the trainer image, after the chart's trainerPods ones.",
    )
    pod_labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_POD_METADATA,
        description="Labels added to every trainer pod (over the chart's trainerPods.labels).",
    )
    pod_annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_POD_METADATA,
        description="Annotations added to every trainer pod (over the chart's trainerPods.annotations).",
    )
    pod_requests: PodRequests | None = Field(
        None,
        description="CPU and memory requests of a trainer pod, instead of the share of the machine the operator "
        "derives from the accelerators it uses (GPU type other: none); /dev/shm is a quarter of the memory.",
    )

    @field_validator("pod_labels")
    @classmethod
    def _pod_label_rules(cls, labels: dict[str, str]) -> dict[str, str]:
        return check_labels(no_reserved_pod_keys(labels))

    @field_validator("pod_annotations")
    @classmethod
    def _pod_annotation_rules(cls, annotations: dict[str, str]) -> dict[str, str]:
        return no_reserved_pod_keys(annotations)

    @property
    def accelerator(self) -> Literal["tpu", "gpu", "cpu"]:
        return "tpu" if self.tpu else "gpu" if self.gpu else "cpu"

    @property
    def resolved_backend(self) -> Literal["jax", "torch"]:
        if self.backend:
            return self.backend
        return "torch" if self.gpu else "jax"


class TrainingJobSpec(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = (
        (_parallelism_cel()[0], PARALLELISM_PRODUCT, ".parallelism"),
        ("self.optimizer.warmupSteps <= self.training.steps", WARMUP_WITHIN_STEPS, ".optimizer.warmupSteps"),
        ("self.kernels.attention != 'splash' || has(self.resources.tpu)", SPLASH_NEEDS_TPU, ".kernels.attention"),
        (
            f"!(self.kernels.attention in ['sdpa', 'flash']) || {_BACKEND_CEL} == 'torch'",
            TORCH_ATTENTION,
            ".kernels.attention",
        ),
        (f"self.kernels.attention != 'xla' || {_BACKEND_CEL} == 'jax'", XLA_ATTENTION, ".kernels.attention"),
        (f"self.kernels.compile != 'blocks' || {_BACKEND_CEL} == 'torch'", COMPILE_NEEDS_TORCH, ".kernels.compile"),
        (_parallelism_cel()[1], GLOBAL_BATCH_PER_RANK, ".training.globalBatch"),
        (
            "!has(self.data.synthetic) || self.training.globalBatch <= self.data.synthetic.samples - "
            "(has(self.validation) ? self.validation.samples : 0)",
            BATCH_WITHIN_EPOCH,
            ".training.globalBatch",
        ),
        (
            "!has(self.export) || has(self.training.checkpoint.uri)",
            EXPORT_NEEDS_CHECKPOINTS,
            ".export",
        ),
        ("!has(self.export) || !self.export.ema || has(self.optimizer.ema)", EXPORT_EMA_NEEDS_EMA, ".export.ema"),
        (
            "!has(self.export) || !has(self.export.merge) || !self.export.merge || "
            "(has(self.lora) && has(self.model.weights))",
            EXPORT_MERGE_NEEDS_LORA,
            ".export.merge",
        ),
        (
            f"!has(self.lora) || has(self.model.weights) || self.model.variant in {_cel_list(TINY_VARIANTS)}",
            LORA_NEEDS_WEIGHTS,
            ".lora",
        ),
        (
            f"!has(self.lora) || !has(self.lora.experts) || self.lora.experts == 'both' || "
            f"!(self.model.variant in {_cel_list(v for v, r in DEFAULT_BOUNDARY_RATIO.items() if r is None)})",
            LORA_EXPERT_OF_ONE_MODEL,
            ".lora.experts",
        ),
        (
            f"!has(self.lora) || !has(self.lora.dropout) || self.lora.dropout == 0.0 || {_BACKEND_CEL} == 'torch'",
            LORA_DROPOUT_NEEDS_TORCH,
            ".lora.dropout",
        ),
        (
            f"!has(self.validation) || !has(self.validation.promptSize) || "
            f"!(self.model.variant in {_cel_list(IMAGE_CONDITIONED_VARIANTS)})",
            PROMPTS_NEED_TEXT_TO_VIDEO,
            ".validation.promptSize",
        ),
        (
            f"!(self.model.variant in {_cel_list(v for v, r in DEFAULT_BOUNDARY_RATIO.items() if r is None)}) "
            "|| !has(self.routing) || !has(self.routing.boundaryRatio)",
            "routing.boundaryRatio must be unset for a single-model variant",
            ".routing.boundaryRatio",
        ),
        (
            f"self.model.variant in {_cel_list(v for v, f in DEFAULT_IMAGE_TO_VIDEO_FRACTION.items() if f is not None)}"
            " || !has(self.training.imageToVideoFraction)",
            "training.imageToVideoFraction is only for unified text/image-to-video variants",
            ".training.imageToVideoFraction",
        ),
    )
    model: ModelSpec = Field(description="Which Wan model and where its weights are.")
    routing: RoutingSpec = Field(default_factory=RoutingSpec, description="Timestep sampling and expert routing.")
    data: DataSpec = Field(description="Precomputed-latent dataset.")
    adaptive_load: AdaptiveLoadSpec = Field(
        default_factory=AdaptiveLoadSpec, description="Shape-aware batch sizing and per-step rank balancing."
    )
    kernels: KernelsSpec = Field(default_factory=KernelsSpec, description="Kernel implementations.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="Device mesh and remat.")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="AdamW per expert.")
    lora: LoraSpec | None = Field(
        None,
        description="Train low-rank adapters (fp32, AdamW) on the frozen base weights instead of the full model; "
        "checkpoints hold the adapters, `wanloom export` writes them as LoRA files (or merged, --merge). Unset: "
        "full training.",
    )
    validation: ValidationSpec | None = Field(
        None, description="Held-out validation loss per expert band while training; unset disables it."
    )
    export: ExportSpec | None = Field(
        None,
        description="Export the final checkpoint when the run completes (`wanloom export`); status.exportUri names "
        "it once the TrainingJob has succeeded. Needs training.checkpoint.uri.",
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec, description="Experiment tracking: TensorBoard, Weights & Biases."
    )
    training: TrainingSpec = Field(description="Steps, batch, seed and checkpoints.")
    resources: ResourcesSpec = Field(description="Accelerators, image and scheduling.")
    suspend: bool = Field(False, description="Suspend the job (propagated to the JobSet).")
    max_restarts: int = Field(3, ge=0, le=1000, description="JobSet restarts before failing; preemptions don't count.")
    active_deadline_seconds: int | None = Field(None, ge=1, description="Wall-clock limit of the whole run.")
    ttl_seconds_after_finished: int | None = Field(None, ge=0, description="Delete the JobSet this long after it ends.")
    metrics_port: int = Field(keys.DEFAULT_METRICS_PORT, ge=1024, le=65535, description="Trainer Prometheus port.")

    @property
    def timestep_sampling(self) -> tuple[Literal["uniform", "logit-normal"], float]:
        """(sampling, shift): the spec's where set, else the variant's recipe (``DEFAULT_TIMESTEPS``)."""
        sampling, shift = DEFAULT_TIMESTEPS[self.model.variant]
        r = self.routing
        return r.sampling or sampling, shift if r.shift is None else r.shift

    @property
    def image_to_video_fraction(self) -> float:
        """The effective image-to-video share: the spec's, else the variant's default (0 without the mode)."""
        fraction = self.training.image_to_video_fraction
        if fraction is None:
            fraction = DEFAULT_IMAGE_TO_VIDEO_FRACTION[self.model.variant]
        return fraction or 0.0

    @property
    def caption_dropout(self) -> float:
        """The effective caption dropout: the spec's, else the variant's default."""
        dropout = self.data.caption_dropout
        return DEFAULT_CAPTION_DROPOUT[self.model.variant] if dropout is None else dropout

    @property
    def boundary_ratio(self) -> float | None:
        """The effective boundary: the configured one or the variant's default (None for single-model variants)."""
        if self.routing.boundary_ratio is not None:
            return self.routing.boundary_ratio
        return DEFAULT_BOUNDARY_RATIO[self.model.variant]


class _StatusModel(_Model):
    """Status as the API stores it (times are RFC 3339 strings on the wire); written by the operator only."""

    model_config = ConfigDict(**{**_Model.model_config, "strict": False})


class Condition(_StatusModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    last_transition_time: datetime | None = None
    observed_generation: int | None = None


class ReplicatedJobStatus(_StatusModel):
    name: str
    ready: int = 0
    succeeded: int = 0
    failed: int = 0
    active: int = 0
    suspended: int = 0


class Progress(_StatusModel):
    step: int | None = Field(None, description="Last completed optimizer step.")
    total_steps: int | None = None
    step_time_seconds: float | None = Field(None, description="Latest step time (slowest rank).")
    load_imbalance_cv: float | None = Field(
        None, alias="loadImbalanceCV", description="CV of measured per-rank step times."
    )
    tokens_per_second: float | None = None
    loss: float | None = None
    last_checkpoint_step: int | None = None
    updated_at: datetime | None = None


class TrainingJobStatus(_StatusModel):
    phase: Phase | None = Field(None, description="Lifecycle phase, derived from the JobSet.")
    conditions: list[Condition] = Field(default_factory=list, description="Kubernetes conditions, keyed by type.")
    observed_generation: int | None = Field(None, description="metadata.generation the status reflects.")
    restarts: int = Field(0, description="JobSet restarts so far.")
    created_spec_hash: str | None = Field(
        None,
        description="Spec hash of the JobSet the operator created or adopted last: that JobSet gone (its TTL ran "
        "while the operator was down) means the run is over, not that it is to be started again.",
    )
    replicated_jobs: list[ReplicatedJobStatus] = Field(
        default_factory=list, description="Job counts per replicated job, from the JobSet."
    )
    start_time: datetime | None = Field(None, description="When the JobSet was first running.")
    completion_time: datetime | None = Field(None, description="When the job succeeded or failed.")
    progress: Progress | None = Field(None, description="Training progress read from rank 0's metrics.")
    message: str | None = Field(None, description="Human-readable summary of the latest problem, if any.")
    export_uri: str | None = Field(
        None, description="Where the trained model was exported (spec.export.uri), once the run has succeeded."
    )


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    """Kubernetes label syntax: ``[prefix/]name`` keys and short values (raises ValueError naming the key)."""
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if len(name) > 63 or not _LABEL_NAME.match(name) or len(prefix) > 253:
            raise ValueError(f"label key {key!r}: [prefix/]name, name <= 63 alphanumerics, '-', '_', '.'")
        if prefix and not re.fullmatch(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*", prefix):
            raise ValueError(f"label key {key!r}: its prefix must be a DNS-1123 subdomain")
        if value and (len(value) > 63 or not _LABEL_NAME.match(value)):
            raise ValueError(f"label {key!r} value {value!r}: <= 63 alphanumerics, '-', '_', '.', or empty")
    return labels


def no_reserved_pod_keys(values: dict[str, str]) -> dict[str, str]:
    reserved = sorted(k for k in values if k.startswith(RESERVED_POD_KEY_PREFIXES))
    if reserved:
        raise ValueError(f"{', '.join(map(repr, reserved))}: {RESERVED_POD_KEY}")
    return values


class ObjectMeta(_Model):
    """The parts of metadata the API reads, with its name rules; everything else passes through untouched."""

    model_config = ConfigDict(alias_generator=to_camel, extra="allow", frozen=True, strict=True)
    name: str = Field(
        max_length=253,
        pattern=rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$",
        description="A DNS-1123 subdomain: lowercase letters, digits, '-' and '.', starting and ending alphanumeric.",
    )
    namespace: str | None = Field(None, max_length=63, pattern=rf"^{_DNS_LABEL}$", description="A DNS-1123 label.")
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _label_rules(cls, labels: dict[str, str]) -> dict[str, str]:
        return check_labels(labels)


class TrainingJob(_Model):
    api_version: Literal["wanloom.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["TrainingJob"] = "TrainingJob"
    metadata: ObjectMeta
    spec: TrainingJobSpec
    status: TrainingJobStatus | None = None


PRINTER_COLUMNS: tuple[dict[str, str], ...] = (
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Steps", "type": "integer", "jsonPath": ".spec.training.steps"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss"},
    {"name": "Step time", "type": "number", "jsonPath": ".status.progress.stepTimeSeconds"},
    {"name": "Load CV", "type": "number", "jsonPath": ".status.progress.loadImbalanceCV"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)
