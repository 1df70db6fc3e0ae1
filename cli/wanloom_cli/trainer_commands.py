"""`wanloom run` (train a TrainingJob on this machine) and `wanloom plan` (AdaptiveLoad's step plans).

The trainer (jax/torch) is imported inside the commands, so the rest of the CLI starts without it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from wanloom_api import keys
from wanloom_api.validation import InvalidTrainingJob, load_trainingjob_file
from wanloom_cli.terminal import log_to_terminal

STOPPED_EXIT_CODE = keys.EXIT_STOPPED  # 128 + SIGTERM: the run checkpointed and stopped early
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT (Ctrl-C)
_EXPERTS = {0: "high_noise", 1: "low_noise"}  # routing's expert ids, as the metrics name them


def run(
    file: Annotated[Path, typer.Argument(help="TrainingJob YAML, e.g. jobs/tiny-local.yaml.")],
    processes: Annotated[
        int, typer.Option(help="Local processes, started like pods (jax.distributed over 127.0.0.1); CPU jobs only.")
    ] = 1,
    steps: Annotated[int | None, typer.Option(help="Override spec.training.steps.")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Prometheus port (process i serves port+i); 0 disables. Default: spec.")
    ] = None,
    run_dir: Annotated[
        Path | None, typer.Option(help="Where the step log, loss plot and process logs go. Default: runs/<name>.")
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
    debug: Annotated[bool, typer.Option(help="Show the traceback of a failed run.")] = False,
) -> None:
    """Train a TrainingJob locally: synthetic data if asked, both experts, checkpoints, a loss plot, metrics."""
    from wanloom_trainer.train import launch

    try:
        job = launch.with_overrides(
            load_trainingjob_file(file), steps=steps, processes=processes if processes != 1 else None
        )
        launch.require_local_devices(job)
    except (InvalidTrainingJob, ValueError) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    where = str(run_dir.resolve()) if run_dir else launch.default_run_dir(job)
    port = job.spec.metrics_port if metrics_port is None else metrics_port
    if processes > 1:
        typer.echo(f"starting {processes} processes (logs of 1..{processes - 1} in {where}/logs)")
        started = time.monotonic()
        code = launch.run_processes(job, processes, run_dir=where, metrics_port=port)
        if code in (0, STOPPED_EXIT_CODE):
            _summary(launch.read_result(where), where, job.spec.training.checkpoint.uri, time.monotonic() - started)
        raise typer.Exit(code)
    if port:
        typer.echo(f"Prometheus metrics on http://127.0.0.1:{port}/metrics")
    log_to_terminal()
    started = time.monotonic()
    try:
        result = launch.run_in_process(job, run_dir=where, metrics_port=port, progress=progress)
    except _user_errors() as exc:
        if debug:
            raise
        typer.echo(f"wanloom run: {_explain(exc)} (--debug shows the traceback)", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # a second Ctrl-C
        typer.echo("wanloom run: interrupted at once, without a new checkpoint; the same command resumes from the "
                   "last committed one", err=True)  # fmt: skip
        raise typer.Exit(INTERRUPTED_EXIT_CODE) from None
    _summary(result, where, job.spec.training.checkpoint.uri, time.monotonic() - started)
    if getattr(result, "stopped_by", None):
        # 128 + the signal, as if it had ended the process: a pod stopped this way is not "Succeeded".
        typer.echo(f"stopped by {result.stopped_by} at step {result.next_step}; run the same command to resume")
        raise typer.Exit(INTERRUPTED_EXIT_CODE if result.stopped_by == "SIGINT" else STOPPED_EXIT_CODE)


def _explain(exc: BaseException) -> str:
    if type(exc).__name__ == "DefaultCredentialsError":  # google.auth's message names neither the job nor a fix
        return (
            f"no Google Cloud credentials for the job's gs:// URIs ({exc}); set GOOGLE_APPLICATION_CREDENTIALS to a "
            "key file, run `gcloud auth application-default login`, or use Workload Identity on GKE"
        )
    return str(exc)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Failures the user fixes in the job, the data or the credentials; their messages name the field or file."""
    from wanloom_trainer.data.outage import StorageOutage
    from wanloom_trainer.data.skips import TooManyBadSamples

    errors: list[type[BaseException]] = [ValueError, FileNotFoundError, PermissionError, TooManyBadSamples]
    errors.append(StorageOutage)
    try:
        from google.auth.exceptions import DefaultCredentialsError

        errors.append(DefaultCredentialsError)
    except ImportError:  # no GCS client installed: no gs:// URIs either
        pass
    return tuple(errors)


