"""TrainerMetrics: what each rank exports, the derived numbers, validation and the HTTP endpoint."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import urllib.request
from dataclasses import fields, replace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from wanloom_api.metrics import TRAINER_METRICS
from wanloom_trainer import flops
from wanloom_trainer.metrics import StepLog, StepRecord, TrainerMetrics, expert_label

JOB = "tiny-test"


LOG = StepLog(step=6, loss=0.59, expert_loss={0: 0.42, 1: 0.17}, expert_samples={0: 3, 1: 5},
              grad_norm={0: 1.5, 1: 0.9}, learning_rate={0: 1e-4, 1: 2e-4}, step_time_s=0.5, data_wait_s=0.0,
              tokens=4096, model_flops=3.0e15, mfu=None)  # fmt: skip
RECORD = StepRecord(
    log=LOG,
    total_steps=100,
    num_devices=4,
    accelerator="h100",
    rank_step_times_s=[0.5, 0.4, 0.6, 0.5],
    rank_predicted_costs=[1.0, 1.1, 0.9, 1.0],
    rank_busy_s=[0.40, 0.30, 0.55, 0.35],
    rank_predicted_busy_s=[0.38, 0.33, 0.50, 0.36],
)


def _record(**overrides: object) -> StepRecord:
    """RECORD with fields of either the step's log or the record replaced."""
    own = {f.name for f in fields(StepLog)}
    log = replace(LOG, **{k: v for k, v in overrides.items() if k in own})
    return replace(RECORD, log=log, **{k: v for k, v in overrides.items() if k not in own})


def _metrics(rank: int = 0) -> TrainerMetrics:
    return TrainerMetrics(JOB, rank, registry=CollectorRegistry())


def _value(m: TrainerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {"trainingjob": JOB, **labels})


