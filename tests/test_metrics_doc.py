"""docs/metrics.md stays in step with the metrics contract, the MFU peak table and the dashboard.

The tables between ``<!-- generated:NAME -->`` and ``<!-- end generated -->`` are produced here from
``wanloom_api.metrics``, ``wanloom_trainer.flops`` and ``helm/wanloom/dashboards/wanloom.json``. After changing
any of them, regenerate them with

    PYTHONPATH=operator:trainer_images .venv/bin/python tests/test_metrics_doc.py
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from wanloom_api.metrics import DATASET_METRICS, OPERATOR_METRICS, TRAINER_METRICS, MetricDef
from wanloom_trainer.flops import ACCELERATORS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "helm" / "wanloom" / "dashboards" / "wanloom.json"
BLOCK = re.compile(r"(<!-- generated:(?P<name>[a-z-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)

_UNITS = (
    ("_seconds_total", "seconds"),
    ("_seconds", "seconds"),
    ("_ratio", "ratio"),
    ("_cv", "ratio (std/mean)"),
    ("_per_second", "tokens/s"),
    ("_total", "count"),
)


def unit(spec: MetricDef) -> str:
    for suffix, name in _UNITS:
        if spec.name.endswith(suffix):
            return name
    return "value"


def metric_table(specs: tuple[MetricDef, ...]) -> str:
    rows = ["| metric | type | labels | unit | exported by | meaning |", "|---|---|---|---|---|---|"]
    for m in specs:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "–"
        help_text = m.help.replace("|", "\\|")
        rows.append(f"| `{m.name}` | {m.kind} | {labels} | {unit(m)} | {m.exported_by} | {help_text} |")
    return "\n".join(rows) + "\n"


def peak_table() -> str:
    rows = ["| accelerator key | peak per device | device |", "|---|---|---|"]
    for acc in ACCELERATORS.values():
        peak = acc.peak_bf16_flops
        rate = f"{peak / 1e12:,.1f} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:,.0f} GFLOP/s"
        rows.append(f"| `{acc.name}` | {rate} | {acc.note} |")
    return "\n".join(rows) + "\n"


def dashboard_table() -> str:
    """The dashboard's rows and their panels, in order."""
    rows: list[tuple[str, list[str]]] = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["type"] == "row":
            rows.append((panel["title"], []))
        else:
            rows[-1][1].append(panel["title"])
    lines = ["| row | panels |", "|---|---|"]
    lines += [f"| {title} | {', '.join(panels)} |" for title, panels in rows]
    return "\n".join(lines) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "trainer-metrics": lambda: metric_table(TRAINER_METRICS),
    "dataset-metrics": lambda: metric_table(DATASET_METRICS),
    "operator-metrics": lambda: metric_table(OPERATOR_METRICS),
    "mfu-peaks": peak_table,
    "dashboard-panels": dashboard_table,
}


def regenerate(text: str) -> str:
    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in GENERATORS:
            raise KeyError(f"docs/metrics.md has an unknown generated block {name!r}; known: {sorted(GENERATORS)}")
        return f"{match.group(1)}{GENERATORS[name]()}{match.group(4)}"

    return BLOCK.sub(fill, text)


def test_every_generated_block_is_present() -> None:
    assert {m["name"] for m in BLOCK.finditer(DOC.read_text())} == set(GENERATORS)


def test_doc_matches_the_contract() -> None:
    text = DOC.read_text()
    assert text == regenerate(text), "docs/metrics.md is stale: run `python tests/test_metrics_doc.py`"


def test_doc_lists_every_metric_with_its_type_and_labels() -> None:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`wanloom_"):
            rows[cells[0].strip("`")] = cells
    for m in TRAINER_METRICS + DATASET_METRICS + OPERATOR_METRICS:
        assert m.name in rows, f"{m.name} missing from docs/metrics.md"
        assert rows[m.name][1] == m.kind
        assert re.findall(r"`([a-z_]+)`", rows[m.name][2]) == list(m.labels)
    assert not any("`job`" in cells[2] for cells in rows.values())


if __name__ == "__main__":
    DOC.write_text(regenerate(DOC.read_text()))
    sys.stdout.write(f"regenerated {DOC}\n")
