"""The docs name things that exist: every `wanloom` command and option in a code block, every `spec.` field path,
every `wanloom_` metric and every repository path they mention."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
import typer

from wanloom_api.metrics import OPERATOR_METRICS, TRAINER_METRICS
from wanloom_api.trainingjob import TrainingJobSpec
from wanloom_cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = re.compile(r"```(?:bash|sh)?\n(.*?)```", re.S)
FIELD = re.compile(r"\bspec\.[a-zA-Z][a-zA-Z0-9_.]*[a-zA-Z0-9]")
# Fields of other objects the docs mention (Kueue's Workload).
FOREIGN_FIELDS = {"spec.active"}
METRIC = re.compile(r"\bwanloom_[a-z_]+[a-z]\b")
REPO_PATH = re.compile(r"(?<![\w/.-])((?:jobs|docs|tests|benchmarks|helm|trainer_images|operator)/[\w./-]*\w)")
# Python package names that look like metrics (wanloom_api, ...).
PACKAGES = {"wanloom_api", "wanloom_cli", "wanloom_operator", "wanloom_trainer"}


def _commands() -> dict[str, click.Command]:
    group = typer.main.get_command(app)
    out: dict[str, click.Command] = {}
    for name, command in group.commands.items():
        out[name] = command
        for sub, subcommand in getattr(command, "commands", {}).items():
            out[f"{name} {sub}"] = subcommand
    return out


def _spec_paths(model: type = TrainingJobSpec, prefix: str = "spec") -> set[str]:
    import typing

    from pydantic import BaseModel

    paths = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}.{field.alias or name}"
        paths.add(path)
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                paths |= _spec_paths(arg, path)
    return paths


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_wanloom_commands_in_code_blocks_exist_with_their_options(doc: Path) -> None:
    commands = _commands()
    for block in CODE.findall(doc.read_text()):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if not line.startswith("wanloom "):
                continue
            words = shlex.split(line)
            name = next((n for n in (" ".join(words[1:3]), words[1]) if n in commands), None)
            if name is None and "|" in words[1]:
                continue  # "wanloom data synth|prepare ...": an overview, each named elsewhere
            assert name is not None, f"{doc.name}: `{line}`: no such command"
            options = {o for p in commands[name].params for o in getattr(p, "opts", ())}
            options |= {o for p in commands[name].params for o in getattr(p, "secondary_opts", ())}
            for word in words:
                if word.startswith("--"):
                    assert word.split("=")[0] in options, f"{doc.name}: `{line}`: {name} has no {word}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_field_paths_metrics_and_files_exist(doc: Path) -> None:
    text = doc.read_text()
    fields = _spec_paths()
    # snake_case paths are Python attributes in code samples, not manifest fields
    named = {f for f in FIELD.findall(text) if "_" not in f and f not in FOREIGN_FIELDS}
    unknown = sorted(named - fields)
    assert not unknown, f"{doc.name} names fields the TrainingJob does not have: {unknown}"
    metrics = {m.name for m in (*TRAINER_METRICS, *OPERATOR_METRICS)}
    names = {m for m in METRIC.findall(text) if m not in PACKAGES}
    unknown = sorted(m for m in names if re.sub(r"_(bucket|count|sum)$", "", m) not in metrics)
    assert not unknown, f"{doc.name} names metrics the contract does not have: {unknown}"
    # "results/balance.{json,png}": a stem some files share
    missing = sorted({p for p in REPO_PATH.findall(text) if not list((ROOT / p).parent.glob(Path(p).name + "*"))})
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"
