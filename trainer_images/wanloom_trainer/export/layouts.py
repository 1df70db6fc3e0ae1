"""Write a checkpoint's experts in the two layouts the Wan ecosystem loads.

``diffusers``: the official Wan 2.2 diffusers repositories' transformer folders, ``transformer/`` (the high-noise
expert; the only model of a single-model variant) and ``transformer_2/`` (low-noise), each with ``config.json``
and ``diffusion_pytorch_model.safetensors`` or, past ``max_shard_bytes``, numbered shards
(``diffusion_pytorch_model-00001-of-00003.safetensors``) and their ``.index.json``: what ``from_pretrained`` and
the Wan pipelines (``WanPipeline(transformer=..., transformer_2=...)``) read.

``wan``: one safetensors file per expert in the original Wan key names (``export.wan_keys``), named
``<name>_high_noise.safetensors`` / ``<name>_low_noise.safetensors`` (single-model: ``<name>.safetensors``): what
ComfyUI's diffusion-model loader, DiffSynth-Studio and diffusers' ``from_single_file`` read.

A LoRA job's checkpoint holds adapters: they are written as LoRA files in either layout, or merged into the base
weights and written as above (``export.lora``).

Output goes to a local folder or, through a local staging folder one file at a time, to ``gs://``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from wanloom_api.metrics import EXPERT_LABELS
from wanloom_api.trainingjob import LoraSpec
from wanloom_trainer.checkpoint.gcs import GcsLocation, bucket_of
from wanloom_trainer.config.variants import EXPERT_SUBFOLDERS, WanVariant
from wanloom_trainer.export.lora import MergedTensors, base_weights, is_lora, write_lora_files
from wanloom_trainer.export.safetensors_out import DTYPES, TensorEntry, write_safetensors
from wanloom_trainer.export.sources import CheckpointTensors
from wanloom_trainer.export.wan_keys import wan_key

Format = Literal["diffusers", "wan"]
FORMATS: tuple[str, ...] = ("diffusers", "wan")
WEIGHTS_NAME = "diffusion_pytorch_model"
# The diffusers release whose WanTransformer3DModel config and file names this layout follows.
DIFFUSERS_VERSION = "0.42.1"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the official repositories' shards are just under 5 GB


@dataclass(frozen=True)
class Exported:
    """What an export wrote: the destination and the files under it (relative paths), per expert."""

    out: str
    step: int
    files: dict[str, list[str]]


def diffusers_config(variant: WanVariant) -> dict[str, object]:
    """``config.json`` of one expert's transformer folder."""
    return {
        "_class_name": "WanTransformer3DModel",
        "_diffusers_version": DIFFUSERS_VERSION,
        **variant.diffusers_config(),
    }


def shard_entries(entries: list[TensorEntry], dtype: str, max_shard_bytes: int) -> list[list[TensorEntry]]:
    """Consecutive groups of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = entry.nbytes(dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: valid: {', '.join(DTYPES)}")


class _Destination:
    """A local folder, or a staging folder whose files are uploaded to ``gs://`` (and removed) as they complete."""

    def __init__(self, out: str, staging: Path | None) -> None:
        self.out = out
        self.local = staging if staging is not None else Path(out)
        self.gcs = GcsLocation.parse(out) if staging is not None else None

    def path(self, relative: str) -> Path:
        path = self.local / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def done(self, relative: str) -> None:
        if self.gcs is None:
            return
        path = self.local / relative
        bucket_of(self.gcs).blob(self.gcs.key(relative)).upload_from_filename(str(path))
        path.unlink()


