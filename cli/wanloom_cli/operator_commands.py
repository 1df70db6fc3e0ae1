"""`wanloom render` (what the operator would create) and `wanloom operator` (run it).

The operator package is imported inside the commands (the trainer images ship without it), and kopf and the
Kubernetes client inside `operator` only, so `wanloom validate` and `wanloom render` start without them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from wanloom_api.latentdataset import LatentDataset
from wanloom_api.validation import InvalidTrainingJob, load_trainingjob_file, validate_file

_HEADER = (
    "# Rendered by `wanloom render`: what the operator creates for this TrainingJob. The ownerReferences uid is the\n"
    "# TrainingJob's, assigned by the API server (a placeholder here unless --uid or metadata.uid is given).\n"
)


class _LiteralDumper(yaml.SafeDumper):
    """Multi-line strings (the embedded TrainingJob YAML) as readable `|` blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_LiteralDumper.add_representer(str, _represent_str)


def dump_objects(objects: list[dict[str, Any]], output: str) -> str:
    if output == "json":
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2) + "\n"
    return _HEADER + yaml.dump_all(objects, Dumper=_LiteralDumper, sort_keys=False, width=120)


def _in_namespace(metadata: Any, namespace: str) -> Any:
    """The metadata in ``namespace``, checked by the same rule as ``metadata.namespace``."""
    from pydantic import ValidationError

    try:
        return type(metadata).model_validate({**metadata.model_dump(by_alias=True), "namespace": namespace})
    except ValidationError:
        raise typer.BadParameter(
            f"{namespace!r} is not a namespace name: a DNS-1123 label (lowercase letters, digits and '-', starting "
            "and ending alphanumeric, at most 63 characters)",
            param_hint="--namespace",
        ) from None


def render(
    file: Annotated[Path, typer.Argument(help="A TrainingJob or LatentDataset YAML file.")],
    namespace: Annotated[str | None, typer.Option(help="Namespace (default: metadata.namespace or 'default').")] = None,
    uid: Annotated[str | None, typer.Option(help="The object's uid for the owner references.")] = None,
    output: Annotated[str, typer.Option("--output", "-o", help="yaml or json.")] = "yaml",
    units: Annotated[
        int,
        typer.Option(help="LatentDataset: the work units its plan pod would report (the encode Job's completions)."),
    ] = 1,
) -> None:
    """Print what the operator would create for FILE (images from WANLOOM_TRAINER_IMAGE_*): a TrainingJob's ConfigMap
    and JobSet, or a LatentDataset's ConfigMap and plan, encode and finalize Jobs."""
    from wanloom_operator.render.dataset import STEPS, render_dataset
    from wanloom_operator.render.jobset import render_trainingjob
    from wanloom_operator.settings import OperatorSettings

    if output not in ("yaml", "json"):
        raise typer.BadParameter(f"--output must be yaml or json (got {output!r})")
    if units < 1:
        raise typer.BadParameter(f"--units must be >= 1 (got {units})")
    try:
        results = validate_file(file)
        if len(results) == 1 and isinstance(results[0].job, LatentDataset):
            dataset = results[0].job
            if namespace:
                dataset = dataset.model_copy(update={"metadata": _in_namespace(dataset.metadata, namespace)})
            made = render_dataset(dataset, OperatorSettings.from_env(), owner_uid=uid)
            objects = [made.configmap, *(made.job(step, units) for step in STEPS)]
            typer.echo(dump_objects(objects, output), nl=False)
            return
        job = load_trainingjob_file(file)
        if namespace:
            job = job.model_copy(update={"metadata": _in_namespace(job.metadata, namespace)})
        rendered = render_trainingjob(job, OperatorSettings.from_env(), owner_uid=uid)
    except (InvalidTrainingJob, ValueError) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    typer.echo(dump_objects(rendered.objects, output), nl=False)


def operator(
    namespace: Annotated[
        list[str] | None, typer.Option("--namespace", "-n", help="Watch this namespace (repeatable).")
    ] = None,
    all_namespaces: Annotated[bool, typer.Option("--all-namespaces", "-A", help="Watch every namespace.")] = False,
    peering: Annotated[
        str | None, typer.Option(help="kopf peering name: replicas elect one active operator (needs kopf's CRDs).")
    ] = None,
    priority: Annotated[int | None, typer.Option(help="Peering priority of this replica (default: random).")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Port of the operator's /metrics.")] = None,
    liveness_port: Annotated[int | None, typer.Option(help="Port of /healthz.")] = None,
    log_format: Annotated[str | None, typer.Option(help="json, plain or full.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logs.")] = False,
) -> None:
    """Run the operator: TrainingJobs -> JobSets, status and progress (settings from WANLOOM_* env and flags)."""
    from wanloom_operator.reconcile.runner import run_operator  # kopf and kubernetes load only here
    from wanloom_operator.settings import OperatorSettings

    if namespace and all_namespaces:
        raise typer.BadParameter("use either --namespace or --all-namespaces")
    flags = {
        "namespaces": tuple(namespace) if namespace else None,
        "peering_name": peering,
        "peering_priority": priority,
        "metrics_port": metrics_port,
        "liveness_port": liveness_port,
        "log_format": log_format,
    }
    try:
        settings = OperatorSettings.from_env(**{k: v for k, v in flags.items() if v is not None})
    except ValueError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if all_namespaces:
        settings = settings.model_copy(update={"namespaces": ()})
    run_operator(settings, verbose=verbose)


def register(app: typer.Typer) -> None:
    app.command()(render)
    app.command()(operator)
