"""`wanloom render` prints what the operator creates; `wanloom operator --help`; import boundaries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from wanloom_api.validation import load_trainingjob_file
from wanloom_cli import app
from wanloom_operator.render.jobset import render_trainingjob
from wanloom_operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "jobs" / "t2v-a14b-tpu7x-2x4x4x4.yaml"


def test_render_prints_the_operators_objects() -> None:
    result = CliRunner().invoke(app, ["render", str(EXAMPLE), "--namespace", "ml", "--uid", "u-1"])
    assert result.exit_code == 0, result.output
    configmap, jobset = list(yaml.safe_load_all(result.output))
    job = load_trainingjob_file(EXAMPLE)
    job = job.model_copy(update={"metadata": job.metadata.model_copy(update={"namespace": "ml"})})
    expected = render_trainingjob(job, OperatorSettings.from_env(), owner_uid="u-1")
    assert [configmap, jobset] == expected.objects


def test_render_json(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["render", str(EXAMPLE), "-o", "json"])
    assert result.exit_code == 0 and '"kind": "JobSet"' in result.output


def test_render_of_an_invalid_file_names_the_field(tmp_path: Path) -> None:
    bad = yaml.safe_load(EXAMPLE.read_text())
    bad["spec"]["resources"]["tpu"]["topology"] = "3x3x3"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = CliRunner().invoke(app, ["render", str(path)])
    assert result.exit_code == 1
    assert "spec.resources.tpu.topology" in result.output


def test_operator_help_lists_its_flags() -> None:
    result = CliRunner().invoke(app, ["operator", "--help"])
    assert result.exit_code == 0
    for flag in ("--namespace", "--all-namespaces", "--peering", "--metrics-port", "--liveness-port"):
        assert flag in result.output


def test_cli_and_render_import_no_kopf_and_no_client() -> None:
    code = (
        "import sys, wanloom_cli, wanloom_operator.render.jobset;"
        "bad = [m for m in ('kopf', 'kubernetes', 'jax', 'torch') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_render_refuses_a_namespace_kubernetes_would_refuse() -> None:
    result = CliRunner().invoke(app, ["render", str(EXAMPLE), "--namespace", "Team_A"])
    assert result.exit_code == 2
    assert "--namespace" in result.output and "'Team_A' is not a namespace name" in result.output


def _commands(group, prefix=()):  # type: ignore[no-untyped-def]
    for name, command in getattr(group, "commands", {}).items():
        yield (*prefix, name)
        yield from _commands(command, (*prefix, name))


def test_help_shows_flags_as_flags() -> None:
    """`--debug / --no-debug`, not `--debug <bool>`: a flag takes no value."""
    import typer

    names = list(_commands(typer.main.get_command(app)))
    assert ("run",) in names and ("data", "prepare") in names
    for name in names:
        result = CliRunner().invoke(app, [*name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        assert "<bool>" not in result.output, (name, result.output)
    assert "--progress / --no-progress" in CliRunner().invoke(app, ["run", "--help"]).output