def _exported_names(m: TrainerMetrics) -> set[str]:
    text = generate_latest(m.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _record_everything(m: TrainerMetrics) -> None:
    m.record_expected_shares((0.4167, 0.5833))
    m.record_step(_record())
    m.record_checkpoint(step=7, duration_s=3.0, timestamp=1.8e9)
    m.record_skipped("corrupt", 2)
    m.record_data_wait(0.02)
    m.record_cost_model({"in_use": 0.2, "refit": 0.05, "analytic": 0.08}, "accepted")
    m.record_validation({0: 0.31, 1: 0.12}, 4.5)


def test_rank0_exports_every_trainer_metric_of_the_contract() -> None:
    m = _metrics(0)
    _record_everything(m)
    names = _exported_names(m)
    for spec in TRAINER_METRICS:
        wanted = f"{spec.name}_count" if spec.kind == "histogram" else spec.name
        assert wanted in names, spec.name
    assert not {n for n in names if n.endswith("_created")}


def test_other_ranks_export_only_their_own_series() -> None:
    m = _metrics(3)
    _record_everything(m)
    names = {n for n in _exported_names(m) if n.startswith("wanloom_")}
    own = {s.name for s in TRAINER_METRICS if s.exported_by == "trainer"}
    assert {n.removesuffix("_count").removesuffix("_sum").removesuffix("_bucket") for n in names} == own
    assert _value(m, "wanloom_step_time_seconds_sum", rank="3") == pytest.approx(0.5)


def test_cross_rank_gauges_use_the_slowest_rank_and_population_cv() -> None:
    m = _metrics(0)
    record = _record()
    m.record_step(record)
    busy = np.array(record.rank_busy_s)  # not the step times: those end in the gradient sync, equal on all ranks
    costs = np.array(record.rank_predicted_costs)
    assert _value(m, "wanloom_load_imbalance_cv") == pytest.approx(busy.std() / busy.mean())
    assert _value(m, "wanloom_compute_load_cv") == pytest.approx(costs.std() / costs.mean())
    assert _value(m, "wanloom_straggler_overhead_ratio") == pytest.approx(busy.max() / busy.mean() - 1)
    for rank, (measured, predicted) in enumerate(zip(record.rank_busy_s, record.rank_predicted_busy_s, strict=True)):
        assert _value(m, "wanloom_rank_busy_seconds", rank=str(rank)) == measured
        assert _value(m, "wanloom_rank_predicted_busy_seconds", rank=str(rank)) == predicted
    assert _value(m, "wanloom_tokens_per_second") == pytest.approx(4096 / 0.6)
    assert _value(m, "wanloom_step_samples") == sum(record.log.expert_samples.values()) == 8
    assert _value(m, "wanloom_step_tokens") == record.log.tokens == 4096
    assert _value(m, "wanloom_mfu_ratio") == pytest.approx(flops.mfu(3.0e15, 0.6, 4, "h100"))
    assert _value(m, "wanloom_step") == 7
    assert _value(m, "wanloom_total_steps") == 100


def test_cost_model_errors_and_refit_outcomes() -> None:
    m = _metrics(0)
    assert _value(m, "wanloom_cost_model_refits_total", outcome="rejected") == 0  # present before the first refit
    m.record_cost_model({"in_use": 0.3, "refit": None, "analytic": None}, None)
    assert _value(m, "wanloom_cost_model_error_ratio", model="in_use") == 0.3
    assert _value(m, "wanloom_cost_model_error_ratio", model="refit") is None
    m.record_cost_model({"in_use": 0.25, "refit": 0.12, "analytic": 0.08}, "rejected")
    assert _value(m, "wanloom_cost_model_refits_total", outcome="rejected") == 1
    assert _value(m, "wanloom_cost_model_error_ratio", model="analytic") == 0.08
    with pytest.raises(ValueError, match="outcome 'maybe'"):
        m.record_cost_model({}, "maybe")
    with pytest.raises(ValueError, match="model 'fitted'"):
        m.record_cost_model({"fitted": 0.1}, None)
    other = _metrics(2)
    other.record_cost_model({"in_use": 0.3}, "accepted")  # rank 0's alone
    assert _value(other, "wanloom_cost_model_error_ratio", model="in_use") is None


def test_single_process_run_uses_its_own_step_time() -> None:
    m = _metrics(0)
    m.record_step(_record(rank_step_times_s=None, rank_predicted_costs=None, rank_busy_s=None, step_time_s=2.0))
    assert _value(m, "wanloom_tokens_per_second") == pytest.approx(2048)
    assert _value(m, "wanloom_load_imbalance_cv") is None  # nothing measured across ranks: no value, not a fake 0


def test_expert_series_use_expert_labels_and_count_updates() -> None:
    m = _metrics(0)
    m.record_step(_record())
    m.record_step(_record(step=7, expert_samples={0: 4, 1: 0}, expert_loss={0: 0.4}))
    high, low = expert_label(0), expert_label(1)
    assert (high, low) == ("high_noise", "low_noise")
    assert _value(m, "wanloom_loss", expert=high) == pytest.approx(0.4)
    assert _value(m, "wanloom_loss", expert=low) == pytest.approx(0.17)  # last value it reported
    assert _value(m, "wanloom_expert_samples_total", expert=high) == 7
    assert _value(m, "wanloom_expert_samples_total", expert=low) == 5
    assert _value(m, "wanloom_expert_steps_total", expert=high) == 2
    assert _value(m, "wanloom_expert_steps_total", expert=low) == 1
    assert _value(m, "wanloom_learning_rate", expert=low) == pytest.approx(2e-4)
    assert _value(m, "wanloom_grad_norm", expert=high) == pytest.approx(1.5)


def test_expert_with_no_samples_yet_is_exported_as_zero() -> None:
    m = _metrics(0)
    m.record_step(_record(expert_samples={0: 8, 1: 0}))
    assert _value(m, "wanloom_expert_samples_total", expert="low_noise") == 0


def test_unknown_expert_id_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"expert id 2 has no label; valid ids: 0..1"):
        _metrics(0).record_step(_record(expert_loss={2: 0.1}))


def test_checkpoint_and_loader_metrics() -> None:
    m = _metrics(0)
    _record_everything(m)
    assert _value(m, "wanloom_last_checkpoint_step") == 7
    assert _value(m, "wanloom_last_checkpoint_timestamp_seconds") == pytest.approx(1.8e9)
    assert _value(m, "wanloom_checkpoint_duration_seconds_sum") == pytest.approx(3.0)
    assert _value(m, "wanloom_skipped_samples_total", reason="corrupt") == 2
    assert _value(m, "wanloom_data_wait_seconds_count", rank="0") == 1
    assert _value(m, "wanloom_validation_loss", expert="high_noise") == pytest.approx(0.31)
    assert _value(m, "wanloom_validation_loss", expert="low_noise") == pytest.approx(0.12)
    assert _value(m, "wanloom_validation_seconds") == pytest.approx(4.5)


