"""Import boundaries: the trainer never needs kopf/kubernetes, the operator never needs jax/torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return {line.split(".")[0] for line in out.stdout.split()}


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("wanloom_trainer", {"kopf", "kubernetes", "jax", "torch"}),
        ("wanloom_operator", {"jax", "torch", "flax", "triton", "kopf", "kubernetes"}),
        ("wanloom_operator.api.validation", {"jax", "torch", "kopf", "kubernetes"}),
        ("wanloom_operator.cli", {"jax", "torch", "flax", "triton", "kopf", "kubernetes"}),
        ("wanloom_trainer.adaptiveload", {"jax", "torch", "kopf", "kubernetes"}),
        ("wanloom_trainer.routing", {"jax", "torch", "kopf", "kubernetes"}),
    ],
)
def test_import_does_not_pull_in(module: str, forbidden: set[str]) -> None:
    assert not (_modules_after_import(module) & forbidden)


def _imports_in(path: Path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_trainer_uses_only_the_operator_api() -> None:
    for path in (ROOT / "trainer_images" / "wanloom_trainer").rglob("*.py"):
        for name in _imports_in(path):
            if name.startswith("wanloom_operator"):
                assert name.startswith("wanloom_operator.api"), f"{path} imports {name}"


def test_operator_core_never_imports_the_trainer() -> None:
    for path in (ROOT / "operator" / "wanloom_operator").rglob("*.py"):
        if "cli" in path.relative_to(ROOT / "operator").parts:
            continue  # CLI commands import the trainer lazily, inside the commands that run it
        assert not any(n.startswith("wanloom_trainer") for n in _imports_in(path)), path
