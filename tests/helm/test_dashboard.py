"""The Grafana dashboard shipped in the chart: contract metric names only, the required panels, sane layout.

Its PromQL runs against a real Prometheus in tests/e2e/test_prometheus.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from wanloom_api.metrics import ALL_METRICS, DATASET_METRICS, OPERATOR_METRICS

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "wanloom" / "dashboards" / "wanloom.json"
CONTRACT = {m.name: m for m in ALL_METRICS}
METRIC_TOKEN = re.compile(r"\bwanloom_[a-z0-9_]+")


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def _exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _panels() for t in p["targets"]]


def _contract_name(token: str) -> str | None:
    """The contract metric a PromQL token refers to (histograms are queried through _bucket/_sum/_count)."""
    if token in CONTRACT:
        return token
    for suffix in ("_bucket", "_sum", "_count"):
        base = token.removesuffix(suffix)
        if token.endswith(suffix) and CONTRACT.get(base) and CONTRACT[base].kind == "histogram":
            return base
    return None


def test_every_query_uses_only_contract_metrics() -> None:
    for title, expr in _exprs():
        tokens = METRIC_TOKEN.findall(expr)
        assert tokens, f"{title}: no wanloom metric in {expr}"
        unknown = [t for t in tokens if _contract_name(t) is None]
        assert not unknown, f"{title}: {unknown} are not in wanloom_api.metrics"


REQUIRED = {
    "wanloom_step_time_seconds",
    "wanloom_load_imbalance_cv",
    "wanloom_compute_load_cv",
    "wanloom_tokens_per_second",
    "wanloom_mfu_ratio",
    "wanloom_loss",
    "wanloom_expert_samples_total",
    "wanloom_last_checkpoint_timestamp_seconds",
    "wanloom_skipped_samples_total",
    "wanloom_skipped_distinct_samples_total",
    "wanloom_last_checkpoint_duration_seconds",
    "wanloom_operator_job_restarts",
}
REQUIRED |= {m.name for m in DATASET_METRICS}
REQUIRED |= {m.name for m in OPERATOR_METRICS if not m.name.startswith("wanloom_operator_job_")}


def test_required_panels_are_there() -> None:
    used = {_contract_name(t) for _, expr in _exprs() for t in METRIC_TOKEN.findall(expr)}
    assert used >= REQUIRED, REQUIRED - used
    titles = {p["title"] for p in _panels()}
    assert {
        "Step time p50 / p95",
        "Steps per second",
        "ETA",
        "Expert split",
        "Checkpoint age",
        "Checkpoint duration (last save)",
        "Skipped samples by reason",
        "JobSet restarts",
        "MFU",
    } <= titles


def test_trainer_queries_follow_the_namespace_and_trainingjob_variables() -> None:
    for title, expr in _exprs():
        if "wanloom_operator_" in expr:
            continue
        # A LatentDataset's pods label their series with the dataset, not a TrainingJob.
        owner = "latentdataset" if "wanloom_prepare_" in expr else "trainingjob"
        for selector in re.findall(r"wanloom_[a-z0-9_]+\{([^}]*)\}", expr):
            assert 'namespace=~"$namespace"' in selector and f'{owner}=~"${owner}"' in selector, title
        assert not re.search(r"\bjob\s*(=|!=|=~|!~)", expr), f"{title}: the TrainingJob label is `trainingjob`"


def test_variables_and_datasource() -> None:
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    assert list(variables) == ["datasource", "namespace", "trainingjob", "latentdataset"]
    assert variables["datasource"]["query"] == "prometheus"
    assert "trainingjob)" in variables["trainingjob"]["definition"]
    assert "$namespace" in variables["trainingjob"]["definition"]
    assert "latentdataset)" in variables["latentdataset"]["definition"]
    for name in ("namespace", "trainingjob", "latentdataset"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    for panel in _panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_layout_has_unique_ids_and_no_overlapping_panels() -> None:
    panels = _dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine


@pytest.mark.parametrize("token", ["wanloom_step_time_seconds_bucket", "wanloom_expert_samples_total"])
def test_contract_name_resolution(token: str) -> None:
    assert _contract_name(token) is not None
    assert _contract_name("wanloom_loss_bucket") is None  # a gauge has no buckets
