"""pyproject.toml declares what the code imports, on the side that imports it, and nothing it does not.

The contract and the operator install with the core dependencies and the `operator` extra; the trainer with the
core ones and the `data`, `jax` and `torch` extras; the CLI (the top floor) may use any of them inside its commands.
A few distributions are needed at run time without an import of ours; each says why.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SIDES = {
    "wanloom_api": ("operator",),
    "wanloom_operator": ("operator",),
    "wanloom_trainer": ("data", "jax", "torch"),
    "wanloom_cli": ("operator", "data", "jax", "torch"),
}
# Namespace packages several distributions share: the module path names the distribution.
NAMESPACED = {"google.cloud.storage": "google-cloud-storage", "google.api_core": "google-api-core",
              "google.auth": "google-auth"}  # fmt: skip
# Modules that come with a declared distribution, not on their own.
PART_OF = {"pydantic_core": "pydantic"}
# Declared, and needed at run time, though nothing of ours imports them.
RUNTIME_ONLY = {
    "libtpu": "jax loads it to compile and run on TPU",
    "accelerate": "diffusers' from_pretrained needs it to load weights into an empty model",
    "gcsfs": "orbax writes and reads gs:// checkpoints through etils.epath, which opens them with fsspec's gcsfs",
}


def _declared(extras: tuple[str, ...]) -> set[str]:
    reqs = [*PROJECT["dependencies"], *(r for e in extras for r in PROJECT["optional-dependencies"][e])]
    names = {canonicalize_name(Requirement(r).name) for r in reqs}
    return names - {"wanloom"}


def _imports(package: str) -> dict[str, str]:
    """Third-party distribution -> a file of ``package`` that imports it."""
    owners = metadata.packages_distributions()
    found: dict[str, str] = {}
    root = next(p for p in (ROOT / d / package for d in ("operator", "cli", "trainer_images")) if p.exists())
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [f"{node.module}.{a.name}" for a in node.names]  # `from google.cloud import storage`
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top.startswith("wanloom"):
                    continue
                namespaced = next((d for prefix, d in NAMESPACED.items() if module.startswith(prefix)), None)
                dist = namespaced or PART_OF.get(top) or owners[top][0]
                found.setdefault(canonicalize_name(dist), str(path.relative_to(ROOT)))
    return found


def test_every_import_is_declared_on_its_side() -> None:
    problems = []
    for package, extras in SIDES.items():
        declared = _declared(extras)
        for dist, where in _imports(package).items():
            if dist not in declared:
                problems.append(f"{where} imports {dist}, which the core dependencies and {extras} do not declare")
    assert not problems, "\n".join(problems)


def test_every_declared_dependency_is_used() -> None:
    imported = {d for package in SIDES for d in _imports(package)}
    unused = sorted(_declared(("operator", "data", "jax", "torch")) - imported - set(RUNTIME_ONLY))
    assert not unused, f"pyproject.toml declares {unused}, which nothing imports (tests-only ones go in dev)"
