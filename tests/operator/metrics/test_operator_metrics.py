"""OperatorMetrics: names from the metrics contract, handler timing and errors, jobs by phase, per-job gauges."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from wanloom_api.metrics import OPERATOR_METRICS
from wanloom_operator.metrics.operator import OperatorMetrics


def _value(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_every_contract_metric_is_exported() -> None:
    text = generate_latest(OperatorMetrics().registry).decode()
    for definition in OPERATOR_METRICS:
        assert f"# TYPE {definition.name} {definition.kind}" in text


def test_handler_timing_and_errors() -> None:
    metrics = OperatorMetrics()
    with metrics.handler("create"):
        pass
    with pytest.raises(KeyError), metrics.handler("create"):
        raise KeyError("x")
    with pytest.raises(TimeoutError), metrics.handler("create", expected=(TimeoutError,)):
        raise TimeoutError
    assert _value(metrics, "wanloom_operator_reconcile_duration_seconds_count", handler="create") == 3
    assert _value(metrics, "wanloom_operator_reconcile_errors_total", handler="create", kind="KeyError") == 1
    assert _value(metrics, "wanloom_operator_reconcile_errors_total", handler="create", kind="TimeoutError") is None


def test_jobs_by_phase_and_per_job_gauges() -> None:
    metrics = OperatorMetrics()
    metrics.observe_job(
        "ns", "a", {"phase": "Running", "restarts": 2, "progress": {"stepTimeSeconds": 2.5, "loadImbalanceCV": 0.1}}
    )
    metrics.observe_job("ns", "b", {"phase": "Running"})
    metrics.observe_job("ns", "c", {})
    assert _value(metrics, "wanloom_operator_trainingjobs", phase="Running") == 2
    assert _value(metrics, "wanloom_operator_trainingjobs", phase="Unknown") == 1
    assert _value(metrics, "wanloom_operator_trainingjobs", phase="Failed") == 0
    assert _value(metrics, "wanloom_operator_job_step_time_seconds", namespace="ns", trainingjob="a") == 2.5
    assert _value(metrics, "wanloom_operator_job_restarts", namespace="ns", trainingjob="a") == 2
    assert _value(metrics, "wanloom_operator_job_restarts", namespace="ns", trainingjob="b") is None
    metrics.observe_job("ns", "a", {"phase": "Succeeded", "progress": {"stepTimeSeconds": 2.5}})
    metrics.forget_job("ns", "a")
    assert _value(metrics, "wanloom_operator_trainingjobs", phase="Running") == 1
    assert _value(metrics, "wanloom_operator_job_step_time_seconds", namespace="ns", trainingjob="a") is None
    assert _value(metrics, "wanloom_operator_job_restarts", namespace="ns", trainingjob="a") is None
    assert metrics.known_jobs() == 2
