"""Import boundaries: the trainer never needs kopf/kubernetes, the operator never needs jax/torch, and the packages
import each other only downwards (contract <- operator, trainer <- CLI)."""

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
        ("wanloom_api.validation", {"jax", "torch", "kopf", "kubernetes", "wanloom_operator", "wanloom_trainer"}),
        (
            "wanloom_cli",
            {"jax", "torch", "flax", "triton", "kopf", "kubernetes", "wanloom_operator", "wanloom_trainer"},
        ),
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


# Which of our packages each package may import (lazily or not). The contract depends on nothing of ours; the
# operator and the trainer only on the contract; the CLI sits on top of all three.
LAYERS = {
    "wanloom_api": set(),
    "wanloom_operator": {"wanloom_api"},
    "wanloom_trainer": {"wanloom_api"},
    "wanloom_cli": {"wanloom_api", "wanloom_operator", "wanloom_trainer"},
}
SOURCE_ROOTS = (ROOT / "operator", ROOT / "cli", ROOT / "trainer_images")


def _packages() -> dict[str, Path]:
    return {p.parent.name: p.parent for root in SOURCE_ROOTS for p in root.glob("*/__init__.py")}


def test_every_package_has_a_layer() -> None:
    assert set(_packages()) == set(LAYERS)


@pytest.mark.parametrize("package", LAYERS)
def test_packages_import_only_the_layers_below(package: str) -> None:
    allowed = LAYERS[package] | {package}
    wrong = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in _packages()[package].rglob("*.py")
        for name in _imports_in(path)
        if name.startswith("wanloom_") and name.partition(".")[0] not in allowed
    }
    assert not wrong, f"{package} may import only {sorted(allowed)}: {sorted(wrong)}"


def test_a_cli_command_whose_side_is_not_installed_says_so() -> None:
    """A trainer image ships without the operator package: `wanloom render` there is one line, not a traceback."""
    code = (
        "import sys; sys.modules['wanloom_operator'] = None; sys.argv = ['wanloom', 'render', 'jobs/tiny-local.yaml']\n"
        "from wanloom_cli import main; main()"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "wanloom render: needs wanloom_operator, which this installation leaves out; run it from the operator image "
        "or a full `pip install wanloom`"
    ]
    validate = subprocess.run(
        [sys.executable, "-c", code.replace("'render'", "'validate'")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert validate.returncode == 0, validate.stderr


def test_adaptiveload_imports_nothing_of_the_training_loop() -> None:
    """The trainer plans with AdaptiveLoad; AdaptiveLoad never reaches back into ``train`` (the shape benchmark's
    backend step lives there and hands AdaptiveLoad its timing points): no circle between the two packages."""
    package = ROOT / "trainer_images" / "wanloom_trainer" / "adaptiveload"
    imported = {m for path in package.glob("*.py") for m in _imports_in(path)}
    assert "wanloom_trainer.adaptiveload.planner" in imported  # the walk sees the package's own imports
    assert not {m for m in imported if m.startswith("wanloom_trainer.train")}
