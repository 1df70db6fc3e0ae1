"""`wanloom data prepare` and `wanloom data synth`: build training datasets (format: docs/data-format.md).

The trainer package (numpy, and torch/diffusers for `prepare`) is imported inside the commands, so the rest of
the CLI starts without it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from wanloom_cli.terminal import log_to_terminal

if TYPE_CHECKING:
    from wanloom_trainer.metrics.prepare import PrepareMetrics

data_app = typer.Typer(
    name="data", help="Build training datasets: encode media (prepare) or synthesise latents (synth)."
)


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(1)


def _summary(index: Any, where: str) -> None:
    shapes = Counter(tuple(s) for s in index.latent_shapes.tolist())
    typer.echo(f"wrote {index.num_samples} samples in {len(index.shards)} shard(s) to {where}")
    for shape, n in sorted(shapes.items()):
        typer.echo(f"  latent {shape[0]}x{shape[1]}x{shape[2]}: {n}")


def prepare(
    inputs: Annotated[
        str,
        typer.Argument(
            help="A manifest (.jsonl, .csv or .parquet: path, caption or caption_path, optional start/end/id), or a "
            "folder or gs:// prefix of images/videos each with a same-stem .txt caption."
        ),
    ],
    output: Annotated[str, typer.Argument(help="Dataset root: a path or gs://bucket/prefix.")],
    model: Annotated[Path, typer.Option(help="Diffusers-layout model root with vae/, text_encoder/, tokenizer/.")],
    bucket: Annotated[
        list[str], typer.Option(help="Pixel bucket FRAMESxHEIGHTxWIDTH (repeat), e.g. 1x480x832, 81x480x832.")
    ],
    variant: Annotated[str, typer.Option(help="Wan variant the latents are for.")] = "wan2.2-t2v-a14b",
    fps: Annotated[float, typer.Option(help="Frame rate clips are resampled to.")] = 16.0,
    batch_size: Annotated[int, typer.Option(help="Sources per encoder call.")] = 4,
    samples_per_shard: Annotated[int, typer.Option(help="Sources per shard (the unit of resumption).")] = 256,
    dtype: Annotated[str, typer.Option(help="Storage dtype: bfloat16, float16 or float32.")] = "bfloat16",
    device: Annotated[str, typer.Option(help="Torch device for the encoders.")] = "cpu",
    encoder_dtype: Annotated[str, typer.Option(help="Encoder dtype: float32 or bfloat16.")] = "float32",
    encoders: Annotated[
        str, typer.Option(help="Encoder implementation: torch, jax, or auto (torch where installed, else jax).")
    ] = "auto",
    prompts: Annotated[
        Path | None, typer.Option(help="Text file of validation prompts (one per line) to encode with the dataset.")
    ] = None,
    negative_prompt: Annotated[
        str | None,
        typer.Option(help="Text validation videos are guided away from (spec.validation.negativePrompt)."),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    work_unit: Annotated[
        list[int] | None,
        typer.Option(help="Only this work unit (a shard of samples-per-shard inputs; repeat): one worker of many."),
    ] = None,
    finalize: Annotated[
        bool | None,
        typer.Option(help="Write the index once every unit is done (default: yes, unless --work-unit is given)."),
    ] = None,
) -> None:
    """Encode captioned media with the Wan VAE and umT5 into latent shards + index; re-run to resume."""
    from wanloom_trainer.data.bucketing import parse_bucket
    from wanloom_trainer.data.prepare.pipeline import PrepareConfig
    from wanloom_trainer.data.prepare.pipeline import prepare as run_prepare

    try:
        config = PrepareConfig(
            inputs=inputs,
            output=output,
            model=model,
            variant=variant,
            buckets=tuple(parse_bucket(b) for b in bucket),
            fps=fps,
            batch_size=batch_size,
            samples_per_shard=samples_per_shard,
            dtype=dtype,
            device=device,
            encoder_dtype=encoder_dtype,
            encoders=encoders,
            prompts=prompts,
            negative_prompt=negative_prompt,
        )
        result = run_prepare(
            config, progress=progress, units=work_unit or None, finalize=not work_unit if finalize is None else finalize
        )
    except (ValueError, FileNotFoundError) as exc:
        raise _fail(exc) from exc
    if result.index is None:
        typer.echo(f"wrote work unit(s) {', '.join(map(str, work_unit or []))} to {output}; not finalized")
    else:
        _summary(result.index, output)
    for skip in result.skipped:
        typer.echo(f"  skipped {skip['source']}: {skip['reason']}")


def units(
    inputs: Annotated[str, typer.Argument(help="A manifest, or a folder or gs:// prefix of captioned media.")],
    samples_per_shard: Annotated[int, typer.Option(help="Sources per shard (one work unit).")] = 256,
) -> None:
    """Print how many work units (shards) the inputs make: a data-preparation Job's completions."""
    from wanloom_trainer.data.prepare.sources import read_sources

    if samples_per_shard < 1:
        raise _fail(ValueError(f"--samples-per-shard must be >= 1, got {samples_per_shard}"))
    try:
        n = len(read_sources(inputs))
    except (ValueError, FileNotFoundError) as exc:
        raise _fail(exc) from exc
    typer.echo(-(-n // samples_per_shard))


def build(
    file: Annotated[Path, typer.Argument(help="A LatentDataset YAML file.")],
    step: Annotated[
        str, typer.Option(help="all (one machine), or one of the operator's pods: plan, encode or finalize.")
    ] = "all",
    work_unit: Annotated[
        list[int] | None,
        typer.Option(help="encode: the unit(s) to encode (default: $JOB_COMPLETION_INDEX, an Indexed Job's index)."),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="Torch device (default: cuda with gpu resources, else cpu).")
    ] = None,
) -> None:
    """Build a LatentDataset: plan, encode every work unit, finalize; or one of those steps, as a pod does.

    Prints the step's summary as JSON (and, in a pod, writes it as the termination message the operator reads);
    a dataset that cannot be built as written exits 3 with one line naming the field or input."""
    import contextlib
    import json
    import os

    from wanloom_api.keys import EXIT_CONFIG_ERROR
    from wanloom_api.validation import InvalidTrainingJob, load_latentdataset_file
    from wanloom_trainer.__main__ import TERMINATION_LOG, report
    from wanloom_trainer.data.prepare import resource

    if step not in ("all", "plan", "encode", "finalize"):
        raise _fail(ValueError(f"--step {step!r}: use all, plan, encode or finalize"))
    log_to_terminal()  # each unit's line: samples, skips, seconds per stage
    metrics = None
    try:
        dataset = load_latentdataset_file(file)
        if step in ("encode", "all"):
            metrics = _serve_metrics(dataset.metadata.name)
        on_progress = metrics.observe if metrics is not None else None
        if step == "encode":
            units = work_unit or _completion_index(os.environ.get("JOB_COMPLETION_INDEX"))
            summary = resource.encode(dataset, units, device, on_progress=on_progress)
        elif step == "plan":
            summary = resource.plan(dataset)
        elif step == "finalize":
            summary = resource.finalize(dataset)
        else:
            summary = resource.build(dataset, device, on_progress=on_progress)
    except (InvalidTrainingJob, ValueError, FileNotFoundError) as exc:
        text = str(exc).strip().splitlines()
        raise typer.Exit(report(f"wanloom data build: {' '.join(text)}", EXIT_CONFIG_ERROR)) from exc
    finally:
        if metrics is not None:
            metrics.close()
    line = json.dumps(summary, sort_keys=True)
    typer.echo(line)
    if TERMINATION_LOG.exists():  # in a pod: the operator reads the summary from the container's status
        with contextlib.suppress(OSError):
            TERMINATION_LOG.write_text(line[:4000])


def _serve_metrics(latentdataset: str) -> PrepareMetrics | None:
    """The pod's /metrics on ``$WANLOOM_METRICS_PORT`` (set by the operator on encode pods); None where unset."""
    import os

    from wanloom_api.keys import ENV_METRICS_PORT
    from wanloom_trainer.metrics.prepare import PrepareMetrics

    port = os.environ.get(ENV_METRICS_PORT, "0")
    if not port.isdigit():
        raise ValueError(f"{ENV_METRICS_PORT}={port!r}: must be a port number (0: no metrics)")
    if int(port) == 0:
        return None
    metrics = PrepareMetrics(latentdataset)
    metrics.serve(int(port))
    return metrics


def _completion_index(value: str | None) -> list[int]:
    if value is None or not value.isdigit():
        raise ValueError("--step encode needs --work-unit K or JOB_COMPLETION_INDEX (set in an Indexed Job's pods)")
    return [int(value)]


def synth(
    output: Annotated[str, typer.Argument(help="Dataset root: a path or gs://bucket/prefix.")],
    variant: Annotated[str, typer.Option(help="Wan variant whose shapes the latents take.")] = "tiny",
    samples: Annotated[int, typer.Option(help="Number of samples.")] = 64,
    seed: Annotated[int, typer.Option(help="Generator seed.")] = 0,
    mixture: Annotated[
        str | None, typer.Option(help="Shape mixture FxHxW:weight,... in pixels; default per variant.")
    ] = None,
    samples_per_shard: Annotated[int | None, typer.Option(help="Samples per shard; default ~512 MB shards.")] = None,
    dtype: Annotated[str, typer.Option(help="Storage dtype: float32, float16 or bfloat16.")] = "float32",
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Write a synthetic latent dataset (learnable patterns, mixed shapes) in the training format."""
    from wanloom_trainer.config.variants import get_variant
    from wanloom_trainer.data.synthetic import parse_mixture, write_synthetic

    try:
        index = write_synthetic(
            output,
            get_variant(variant),
            samples,
            seed,
            parse_mixture(mixture) if mixture else None,
            samples_per_shard=samples_per_shard,
            dtype=dtype,
            progress=progress,
        )
    except (ValueError, FileNotFoundError) as exc:
        raise _fail(exc) from exc
    _summary(index, output)


def register(app: typer.Typer) -> None:
    data_app.command()(prepare)
    data_app.command()(units)
    data_app.command()(build)
    data_app.command()(synth)
    app.add_typer(data_app)
