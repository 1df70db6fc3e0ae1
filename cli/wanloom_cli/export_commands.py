"""`wanloom export`: a TrainingJob's checkpoint as diffusers folders or original-Wan files, a LoRA job's adapters as
LoRA files (or merged) (``wanloom_trainer.export``).

The export needs no accelerator: JAX is kept on the CPU unless ``JAX_PLATFORMS`` says otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from wanloom_api.validation import InvalidTrainingJob, load_trainingjob_file


def _shard_bytes(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    number, unit = text[:-2], text[-2:].upper()
    try:
        value = int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise typer.BadParameter(f"{text!r}: expected a size such as 5GB, 500MB or 20KB") from None
    if value <= 0:
        raise typer.BadParameter(f"{text!r}: must be positive")
    return value


def export(
    file: Annotated[Path, typer.Argument(help="TrainingJob YAML whose spec.training.checkpoint.uri to export.")],
    out: Annotated[str, typer.Option(help="Destination folder: a path or gs://bucket/prefix.")],
    format_: Annotated[
        str, typer.Option("--format", help="diffusers (transformer/ + transformer_2/) or wan (one file per expert).")
    ] = "diffusers",
    step: Annotated[int | None, typer.Option(help="Checkpoint step. Default: the latest.")] = None,
    ema: Annotated[bool, typer.Option(help="Export the EMA weights (spec.optimizer.ema).")] = False,
    merge: Annotated[
        bool, typer.Option(help="LoRA jobs: full weights, the adapters merged into spec.model.weights.")
    ] = False,
    dtype: Annotated[str, typer.Option(help="bfloat16, float16 or float32.")] = "bfloat16",
    max_shard_size: Annotated[str, typer.Option(help="Shard size of the diffusers layout.")] = "5GB",
) -> None:
    """Export a trained checkpoint (either backend) in the layouts diffusers and ComfyUI load."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # reading an orbax checkpoint must not claim a TPU
    from wanloom_trainer.config.variants import get_variant
    from wanloom_trainer.export.layouts import export_from

    try:
        job = load_trainingjob_file(file)
        uri = job.spec.training.checkpoint.uri
        if uri is None:
            raise ValueError(f"{file}: spec.training.checkpoint.uri is unset, so the job saved nothing to export")
        exported = export_from(
            uri,
            get_variant(job.spec.model.variant),
            step=step,
            ema=ema,
            lora=job.spec.lora,
            merge=merge,
            weights=job.spec.model.weights,
            fmt=format_,
            out=out,
            name=job.metadata.name,
            dtype=dtype,
            max_shard_bytes=_shard_bytes(max_shard_size),
        )
    except (InvalidTrainingJob, ValueError, FileNotFoundError) as exc:
        typer.echo(f"wanloom export: {exc}", err=True)
        raise typer.Exit(1) from None
    what = "adapters" if job.spec.lora is not None and not merge else "weights"
    weights = f"EMA {what}" if ema else what
    typer.echo(f"exported the {weights} of step {exported.step} ({format_}, {dtype}) to {exported.out}:")
    for label, files in exported.files.items():
        typer.echo(f"  {label}: {', '.join(files)}")


def register(app: typer.Typer) -> None:
    app.command("export")(export)