def _summary(result: object, run_dir: str, checkpoint_uri: str | None, wall_s: float) -> None:
    from wanloom_trainer.train.summary import StepSummary

    records = getattr(result, "records", [])
    if not records:
        typer.echo(
            f"nothing to do: the latest checkpoint is at step {getattr(result, 'start_step', '?')}, the end of the "
            "run; delete its checkpoint directory (spec.training.checkpoint.uri) to train again"
        )
    else:
        for line in StepSummary.of(records).lines(wall_s):
            typer.echo(line)
    validations = getattr(result, "validations", [])
    if validations:
        last = validations[-1]
        losses = ", ".join(f"{_EXPERTS.get(e, e)} {v:.4f}" for e, v in sorted(last.losses.items()))
        typer.echo(f"validation loss after step {last.step}: {losses} ({len(validations)} validations)")
    checkpoints = getattr(result, "checkpoints", [])
    if checkpoints:
        typer.echo(f"checkpoints at steps {', '.join(map(str, checkpoints))} in {checkpoint_uri}")
    exported = getattr(result, "exported", None)
    if exported is not None:
        typer.echo(f"model exported to {exported.out} (spec.export)")
    plot = getattr(result, "plot", None)
    typer.echo(f"step log: {run_dir}/steps.jsonl" + (f"; loss curve: {plot}" if plot else ""))


def plan(
    file: Annotated[Path, typer.Argument(help="TrainingJob YAML.")],
    bench: Annotated[Path | None, typer.Option(help="Shape-benchmark JSON to fit the cost model from.")] = None,
    shapes: Annotated[
        Path | None, typer.Option(help="CSV of sample sizes in pixels (header frames,height,width) to plan instead.")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show AdaptiveLoad's plan for a TrainingJob: buckets, batch sizes, and its throughput against the bucket
    sampler over the same sample stream, in the backend's mode."""
    from wanloom_trainer.adaptiveload.comparison.report import run_plan
    from wanloom_trainer.train.bench_step import measure_shape_bench

    try:
        measure = measure_shape_bench if bench is not None else None
        typer.echo(run_plan(file, bench, shapes_csv=shapes, as_json=json_out, measure=measure))
    except (InvalidTrainingJob, *_user_errors()) as exc:
        typer.echo(f"wanloom plan: {_explain(exc)}", err=True)
        raise typer.Exit(1) from None


def _pixel_shape(text: str) -> tuple[int, int, int]:
    try:
        frames, height, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected FRAMESxHEIGHTxWIDTH in pixels, e.g. 81x720x1280") from None
    return frames, height, width


def compile_(
    file: Annotated[Path, typer.Argument(help="TrainingJob YAML with spec.resources.tpu or spec.resources.gpu.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    shape: Annotated[
        list[str] | None, typer.Option(help="Pixel shape FxHxW to compile at (repeatable). Default: the job's buckets.")
    ] = None,
    layers: Annotated[int | None, typer.Option(help="Compile a model of this depth (quick checks).")] = None,
    remat: Annotated[str | None, typer.Option(help="Override spec.parallelism.remat.")] = None,
    hbm_gib: Annotated[
        float | None, typer.Option(help="Memory per device in GiB (default: tpu7x 96 per JAX device; the GPU's).")
    ] = None,
) -> None:
    """Check the job's training step fits its devices, with no accelerator here: TPU jobs are compiled ahead of
    time for their topology; GPU jobs have their torch step traced on fake tensors with PyTorch's FSDP memory
    tracker."""
    import json

    import numpy as np

    try:
        job = load_trainingjob_file(file)
        pixels = None if not shape else np.asarray([_pixel_shape(s) for s in shape])
        if job.spec.resources.gpu is not None:
            from wanloom_trainer.backends.torch.compile import size_job as check
        else:
            from wanloom_trainer.backends.jax.compile import compile_job as check
        report = check(
            job, pixels=pixels, layers=layers, remat=remat,
            capacity_bytes=None if hbm_gib is None else int(hbm_gib * 2**30),
        )  # fmt: skip
    except (InvalidTrainingJob, ValueError) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(report.as_dict()) if json_out else report.text())
    if not report.fits:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("plan")(plan)
    app.command("compile")(compile_)
