"""The LatentDataset API (wanloom.dev/v1alpha1): a corpus of captioned media encoded into training latents.

The operator runs it in three steps, each a batch Job it owns: **plan** (one pod reads the manifest or listing and
reports the number of work units), **encode** (an Indexed Job: one completion per work unit, ``workers`` at a
time, a unit retried on its own), **finalize** (one pod joins the units' manifests into ``index.json`` and
``skipped.json``). The same file runs on one machine with ``wanloom data build``. A TrainingJob names it in
``spec.data.dataset`` and starts once it is Ready.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from wanloom_api.trainingjob import (
    GROUP,
    QUANTITY_PATTERN,
    VERSION,
    BucketSpec,
    Condition,
    EnvVar,
    ObjectMeta,
    StorageURI,
    Toleration,
    Variant,
    _Model,
    _StatusModel,
    check_labels,
    no_reserved_pod_keys,
)

KIND = "LatentDataset"
PLURAL = "latentdatasets"
SINGULAR = "latentdataset"
SHORT_NAMES = ("lds",)
API_VERSION = f"{GROUP}/{VERSION}"

ONE_SOURCE = "set exactly one of source.manifest or source.prefix"
ONE_ACCELERATOR = "exactly one of cpu, gpu or tpu must be set"
TPU_NEEDS_JAX_ENCODERS = "tpu hosts run the JAX encoders: encoders.backend must be jax or auto"
SINGLE_HOST_TPU = "an encoding pod is one TPU host: topology 1x1x1 (one chip) or 2x2x1 (four chips)"
SINGLE_HOST_TOPOLOGIES = ("1x1x1", "2x2x1")
STORAGE_DTYPE = Literal["bfloat16", "float16", "float32"]


class DatasetPhase(StrEnum):
    PENDING = "Pending"  # valid, nothing created yet (or suspended before planning)
    PLANNING = "Planning"  # the plan pod counts the inputs
    ENCODING = "Encoding"  # the Indexed Job encodes work units
    FINALIZING = "Finalizing"  # the finalize pod writes index.json
    READY = "Ready"  # index.json is written: training may read it
    SUSPENDED = "Suspended"
    FAILED = "Failed"
    INVALID = "Invalid"


DATASET_TERMINAL_PHASES = frozenset({DatasetPhase.READY, DatasetPhase.FAILED})


class DatasetSource(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = (("has(self.manifest) != has(self.prefix)", ONE_SOURCE),)
    manifest: StorageURI | None = Field(
        None,
        min_length=1,
        description="A JSONL, CSV or Parquet manifest (gs:// or a path), one row per sample: path (gs:// or relative "
        "to the manifest), caption or caption_path, optional start/end seconds and id. Row order fixes each "
        "sample's ordinal.",
    )
    prefix: StorageURI | None = Field(
        None,
        min_length=1,
        description="A gs:// prefix or folder of images and videos, each with a same-stem .txt caption (sorted).",
    )

    @property
    def uri(self) -> str:
        return self.manifest or self.prefix or ""


class EncodersSpec(_Model):
    variant: Variant = Field(description="The Wan variant the latents are for (channels, strides, text length).")
    weights: StorageURI = Field(
        min_length=1,
        description="Diffusers-layout model root (gs:// or a path) with vae/, text_encoder/ and tokenizer/.",
    )
    batch_size: int = Field(4, ge=1, le=256, description="Sources per VAE and text-encoder call.")
    backend: Literal["auto", "jax", "torch"] = Field(
        "auto",
        description="The encoders' implementation: torch (diffusers, transformers), jax, or auto: torch where the "
        "image has it (the GPU image), else jax (the TPU image). Both give the same latents within float error.",
    )
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="Encoder compute dtype; defaults to bfloat16 on gpu and float32 on cpu."
    )


class DatasetCPU(_Model):
    cpu: str = Field("2", pattern=QUANTITY_PATTERN, max_length=32, description="CPU request (and limit) per pod.")
    memory: str = Field("8Gi", pattern=QUANTITY_PATTERN, max_length=32, description="Memory request per pod.")


class DatasetGPU(_Model):
    type: Literal["h100", "h200", "b200", "other"] = Field(description="GPU model; sets the node selector.")
    per_pod: int = Field(
        1,
        ge=1,
        le=8,
        description="GPUs per encoding pod: one encoder replica per GPU, each batch split across them (set "
        "encoders.batchSize to at least this, or some GPUs idle).",
    )
    accelerator_label: str | None = Field(
        None, description="Value for cloud.google.com/gke-accelerator; defaults per type (none with 'other')."
    )
    cpu: str | None = Field(
        None, pattern=QUANTITY_PATTERN, max_length=32, description="CPU request per pod (decoding); default 8 per GPU."
    )
    memory: str | None = Field(
        None, pattern=QUANTITY_PATTERN, max_length=32, description="Memory request per pod; default 64Gi per GPU."
    )


class DatasetTPU(_Model):
    type: Literal["tpu7x"] = Field("tpu7x", description="TPU generation (Ironwood).")
    topology: Literal["1x1x1", "2x2x1"] = Field("2x2x1", description=SINGLE_HOST_TPU)


class DatasetResources(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("[has(self.cpu), has(self.gpu), has(self.tpu)].filter(x, x).size() == 1", ONE_ACCELERATOR),
    )
    cpu: DatasetCPU | None = Field(None, description="CPU pods: the tiny encoders, small corpora, smoke tests.")
    gpu: DatasetGPU | None = Field(None, description="NVIDIA GPU pods (bf16 VAE and umT5).")
    tpu: DatasetTPU | None = Field(None, description="TPU hosts, one per pod (the JAX encoders, batch over its chips).")
    image: str | None = Field(
        None, description="Encoder image; defaults to the operator's trainer image for the accelerator (TPU: jax)."
    )
    service_account_name: str | None = Field(None, description="Pod service account (reads source, writes output).")
    queue_name: str | None = Field(None, description="Kueue LocalQueue for the encoding pods.")
    priority_class_name: str | None = Field(None, description="Pod priority class.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Added to the rendered node selector.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Added to the rendered tolerations.")
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="Extra environment of every pod.")
    pod_labels: dict[str, str] = Field(default_factory=dict, max_length=64, description="Labels added to every pod.")

    @field_validator("pod_labels")
    @classmethod
    def _pod_label_rules(cls, labels: dict[str, str]) -> dict[str, str]:
        return check_labels(no_reserved_pod_keys(labels))

    @property
    def accelerator(self) -> Literal["cpu", "gpu", "tpu"]:
        return "gpu" if self.gpu else "tpu" if self.tpu else "cpu"


class LatentDatasetSpec(_Model):
    cel_rules: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("!has(self.resources.tpu) || self.encoders.backend != 'torch'", TPU_NEEDS_JAX_ENCODERS, ".encoders.backend"),
    )
    source: DatasetSource = Field(description="Where the media and captions are.")
    output: StorageURI = Field(
        min_length=1, description="Dataset root (gs://bucket/prefix or a path) the shards and index.json go to."
    )
    encoders: EncodersSpec = Field(description="The VAE and text encoder the latents are made with.")
    buckets: list[BucketSpec] = Field(
        min_length=1, max_length=64, description="Pixel buckets (frames, height, width) media are resized into."
    )
    fps: float = Field(16.0, gt=0.0, le=240.0, description="Frame rate clips are resampled to.")
    dtype: STORAGE_DTYPE = Field("bfloat16", description="Storage dtype of the latents and text embeddings.")
    samples_per_shard: int = Field(
        256, ge=1, le=100_000, description="Inputs per shard: one work unit, the unit of retry and resumption."
    )
    workers: int = Field(1, ge=1, le=4096, description="Encoding pods at a time (the Indexed Job's parallelism).")
    max_bad_samples: int = Field(
        100, ge=0, description="Inputs skipped (corrupt, missing, uncaptioned, too short) before the dataset fails."
    )
    backoff_limit_per_index: int = Field(
        3, ge=0, le=100, description="Retries of one work unit after failures (evictions and preemptions are free)."
    )
    storage_outage_seconds: int = Field(
        600,
        ge=0,
        le=86_400,
        description="How long the corpus or output storage may stay unreachable (a pod waits with backoff and redoes "
        "the unit, skipping nothing) before the pod fails.",
    )
    resources: DatasetResources = Field(description="Where the encoding pods run.")
    suspend: bool = Field(False, description="Stop the encoding pods (finished units are kept) until set false.")


class LatentDatasetStatus(_StatusModel):
    phase: DatasetPhase | None = Field(None, description="Plan, encode, finalize, then Ready (or Failed).")
    conditions: list[Condition] = Field(default_factory=list, description="Kubernetes conditions, keyed by type.")
    observed_generation: int | None = None
    inputs: int | None = Field(None, description="Inputs in the manifest or listing.")
    shards_total: int | None = Field(None, description="Work units (shards) the inputs make.")
    shards_done: int | None = Field(None, description="Work units written.")
    samples_encoded: int | None = Field(None, description="Samples in index.json (once Ready).")
    skipped: dict[str, int] = Field(default_factory=dict, description="Inputs skipped, by reason (once finalized).")
    inputs_per_second: float | None = Field(None, description="Inputs encoded per second since encoding started.")
    output_uri: str | None = Field(None, description="Where the dataset is (once Ready): what a TrainingJob reads.")
    start_time: datetime | None = None
    completion_time: datetime | None = None
    message: str | None = Field(None, description="The latest problem, or what is being waited for.")


class LatentDataset(_Model):
    api_version: Literal["wanloom.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["LatentDataset"] = "LatentDataset"
    metadata: ObjectMeta
    spec: LatentDatasetSpec
    status: LatentDatasetStatus | None = None


PRINTER_COLUMNS: tuple[dict[str, str | int], ...] = (
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Shards", "type": "integer", "jsonPath": ".status.shardsDone"},
    {"name": "Of", "type": "integer", "jsonPath": ".status.shardsTotal"},
    {"name": "Samples", "type": "integer", "jsonPath": ".status.samplesEncoded"},
    {"name": "Inputs/s", "type": "number", "jsonPath": ".status.inputsPerSecond"},
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)