def test_unknown_accelerator_skips_mfu_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    m = _metrics(0)
    with caplog.at_level(logging.WARNING):
        m.record_step(_record(accelerator="abacus"))
        m.record_step(_record(accelerator="abacus"))
    assert _value(m, "wanloom_mfu_ratio") is None
    assert _value(m, "wanloom_tokens_per_second") is not None
    warnings = [r for r in caplog.records if "wanloom_mfu_ratio" in r.getMessage()]
    assert len(warnings) == 1 and "abacus" in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"step": -1}, "step"),
        ({"total_steps": 0}, "total_steps"),
        ({"step_time_s": 0.0}, "step_time_s"),
        ({"step_time_s": float("nan")}, "step_time_s"),
        ({"tokens": -5}, "tokens"),
        ({"model_flops": -1.0}, "model_flops"),
        ({"num_devices": 0}, "num_devices"),
        ({"expert_samples": {0: -1}}, "expert_samples"),
    ],
    ids=lambda x: str(x),
)
def test_bad_step_record_names_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"Step(Record|Log)\.{field} must be"):
        _record(**overrides)


@pytest.mark.parametrize(
    ("field", "values"),
    [
        ("rank_step_times_s", [0.5, -0.1]),
        ("rank_step_times_s", [0.5, float("nan")]),
        ("rank_predicted_costs", [1.0, float("inf")]),
        ("rank_busy_s", [0.4, -0.1]),
    ],
    ids=["negative-time", "nan-time", "inf-cost", "negative-busy"],
)
def test_bad_per_rank_values_name_the_field(field: str, values: list[float]) -> None:
    with pytest.raises(ValueError, match=rf"StepRecord\.{field} must be one finite value >= 0 per rank"):
        _metrics(0).record_step(_record(**{field: values}))


def test_balanced_step_has_zero_cv() -> None:
    m = _metrics(0)
    m.record_step(_record(rank_busy_s=[0.5] * 4, rank_predicted_costs=[2.0] * 4))
    assert _value(m, "wanloom_load_imbalance_cv") == 0
    assert _value(m, "wanloom_compute_load_cv") == 0
    assert _value(m, "wanloom_straggler_overhead_ratio") == 0


def test_bad_calls_are_rejected() -> None:
    m = _metrics(0)
    with pytest.raises(ValueError, match="n and distinct must be >= 0"):
        m.record_skipped("corrupt", -1)
    with pytest.raises(ValueError, match="reason must be a non-empty"):
        m.record_skipped("")
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        m.record_data_wait(-0.1)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        TrainerMetrics(JOB, -1, registry=CollectorRegistry())
    with pytest.raises(ValueError, match="trainingjob"):
        TrainerMetrics("", 0, registry=CollectorRegistry())


def test_two_exporters_in_one_process_do_not_clash() -> None:
    a, b = TrainerMetrics("a", 0), TrainerMetrics("b", 0)
    assert a.registry is not b.registry
    assert "process_resident_memory_bytes" in _exported_names(a)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_exposes_metrics_over_http_without_a_job_label() -> None:
    m = _metrics(0)
    port = _free_port()
    m.serve(port, "127.0.0.1")
    try:
        _record_everything(m)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    assert families["wanloom_mfu_ratio"].type == "gauge"
    assert all("job" not in s.labels for f in families.values() for s in f.samples)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_importing_the_exporter_pulls_in_no_framework() -> None:
    code = "import sys, wanloom_trainer.metrics; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = {name.split(".")[0] for name in out.stdout.split()}
    assert not loaded & {"jax", "torch", "flax", "triton", "kopf", "kubernetes"}


def test_expert_shares_expected_and_so_far() -> None:
    m = _metrics(0)
    m.record_expected_shares((0.4167, 0.5833))
    m.record_step(_record(expert_samples={0: 3, 1: 5}))
    m.record_step(_record(step=7, expert_samples={0: 1, 1: 3}))
    assert _value(m, "wanloom_expert_expected_share_ratio", expert="high_noise") == pytest.approx(0.4167)
    assert _value(m, "wanloom_expert_expected_share_ratio", expert="low_noise") == pytest.approx(0.5833)
    assert _value(m, "wanloom_expert_sample_share_ratio", expert="high_noise") == pytest.approx(4 / 12)
    assert _value(m, "wanloom_expert_sample_share_ratio", expert="low_noise") == pytest.approx(8 / 12)
