"""Every row of the metrics contract becomes a collector that exposes exactly the contract's name and labels."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from wanloom_api.metrics import ALL_METRICS, MetricDef
from wanloom_trainer.metrics.collectors import build_collector


def _exercise(spec: MetricDef, collector) -> None:  # type: ignore[no-untyped-def]
    child = collector.labels(*[f"v{i}" for i in range(len(spec.labels))]) if spec.labels else collector
    {"counter": lambda: child.inc(2), "gauge": lambda: child.set(3), "histogram": lambda: child.observe(0.2)}[
        spec.kind
    ]()


@pytest.mark.parametrize("spec", ALL_METRICS, ids=[m.name for m in ALL_METRICS])
def test_row_becomes_collector_with_contract_name_type_and_labels(spec: MetricDef) -> None:
    registry = CollectorRegistry()
    _exercise(spec, build_collector(spec, registry))
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    assert len(families) == 1
    family = families[0]
    assert family.type == spec.kind
    sample_names = {s.name for s in family.samples}
    if spec.kind == "histogram":
        assert {f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count"} <= sample_names
        buckets = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")})
        assert buckets[:-1] == sorted(spec.buckets or ())  # the last one is +Inf
    else:
        assert spec.name in sample_names
    for sample in family.samples:
        assert set(sample.labels) - {"le"} == set(spec.labels)
        assert "job" not in sample.labels


def test_histogram_without_buckets_is_rejected() -> None:
    spec = MetricDef("wanloom_x_seconds", "histogram", "x", ("trainingjob",))
    with pytest.raises(ValueError, match="wanloom_x_seconds has no buckets"):
        build_collector(spec, CollectorRegistry())
