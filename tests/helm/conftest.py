"""Fixtures of the chart tests: the chart loaded with the Helm SDK (helm-python-sdk) and a render function."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "wanloom"
NAMESPACE = "wanloom-system"


@pytest.fixture(scope="session")
def helm() -> Any:
    return pytest.importorskip("helm_python", reason="helm-python-sdk (import helm_python) is not installed")


@pytest.fixture(scope="session")
def chart(helm: Any) -> Iterator[Any]:
    with helm.Chart.load(str(CHART_DIR)) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart: Any) -> Callable[..., list[dict[str, Any]]]:
    """render(values) -> every rendered object (values merged over the chart defaults), NOTES.txt excluded."""

    def _render(values: dict[str, Any] | None = None, name: str = "wanloom") -> list[dict[str, Any]]:
        manifests = chart.render(values or {}, name=name, namespace=NAMESPACE, is_install=True)
        objects: list[dict[str, Any]] = []
        for path, text in sorted(manifests.items()):
            if not path.endswith("NOTES.txt"):
                objects += [doc for doc in yaml.safe_load_all(text) if doc]
        return objects

    return _render
