"""Validation of TrainingJob manifests: every problem at once, each naming its field path, the bad value and what is
valid.

Schema errors come from pydantic; rules that span fields are the ``_check_*`` functions below, run once the
types are right. The CLI, the operator and the tests all call :func:`validate_trainingjob`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from wanloom_api import keys
from wanloom_api.latentdataset import KIND as LATENTDATASET_KIND
from wanloom_api.latentdataset import ONE_ACCELERATOR, ONE_SOURCE, TPU_NEEDS_JAX_ENCODERS, LatentDataset
from wanloom_api.topology import GPUS_PER_NODE, tpu7x_slice
from wanloom_api.trainingjob import (
    BATCH_WITHIN_EPOCH,
    COMPILE_NEEDS_TORCH,
    DATA_URI_OR_DATASET,
    DEFAULT_BOUNDARY_RATIO,
    DEFAULT_IMAGE_TO_VIDEO_FRACTION,
    DUPLICATE_VOLUME,
    EXPORT_EMA_NEEDS_EMA,
    EXPORT_MERGE_NEEDS_LORA,
    EXPORT_NEEDS_CHECKPOINTS,
    FRAMES_4K_PLUS_1,
    GCS_URI_PATTERN,
    GLOBAL_BATCH_PER_RANK,
    GPU_NEEDS_TORCH,
    IMAGE_CONDITIONED_VARIANTS,
    LORA_DROPOUT_NEEDS_TORCH,
    LORA_EXPERT_OF_ONE_MODEL,
    LORA_NEEDS_WEIGHTS,
    MOUNT_NEEDS_NAME_AND_PATH,
    MOUNT_OF_NO_VOLUME,
    MULTIPLE_OF_16,
    PARALLELISM_PRODUCT,
    PROMPTS_NEED_TEXT_TO_VIDEO,
    RESERVED_MOUNT_PATH,
    RESERVED_VOLUME,
    SEQUENCE_GEOMETRY,
    SPLASH_NEEDS_TPU,
    STORAGE_URI,
    TINY_VARIANTS,
    TORCH_ATTENTION,
    URI_SCHEME_PATTERN,
    VOLUME_NEEDS_NAME,
    WARMUP_WITHIN_STEPS,
    XLA_ATTENTION,
    TrainingJob,
    TrainingJobSpec,
    tokens_per_sample,
)


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class Validated:
    """The outcome of validating one manifest: the typed object (a TrainingJob or a LatentDataset), or the errors
    (never both)."""

    job: TrainingJob | LatentDataset | None
    errors: tuple[FieldError, ...]

    @property
    def ok(self) -> bool:
        return self.job is not None


class InvalidTrainingJob(ValueError):
    def __init__(self, errors: tuple[FieldError, ...], source: str = "TrainingJob") -> None:
        self.errors = errors
        super().__init__(f"{source} is invalid:\n" + "\n".join(f"  {e}" for e in errors))


def validate_trainingjob(doc: Any) -> Validated:
    """Validate one TrainingJob object (a parsed YAML/JSON document)."""
    if not isinstance(doc, dict):
        return Validated(None, (FieldError("<root>", f"expected a mapping (a TrainingJob), got {type(doc).__name__}"),))
    try:
        job = TrainingJob.model_validate(doc)
    except ValidationError as exc:
        return Validated(None, tuple(_from_pydantic(exc)))
    errors = tuple(error for check in _CHECKS for error in check(job.spec))
    return Validated(None, errors) if errors else Validated(job, ())


def parse_trainingjob(doc: Any, source: str = "TrainingJob") -> TrainingJob:
    """Validate and return the typed job, or raise :class:`InvalidTrainingJob` listing every error."""
    result = validate_trainingjob(doc)
    if not isinstance(result.job, TrainingJob):
        raise InvalidTrainingJob(result.errors, source)
    return result.job


def with_spec(job: TrainingJob, source: str = "TrainingJob", **changes: Any) -> TrainingJob:
    """``job`` with ``changes`` (camelCase spec fields, nested mappings merged key by key) validated again."""

    def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in update.items():
            both = isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = merge(out[key], value) if both else value
        return out

    doc = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["spec"] = merge(doc["spec"], changes)
    return parse_trainingjob(doc, source)


def load_trainingjob_file(path: str | Path) -> TrainingJob:
    """Read one TrainingJob from a YAML file; errors name the file and the field paths."""
    results = validate_file(path)
    if len(results) != 1:
        raise InvalidTrainingJob((FieldError("<file>", f"expected one TrainingJob, found {len(results)}"),), str(path))
    result = results[0]
    if result.job is None:
        raise InvalidTrainingJob(result.errors, str(path))
    if not isinstance(result.job, TrainingJob):
        raise InvalidTrainingJob((FieldError("kind", f"expected a TrainingJob, got {result.job.kind}"),), str(path))
    return result.job


def load_latentdataset_file(path: str | Path) -> LatentDataset:
    """Read one LatentDataset from a YAML file; errors name the file and the field paths."""
    results = validate_file(path)
    if len(results) != 1:
        raise InvalidTrainingJob(
            (FieldError("<file>", f"expected one LatentDataset, found {len(results)}"),), str(path)
        )
    result = results[0]
    if result.job is None:
        raise InvalidTrainingJob(result.errors, str(path))
    if not isinstance(result.job, LatentDataset):
        raise InvalidTrainingJob((FieldError("kind", f"expected a LatentDataset, got {result.job.kind}"),), str(path))
    return result.job


def validate_document(doc: Any) -> Validated:
    """Validate a TrainingJob or a LatentDataset, by its ``kind``."""
    if isinstance(doc, dict) and doc.get("kind") == LATENTDATASET_KIND:
        return validate_latentdataset(doc)
    return validate_trainingjob(doc)


def validate_latentdataset(doc: Any) -> Validated:
    """Validate one LatentDataset object: its schema, its URIs and its buckets against its variant."""
    try:
        dataset = LatentDataset.model_validate(doc)
    except ValidationError as exc:
        return Validated(None, tuple(_from_pydantic(exc)))
    errors = tuple(_check_dataset(dataset))
    return Validated(None, errors) if errors else Validated(dataset, ())


def _check_dataset(dataset: LatentDataset) -> Iterator[FieldError]:
    spec = dataset.spec
    uris = {
        "spec.source.manifest": spec.source.manifest,
        "spec.source.prefix": spec.source.prefix,
        "spec.output": spec.output,
        "spec.encoders.weights": spec.encoders.weights,
    }
    yield from _bad_uris(uris)
    if (spec.source.manifest is None) == (spec.source.prefix is None):
        yield FieldError("spec.source", ONE_SOURCE)
    resources = spec.resources
    if [resources.cpu, resources.gpu, resources.tpu].count(None) != 2:
        yield FieldError("spec.resources", ONE_ACCELERATOR)
    if resources.tpu is not None and spec.encoders.backend == "torch":
        yield FieldError("spec.encoders.backend", TPU_NEEDS_JAX_ENCODERS)
    for i, bucket in enumerate(spec.buckets):
        path = f"spec.buckets[{i}]"
        if (bucket.frames - 1) % 4:
            yield FieldError(f"{path}.frames", f"{FRAMES_4K_PLUS_1} (got {bucket.frames})")
        for name in ("height", "width"):
            if getattr(bucket, name) % 16:
                yield FieldError(f"{path}.{name}", f"{MULTIPLE_OF_16} (got {getattr(bucket, name)})")
    if len({b.pixels for b in spec.buckets}) != len(spec.buckets):
        yield FieldError("spec.buckets", "a bucket is listed twice")


def validate_file(path: str | Path) -> list[Validated]:
    """Validate every YAML document of a file (empty documents are ignored)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        return [Validated(None, (FieldError("<file>", f"cannot read {path}: {exc.strerror}"),))]
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start : exc.start + 1]
        message = f"{path} is not UTF-8 text (byte {exc.start} is {bad!r}); save it as UTF-8 YAML"
        return [Validated(None, (FieldError("<file>", message),))]
    try:
        docs = [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        return [Validated(None, (FieldError("<file>", f"not valid YAML{at}: {getattr(exc, 'problem', exc)}"),))]
    if not docs:
        return [Validated(None, (FieldError("<file>", "holds no YAML document"),))]
    return [validate_document(d) for d in docs]


class _StrictLoader(yaml.SafeLoader):
    """YAML as the API server reads it: a key given twice in one mapping is an error, not "the last one wins"."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"key {key!r} appears twice", key_node.start_mark
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _loc_to_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "<root>"


def _from_pydantic(exc: ValidationError) -> Iterator[FieldError]:
    for err in exc.errors(include_url=False):
        path = _loc_to_path(err["loc"])
        if err["type"] == "missing":
            yield FieldError(path, "required field is missing")
        elif err["type"] == "extra_forbidden":
            yield FieldError(path, "unknown field (check the spelling; see docs/trainingjob.md)")
        else:
            yield FieldError(path, f"{err['msg']} (got {_show(err.get('input'))})")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_variant_fields(spec: TrainingJobSpec) -> Iterator[FieldError]:
    if DEFAULT_BOUNDARY_RATIO[spec.model.variant] is None and spec.routing.boundary_ratio is not None:
        yield FieldError(
            "spec.routing.boundaryRatio",
            f"{spec.model.variant} is a single model with no expert boundary; remove boundaryRatio "
            f"(got {spec.routing.boundary_ratio})",
        )
    fraction = spec.training.image_to_video_fraction
    if DEFAULT_IMAGE_TO_VIDEO_FRACTION[spec.model.variant] is None and fraction is not None:
        unified = ", ".join(v for v, f in DEFAULT_IMAGE_TO_VIDEO_FRACTION.items() if f is not None)
        yield FieldError(
            "spec.training.imageToVideoFraction",
            f"{spec.model.variant} has no image-to-video mode of its own (only {unified} do); remove "
            f"imageToVideoFraction (got {fraction})",
        )


def _check_resources(spec: TrainingJobSpec) -> Iterator[FieldError]:
    res = spec.resources
    chosen = [name for name in ("tpu", "gpu", "cpu") if getattr(res, name) is not None]
    if len(chosen) != 1:
        got = ", ".join(chosen) if chosen else "none"
        yield FieldError("spec.resources", f"set exactly one of tpu, gpu or cpu (got {got})")
        return
    if res.tpu is not None:
        try:
            tpu7x_slice(res.tpu.topology)
        except ValueError as exc:
            yield FieldError("spec.resources.tpu.topology", str(exc))
        if res.backend == "torch":
            yield FieldError("spec.resources.backend", "tpu runs the jax backend only (got 'torch')")
    if res.gpu is not None and res.backend == "jax":
        yield FieldError("spec.resources.backend", f"{GPU_NEEDS_TORCH} (got 'jax')")
    if res.cpu is not None and res.resolved_backend == "torch" and res.cpu.devices_per_node > 1:
        yield FieldError(
            "spec.resources.cpu.devicesPerNode",
            f"the torch backend runs one process per device; use nodes for more processes "
            f"(got devicesPerNode {res.cpu.devices_per_node})",
        )
    if res.gpu is not None and res.gpu.type in GPUS_PER_NODE:
        per_node = GPUS_PER_NODE[res.gpu.type]
        if per_node % res.gpu.per_node:
            yield FieldError(
                "spec.resources.gpu.perNode",
                f"{res.gpu.type} nodes have {per_node} GPUs; perNode must divide {per_node} (got {res.gpu.per_node})",
            )


def device_count(spec: TrainingJobSpec) -> int | None:
    """Accelerator devices of the whole job (JAX devices on TPU: two per v7x chip), or None if unknown."""
    res = spec.resources
    if res.tpu is not None:
        try:
            return tpu7x_slice(res.tpu.topology).devices * res.tpu.slices
        except ValueError:
            return None
    if res.gpu is not None:
        return res.gpu.per_node * res.gpu.nodes
    if res.cpu is not None:
        return res.cpu.nodes * res.cpu.devices_per_node
    return None


def resolve_parallelism(degrees: dict[str, int], devices: int) -> dict[str, int]:
    """Fill the one ``-1`` degree so the product equals ``devices``.

    Raises:
        ValueError: when the degrees cannot multiply to ``devices``; the message names the degrees and the count.
    """
    auto = [k for k, v in degrees.items() if v == -1]
    if len(auto) > 1:
        raise ValueError(f"at most one degree may be -1, got -1 for {', '.join(auto)}")
    if any(v == 0 for v in degrees.values()):
        raise ValueError(f"degrees must be >= 1 or -1, got {degrees}")
    fixed = math.prod(v for v in degrees.values() if v != -1)
    shown = " x ".join(f"{k}={v}" for k, v in degrees.items())
    if auto:
        if devices % fixed:
            raise ValueError(f"{shown}: the fixed degrees multiply to {fixed}, which does not divide {devices} devices")
        return {k: (devices // fixed if v == -1 else v) for k, v in degrees.items()}
    if fixed != devices:
        raise ValueError(f"{shown} = {fixed}, but the job has {devices} devices; the product must equal it")
    return dict(degrees)


def _check_parallelism(spec: TrainingJobSpec) -> Iterator[FieldError]:
    devices = device_count(spec)
    if devices is None:
        return
    try:
        resolved = resolve_parallelism(spec.parallelism.degrees(), devices)
    except ValueError as exc:
        yield FieldError("spec.parallelism", f"{PARALLELISM_PRODUCT}: {exc}")
        return
    ranks = resolved["data"] * resolved["fsdp"]
    if spec.training.global_batch < ranks:
        yield FieldError(
            "spec.training.globalBatch",
            f"{GLOBAL_BATCH_PER_RANK}: {spec.training.global_batch} samples cannot feed {ranks} ranks; "
            f"use at least {ranks}",
        )


def _check_sequence_split(spec: TrainingJobSpec) -> Iterator[FieldError]:
    """What the resolved context and tensor degrees split must divide (``SEQUENCE_GEOMETRY``): the attention heads,
    and, wherever a micro-batch holds whole samples (all but the JAX trainer's packed rows, which it pads to the
    multiple itself), every configured bucket's tokens per sample. Buckets derived from the data are cut to such
    sizes by the planner."""
    devices = device_count(spec)
    try:
        resolved = resolve_parallelism(spec.parallelism.degrees(), devices) if devices else None
    except ValueError:
        resolved = None  # _check_parallelism names the problem
    if resolved is None:
        return
    variant, backend = spec.model.variant, spec.resources.resolved_backend
    heads, _ = SEQUENCE_GEOMETRY[variant]
    # Ulysses (torch) exchanges heads for sequence; tensor parallelism (JAX) splits the heads.
    head_split = ("context", resolved["context"]) if backend == "torch" else ("tensor", resolved["tensor"])
    if heads % head_split[1]:
        yield FieldError(
            f"spec.parallelism.{head_split[0]}",
            f"{head_split[1]} must divide the {heads} attention heads of {variant}, which it splits (got "
            f"{head_split[1]}; use one of {', '.join(str(d) for d in range(2, heads + 1) if heads % d == 0)})",
        )
    multiple = resolved["context"] * resolved["tensor"]
    al = spec.adaptive_load
    packed = backend == "jax" and al.enabled and al.scheduler == "balanced"
    if multiple == 1 or packed:
        return
    for i, bucket in enumerate(al.buckets or ()):
        tokens = tokens_per_sample(variant, *bucket.pixels)
        if tokens % multiple:
            fits = _divisible_size(variant, bucket, multiple)
            yield FieldError(
                f"spec.adaptiveLoad.buckets[{i}]",
                f"{bucket.frames}x{bucket.height}x{bucket.width} is {tokens:,} tokens per sample, which context x "
                f"tensor = {multiple} does not divide (each sample's sequence is split over those ranks); use a "
                f"size whose token count is a multiple of {multiple}, e.g. {fits}",
            )


def _divisible_size(variant: str, bucket: Any, multiple: int) -> str:
    """The largest F×H'×W' crop of ``bucket`` (H' ≤ H, W' ≤ W) whose token count ``multiple`` divides."""
    _, (_, fh, fw) = SEQUENCE_GEOMETRY[variant]
    best = (0, bucket.height, bucket.width)
    for h in range(bucket.height, max(fh, bucket.height - multiple * fh) - 1, -fh):
        for w in range(bucket.width, max(fw, bucket.width - multiple * fw) - 1, -fw):
            tokens = tokens_per_sample(variant, bucket.frames, h, w)
            if tokens % multiple == 0 and tokens > best[0]:
                best = (tokens, h, w)
    return f"{bucket.frames}x{best[1]}x{best[2]}" if best[0] else f"a larger {bucket.frames}-frame size"


def _check_volumes(spec: TrainingJobSpec) -> Iterator[FieldError]:
    """The user's volumes and mounts beside the operator's own (keys.OPERATOR_VOLUMES): the same rules as the
    CRD's CEL, with each error at its item."""
    res, reserved = spec.resources, keys.OPERATOR_VOLUMES
    names: set[str] = set()
    for i, volume in enumerate(res.volumes):
        name, path = volume.get("name"), f"spec.resources.volumes[{i}].name"
        if not isinstance(name, str) or not name:
            yield FieldError(path, VOLUME_NEEDS_NAME)
        elif name in reserved:
            yield FieldError(path, f"{RESERVED_VOLUME} (got {name!r})")
        elif name in names:
            yield FieldError(path, f"{DUPLICATE_VOLUME} (got {name!r} twice)")
        if isinstance(name, str):
            names.add(name)
    for i, mount in enumerate(res.volume_mounts):
        name, mount_path, path = mount.get("name"), mount.get("mountPath"), f"spec.resources.volumeMounts[{i}]"
        if not isinstance(name, str) or not isinstance(mount_path, str):
            yield FieldError(path, MOUNT_NEEDS_NAME_AND_PATH)
            continue
        if name not in names or name in reserved:
            yield FieldError(f"{path}.name", f"{MOUNT_OF_NO_VOLUME} (got {name!r})")
        if (mount_path.rstrip("/") or "/") in reserved.values():
            yield FieldError(f"{path}.mountPath", f"{RESERVED_MOUNT_PATH} (got {mount_path!r})")


def _check_kernels(spec: TrainingJobSpec) -> Iterator[FieldError]:
    attention, backend, accel = spec.kernels.attention, spec.resources.resolved_backend, spec.resources.accelerator
    if attention == "splash" and accel != "tpu":
        yield FieldError("spec.kernels.attention", f"{SPLASH_NEEDS_TPU} (got {accel})")
    if attention in ("sdpa", "flash") and backend != "torch":
        yield FieldError("spec.kernels.attention", f"{TORCH_ATTENTION} (got {attention} on {backend})")
    if attention == "xla" and backend != "jax":
        yield FieldError("spec.kernels.attention", f"{XLA_ATTENTION} (got the {backend} backend)")
    if spec.kernels.compile == "blocks" and backend != "torch":
        yield FieldError("spec.kernels.compile", f"{COMPILE_NEEDS_TORCH} (got the {backend} backend)")


def _check_uris(spec: TrainingJobSpec) -> Iterator[FieldError]:
    uris = {
        "spec.model.weights": spec.model.weights,
        "spec.data.uri": spec.data.uri,
        "spec.data.index": spec.data.index,
        "spec.training.checkpoint.uri": spec.training.checkpoint.uri,
        "spec.adaptiveLoad.benchFile": spec.adaptive_load.bench_file,
        "spec.export.uri": spec.export.uri if spec.export is not None else None,
        "spec.tracking.tensorboardUri": spec.tracking.tensorboard_uri,
        "spec.validation.vae": spec.validation.vae if spec.validation is not None else None,
    }
    yield from _bad_uris(uris)


def _bad_uris(uris: dict[str, str | None]) -> Iterator[FieldError]:
    for path, uri in uris.items():
        if uri is None:
            continue
        if re.match(URI_SCHEME_PATTERN, uri) and not re.match(GCS_URI_PATTERN, uri):
            yield FieldError(path, f"{STORAGE_URI} (got {uri!r})")


def _check_lora(spec: TrainingJobSpec) -> Iterator[FieldError]:
    lora = spec.lora
    if lora is None:
        return
    if spec.model.weights is None and spec.model.variant not in TINY_VARIANTS:
        yield FieldError("spec.lora", f"{LORA_NEEDS_WEIGHTS} (got variant {spec.model.variant} without weights)")
    if lora.experts != "both" and DEFAULT_BOUNDARY_RATIO[spec.model.variant] is None:
        yield FieldError("spec.lora.experts", f"{LORA_EXPERT_OF_ONE_MODEL} (got {lora.experts!r})")
    if lora.dropout > 0 and spec.resources.resolved_backend != "torch":
        yield FieldError("spec.lora.dropout", f"{LORA_DROPOUT_NEEDS_TORCH} (got {lora.dropout})")
    repeated = sorted({t for t in lora.targets if lora.targets.count(t) > 1})
    if repeated:
        yield FieldError("spec.lora.targets", f"lora.targets must be unique (got {', '.join(repeated)} twice)")


def _check_training(spec: TrainingJobSpec) -> Iterator[FieldError]:
    if spec.export is not None and spec.training.checkpoint.uri is None:
        yield FieldError("spec.export", EXPORT_NEEDS_CHECKPOINTS)
    if spec.export is not None and spec.export.ema and spec.optimizer.ema is None:
        yield FieldError("spec.export.ema", EXPORT_EMA_NEEDS_EMA)
    if spec.export is not None and spec.export.merge and (spec.lora is None or spec.model.weights is None):
        yield FieldError("spec.export.merge", EXPORT_MERGE_NEEDS_LORA)
    if spec.validation is not None and spec.validation.videos > spec.validation.samples:
        yield FieldError(
            "spec.validation.videos",
            f"videos are generated from held-out samples: at most samples ({spec.validation.videos} > "
            f"{spec.validation.samples})",
        )
    prompt_size = spec.validation.prompt_size if spec.validation is not None else None
    if prompt_size is not None and spec.model.variant in IMAGE_CONDITIONED_VARIANTS:
        yield FieldError("spec.validation.promptSize", PROMPTS_NEED_TEXT_TO_VIDEO)
    buckets = [(f"spec.adaptiveLoad.buckets[{i}]", b) for i, b in enumerate(spec.adaptive_load.buckets or ())]
    if prompt_size is not None:
        buckets.append(("spec.validation.promptSize", prompt_size))
    for path, bucket in buckets:
        if (bucket.frames - 1) % 4:
            yield FieldError(f"{path}.frames", f"{FRAMES_4K_PLUS_1} (got {bucket.frames})")
        for name in ("height", "width"):
            if getattr(bucket, name) % 16:
                yield FieldError(f"{path}.{name}", f"{MULTIPLE_OF_16} (got {getattr(bucket, name)})")
    if (spec.data.uri is None) == (spec.data.dataset is None):
        yield FieldError("spec.data", DATA_URI_OR_DATASET)
    if spec.data.synthetic is not None and spec.data.dataset is not None:
        yield FieldError("spec.data.synthetic", "synthetic data is generated at data.uri; a dataset is prepared")
    if spec.data.synthetic is not None:
        held_out = spec.validation.samples if spec.validation is not None else 0
        trained = spec.data.synthetic.samples - held_out
        if spec.training.global_batch > trained:
            yield FieldError(
                "spec.training.globalBatch",
                f"{BATCH_WITHIN_EPOCH} ({spec.training.global_batch:,} > {trained:,})",
            )
    if spec.optimizer.warmup_steps > spec.training.steps:
        yield FieldError(
            "spec.optimizer.warmupSteps",
            f"{WARMUP_WITHIN_STEPS} ({spec.optimizer.warmup_steps} > {spec.training.steps})",
        )


_CHECKS: tuple[Callable[[TrainingJobSpec], Iterator[FieldError]], ...] = (
    _check_variant_fields,
    _check_resources,
    _check_parallelism,
    _check_sequence_split,
    _check_volumes,
    _check_kernels,
    _check_uris,
    _check_lora,
    _check_training,
)
