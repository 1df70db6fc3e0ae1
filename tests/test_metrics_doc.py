"""docs/metrics.md stays in step with the metrics contract and the MFU peak table.

The tables between ``<!-- generated:NAME -->`` and ``<!-- end generated -->`` are produced here from
``wanloom_api.metrics`` and ``wanloom_trainer.flops``. After changing either, regenerate them with

    PYTHONPATH=operator:trainer_images .venv/bin/python tests/test_metrics_doc.py
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from wanloom_api.metrics import OPERATOR_METRICS, TRAINER_METRICS, MetricDef
from wanloom_trainer.flops import ACCELERATORS

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
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
    rows = ["| accelerator key | dense bf16 peak per device | device |", "|---|---|---|"]
    for acc in ACCELERATORS.values():
        rows.append(f"| `{acc.name}` | {acc.peak_bf16_flops / 1e12:,.1f} TFLOP/s | {acc.note} |")
    return "\n".join(rows) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "trainer-metrics": lambda: metric_table(TRAINER_METRICS),
    "operator-metrics": lambda: metric_table(OPERATOR_METRICS),
    "mfu-peaks": peak_table,
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
    for m in TRAINER_METRICS + OPERATOR_METRICS:
        assert m.name in rows, f"{m.name} missing from docs/metrics.md"
        assert rows[m.name][1] == m.kind
        assert re.findall(r"`([a-z_]+)`", rows[m.name][2]) == list(m.labels)
    assert not any("`job`" in cells[2] for cells in rows.values())


if __name__ == "__main__":
    DOC.write_text(regenerate(DOC.read_text()))
    sys.stdout.write(f"regenerated {DOC}\n")