@contextmanager
def _destination(out: str) -> Iterator[_Destination]:
    if not out.startswith("gs://"):
        yield _Destination(out, None)
        return
    staging = Path(tempfile.mkdtemp(prefix="wanloom-export-"))
    try:
        yield _Destination(out, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_diffusers(
    source: CheckpointTensors, expert: int, variant: WanVariant, dest: _Destination, dtype: str, max_shard_bytes: int
) -> list[str]:
    folder = EXPERT_SUBFOLDERS[expert]
    config = f"{folder}/config.json"
    dest.path(config).write_text(json.dumps(diffusers_config(variant), indent=2) + "\n")
    dest.done(config)
    shards = shard_entries(source.entries(expert), dtype, max_shard_bytes)
    names = (
        [f"{WEIGHTS_NAME}.safetensors"]
        if len(shards) == 1
        else [f"{WEIGHTS_NAME}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    written, total = [config], 0
    for name, shard in zip(names, shards, strict=True):
        relative = f"{folder}/{name}"
        total += write_safetensors(
            dest.path(relative), shard, lambda key: source.read(expert, key), dtype=dtype, metadata={"format": "pt"}
        )
        dest.done(relative)
        written.append(relative)
    if len(shards) > 1:
        index = f"{folder}/{WEIGHTS_NAME}.safetensors.index.json"
        weight_map = {entry.key: name for name, shard in zip(names, shards, strict=True) for entry in shard}
        dest.path(index).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        dest.done(index)
        written.append(index)
    return written


def wan_file_name(name: str, expert: int, experts: int) -> str:
    """``<name>_high_noise.safetensors`` / ``<name>_low_noise.safetensors``; ``<name>.safetensors`` for one model."""
    return f"{name}_{EXPERT_LABELS[expert]}.safetensors" if experts > 1 else f"{name}.safetensors"


def _write_wan(source: CheckpointTensors, expert: int, name: str, dest: _Destination, dtype: str) -> list[str]:
    relative = wan_file_name(name, expert, source.experts)
    renamed = [TensorEntry(wan_key(e.key), e.shape) for e in source.entries(expert)]
    diffusers_names = {wan_key(e.key): e.key for e in source.entries(expert)}
    write_safetensors(
        dest.path(relative),
        renamed,
        lambda key: source.read(expert, diffusers_names[key]),
        dtype=dtype,
        metadata={"format": "pt"},
    )
    dest.done(relative)
    return [relative]


def export_checkpoint(
    source: CheckpointTensors,
    variant: WanVariant,
    *,
    fmt: Format,
    out: str,
    name: str,
    dtype: str = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Exported:
    """Write every expert of ``source`` to ``out`` (a path or ``gs://``) in layout ``fmt`` and ``dtype``.

    Args:
        source: the checkpoint (``sources.open_checkpoint``).
        variant: the architecture (its diffusers config goes into ``config.json``).
        fmt: "diffusers" or "wan".
        out: destination folder.
        name: file name stem of the "wan" layout (the TrainingJob's name).
        dtype: "bfloat16", "float16" or "float32"; every tensor is written in it.
        max_shard_bytes: shard size of the diffusers layout.
    """
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: valid: {', '.join(FORMATS)}")
    _check_dtype(dtype)
    expected = 2 if variant.two_experts else 1
    if source.experts != expected:
        raise ValueError(
            f"{source.uri}: checkpoint has {source.experts} expert(s); model {variant.name} has {expected}"
        )
    files: dict[str, list[str]] = {}
    with _destination(out) as dest:
        for expert in source.expert_ids:
            label = EXPERT_LABELS[expert]
            if fmt == "diffusers":
                files[label] = _write_diffusers(source, expert, variant, dest, dtype, max_shard_bytes)
            else:
                files[label] = _write_wan(source, expert, name, dest, dtype)
    return Exported(out=out, step=source.step, files=files)


def export_adapters(
    source: CheckpointTensors, variant: WanVariant, lora: LoraSpec, *, fmt: Format, out: str, name: str,
    dtype: str = "bfloat16", **_: object,
) -> Exported:  # fmt: skip
    """Write a LoRA checkpoint's adapters to ``out`` in layout ``fmt`` (``export.lora``)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: valid: {', '.join(FORMATS)}")
    _check_dtype(dtype)
    experts = 2 if variant.two_experts else 1
    with _destination(out) as dest:
        files = write_lora_files(source, lora, fmt=fmt, dest=dest, name=name, dtype=dtype, experts=experts)
    return Exported(out=out, step=source.step, files=files)


def export_from(
    checkpoint_uri: str,
    variant: WanVariant,
    *,
    step: int | None = None,
    ema: bool = False,
    lora: LoraSpec | None = None,
    merge: bool = False,
    weights: str | None = None,
    **options: object,
) -> Exported:
    """Open the checkpoint at ``step`` (default: latest) under ``checkpoint_uri`` and export it: full weights with
    ``export_checkpoint``; a LoRA job's adapters (``lora``: its ``spec.lora``) with ``export_adapters``, or with
    ``merge`` folded into its base ``weights`` (``spec.model.weights``) as full weights.

    Raises:
        ValueError: ``merge`` of a full checkpoint, adapters without ``lora``, or ``merge`` without ``weights``.
    """
    from wanloom_trainer.export.sources import open_checkpoint

    with open_checkpoint(checkpoint_uri, step=step, ema=ema) as source:
        if not is_lora(source):
            if merge:
                raise ValueError("--merge folds LoRA adapters into their base: this checkpoint holds full weights")
            return export_checkpoint(source, variant, **options)
        if lora is None:
            raise ValueError(f"{checkpoint_uri} holds LoRA adapters but the TrainingJob has no spec.lora")
        if not merge:
            return export_adapters(source, variant, lora, **options)
        with (
            tempfile.TemporaryDirectory(prefix="wanloom-base-") as staging,
            base_weights(weights, variant, Path(staging)) as base,
        ):
            return export_checkpoint(MergedTensors(base, source, lora), variant, **options)
