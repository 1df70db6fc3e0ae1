"""The docs name things that exist: every `wanloom` command and option (in code blocks and inline), every `make`
target, every Helm `--set` key, every TrainingJob a `kubectl` command names, every `spec.` field path, every
`wanloom_` metric and every repository path they mention."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
import typer
import yaml

from wanloom_api.latentdataset import LatentDatasetSpec
from wanloom_api.metrics import ALL_METRICS
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
TEST_REF = re.compile(r"(tests/[\w/.-]+\.py)::(test_\w+)")
INLINE = re.compile(r"`((?:wanloom|make) [^`]+)`")
# The TrainingJob a kubectl command acts on: `get/describe/delete tj [-n NS] NAME` and the label selector.
TJ_NAME = re.compile(r"\b(?:tj|trainingjobs?)\s+(?:-n\s+\S+\s+)?(?!-)([a-z0-9][a-z0-9.-]*)")
TJ_LABEL = re.compile(r"wanloom\.dev/trainingjob=([a-z0-9][a-z0-9.-]*)")
HELM_SET = re.compile(r"--set(?:-string)?[ =]'?([A-Za-z][\w.]*)=")


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


def _command_lines(text: str) -> list[str]:
    """Every `wanloom`/`make` command of a doc: the lines of its code blocks and its inline code."""
    lines = [line.split("#", 1)[0].strip() for block in CODE.findall(text) for line in block.splitlines()]
    return [*lines, *INLINE.findall(text)]


def _job_names() -> set[str]:
    return {yaml.safe_load(p.read_text())["metadata"]["name"] for p in (ROOT / "jobs").glob("*.yaml")}


def _values_keys(values: dict, prefix: str = "") -> set[str]:
    """Every key path of values.yaml; an empty map (labels: {}) takes any key below it ("labels.*")."""
    keys = set()
    for key, value in values.items():
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= _values_keys(value, f"{prefix}{key}.") if value else {f"{prefix}{key}.*"}
    return keys


def _is_value_key(key: str, keys: set[str]) -> bool:
    parts = key.split(".")
    return key in keys or any(".".join(parts[:i]) + ".*" in keys for i in range(1, len(parts)))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_wanloom_commands_in_code_blocks_exist_with_their_options(doc: Path) -> None:
    commands = _commands()
    for line in _command_lines(doc.read_text()):
        if line.startswith("wanloom "):
            words = shlex.split(line.split(">")[0].replace("<", "").replace("|", " | "))
            name = next((n for n in (" ".join(words[1:3]), words[1]) if n in commands), None)
            if name is None and words[2:3] == ["|"]:
                continue  # "wanloom data synth|prepare ...": an overview, each named elsewhere
            assert name is not None, f"{doc.name}: `{line}`: no such command"
            options = {o for p in commands[name].params for o in getattr(p, "opts", ())}
            options |= {o for p in commands[name].params for o in getattr(p, "secondary_opts", ())}
            for word in words:
                if word.startswith("--"):
                    assert word.split("=")[0] in options, f"{doc.name}: `{line}`: {name} has no {word}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_make_targets_helm_keys_and_job_names_exist(doc: Path) -> None:
    text = doc.read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    for line in _command_lines(text):
        if line.startswith("make "):
            for target in line.split()[1:]:
                if not target.startswith(("-", "$")) and "=" not in target:
                    assert target in targets, f"{doc.name}: `{line}`: the Makefile has no target {target!r}"
    keys = _values_keys(yaml.safe_load((ROOT / "helm" / "wanloom" / "values.yaml").read_text()))
    unknown = sorted({k for k in HELM_SET.findall(text) if not _is_value_key(k, keys)})
    assert not unknown, f"{doc.name} sets chart values that values.yaml does not have: {unknown}"
    kubectl = [line for block in CODE.findall(text) for line in block.splitlines() if "kubectl" in line]
    kubectl += re.findall(r"`(kubectl [^`]+)`", text)
    named = {m for line in kubectl for m in (*TJ_NAME.findall(line), *TJ_LABEL.findall(line))}
    unknown = sorted(named - _job_names())
    assert not unknown, f"{doc.name}: kubectl names TrainingJobs no file in jobs/ defines (metadata.name): {unknown}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_field_paths_metrics_and_files_exist(doc: Path) -> None:
    text = doc.read_text()
    fields = _spec_paths() | _spec_paths(LatentDatasetSpec)
    # snake_case paths are Python attributes in code samples, not manifest fields
    named = {f for f in FIELD.findall(text) if "_" not in f and f not in FOREIGN_FIELDS}
    unknown = sorted(named - fields)
    assert not unknown, f"{doc.name} names fields the TrainingJob does not have: {unknown}"
    metrics = {m.name for m in ALL_METRICS}
    names = {m for m in METRIC.findall(text) if m not in PACKAGES}
    unknown = sorted(m for m in names if re.sub(r"_(bucket|count|sum)$", "", m) not in metrics)
    assert not unknown, f"{doc.name} names metrics the contract does not have: {unknown}"
    # "results/balance.{json,png}": a stem some files share
    missing = sorted({p for p in REPO_PATH.findall(text) if not list((ROOT / p).parent.glob(Path(p).name + "*"))})
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"
    # "tests/x.py::test_name": the test a claim rests on
    gone = [f"{p}::{t}" for p, t in TEST_REF.findall(text) if f"def {t}(" not in (ROOT / p).read_text()]
    assert not gone, f"{doc.name} cites tests that do not exist: {gone}"


def test_the_uninstall_note_says_what_the_chart_keeps() -> None:
    crd = (ROOT / "helm" / "wanloom" / "templates" / "crds" / "trainingjobs.wanloom.dev.yaml").read_text()
    keeps = "helm.sh/resource-policy: keep" in crd
    note = next(p for p in (ROOT / "docs" / "install.md").read_text().split("\n\n") if p.startswith("Uninstall with"))
    assert ("**keeps** the TrainingJob CRD" in note) == keeps, note
