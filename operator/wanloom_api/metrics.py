"""The metrics contract: every Prometheus series wanloom exports (docs/metrics.md is generated from this table).

One prefix (``wanloom_``), base units (seconds, ratios 0-1), counters end in ``_total``. No label is called ``job``:
Prometheus' own target label would rename it to ``exported_job``; the TrainingJob's name is ``trainingjob``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

STEP_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 45, 60, 120, 300)
SHORT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
CHECKPOINT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200)


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    exported_by: Literal["trainer", "trainer rank 0", "operator"] = "trainer rank 0"


_T = ("trainingjob",)
_TR = ("trainingjob", "rank")
_TE = ("trainingjob", "expert")

TRAINER_METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        "wanloom_step_time_seconds",
        "histogram",
        "Wall time of one training step on this rank.",
        _TR,
        STEP_TIME_BUCKETS,
        "trainer",
    ),
    MetricDef(
        "wanloom_data_wait_seconds",
        "histogram",
        "Time a step waited for its input on this rank.",
        _TR,
        SHORT_BUCKETS,
        "trainer",
    ),
    MetricDef(
        "wanloom_load_imbalance_cv",
        "gauge",
        "Coefficient of variation of the ranks' measured busy times of the last step (0 = balanced).",
        _T,
    ),
    MetricDef(
        "wanloom_rank_busy_seconds",
        "gauge",
        "Each rank's measured forward and backward time of the last step, before the gradient update.",
        _TR,
    ),
    MetricDef(
        "wanloom_rank_predicted_busy_seconds",
        "gauge",
        "The cost model's prediction of each rank's busy time of the last step, in the model's unit (seconds "
        "unless spec.adaptiveLoad gives only an exponent).",
        _TR,
    ),
    MetricDef(
        "wanloom_cost_model_error_ratio",
        "gauge",
        "Relative RMS error against the run's measured slot times: the model in use (after one best scale "
        "factor), and the k-fold held-out error of the online refit and of the analytic FLOP model fitted to the "
        "same timings.",
        ("trainingjob", "model"),
    ),
    MetricDef(
        "wanloom_cost_model_refits_total",
        "counter",
        "Online refits of the cost model, by outcome: accepted, rejected (not better than the analytic FLOP model) "
        "or kept (no better than the model in use).",
        ("trainingjob", "outcome"),
    ),
    MetricDef(
        "wanloom_compute_load_cv",
        "gauge",
        "Coefficient of variation of the per-rank compute load predicted by the AdaptiveLoad cost model.",
        _T,
    ),
    MetricDef(
        "wanloom_straggler_overhead_ratio",
        "gauge",
        "Slowest rank's busy time over the mean rank's, minus one, for the last step.",
        _T,
    ),
    MetricDef("wanloom_tokens_per_second", "gauge", "Transformer tokens trained per second, all ranks.", _T),
    MetricDef(
        "wanloom_mfu_ratio",
        "gauge",
        "Model FLOP utilisation (0-1): model FLOPs per second over the dense bf16 peak of all devices "
        "(formula and peaks in docs/metrics.md).",
        _T,
    ),
    MetricDef("wanloom_loss", "gauge", "Mean flow-matching loss of the last step, per expert.", _TE),
    MetricDef("wanloom_grad_norm", "gauge", "Global gradient norm of the last step, per expert.", _TE),
    MetricDef("wanloom_learning_rate", "gauge", "Learning rate of the last step, per expert.", _TE),
    MetricDef("wanloom_expert_steps_total", "counter", "Optimizer steps that updated each expert.", _TE),
    MetricDef("wanloom_expert_samples_total", "counter", "Training samples routed to each expert.", _TE),
    MetricDef(
        "wanloom_expert_expected_share_ratio",
        "gauge",
        "Fraction of samples the configured timestep distribution routes to each expert (0-1).",
        _TE,
    ),
    MetricDef(
        "wanloom_expert_sample_share_ratio",
        "gauge",
        "Fraction of this run's samples routed to each expert so far (0-1); compare with the expected share.",
        _TE,
    ),
    MetricDef("wanloom_step", "gauge", "Last completed optimizer step.", _T),
    MetricDef("wanloom_total_steps", "gauge", "Configured number of optimizer steps.", _T),
    MetricDef(
        "wanloom_skipped_samples_total",
        "counter",
        "Planned rows the loader could not fill (corrupt or missing samples), counted per draw.",
        ("trainingjob", "reason"),
        exported_by="trainer",
    ),
    MetricDef(
        "wanloom_skipped_distinct_samples_total",
        "counter",
        "Distinct corrupt or missing samples skipped (a sample drawn again is not counted again); "
        "spec.data.maxBadSamples bounds this one.",
        ("trainingjob", "reason"),
        exported_by="trainer",
    ),
    MetricDef(
        "wanloom_storage_outage_seconds",
        "gauge",
        "How long dataset storage has been unreachable (0 when healthy); the run fails past "
        "spec.data.storageOutageSeconds.",
        _T,
        exported_by="trainer",
    ),
    MetricDef("wanloom_last_checkpoint_step", "gauge", "Step of the last completed checkpoint.", _T),
    MetricDef(
        "wanloom_last_checkpoint_timestamp_seconds",
        "gauge",
        "Unix time of the last completed checkpoint (checkpoint age = time() - this).",
        _T,
    ),
    MetricDef(
        "wanloom_last_checkpoint_duration_seconds",
        "gauge",
        "Wall time of the last completed checkpoint save, from its start to its commit.",
        _T,
    ),
    MetricDef(
        "wanloom_checkpoint_duration_seconds", "histogram", "Wall time of a checkpoint save.", _T, CHECKPOINT_BUCKETS
    ),
)

OPERATOR_METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        "wanloom_operator_reconcile_duration_seconds",
        "histogram",
        "Duration of one operator handler call.",
        ("handler",),
        SHORT_BUCKETS,
        "operator",
    ),
    MetricDef(
        "wanloom_operator_reconcile_errors_total",
        "counter",
        "Handler calls that raised.",
        ("handler", "kind"),
        exported_by="operator",
    ),
    MetricDef(
        "wanloom_operator_trainingjobs",
        "gauge",
        "TrainingJobs known to the operator, by phase.",
        ("phase",),
        exported_by="operator",
    ),
    MetricDef(
        "wanloom_operator_job_step_time_seconds",
        "gauge",
        "Step time mirrored from a TrainingJob's status.",
        ("namespace", "trainingjob"),
        exported_by="operator",
    ),
    MetricDef(
        "wanloom_operator_job_load_imbalance_cv",
        "gauge",
        "Load-imbalance CV mirrored from a TrainingJob's status.",
        ("namespace", "trainingjob"),
        exported_by="operator",
    ),
    MetricDef(
        "wanloom_operator_job_restarts",
        "gauge",
        "JobSet restarts of a TrainingJob (status.restarts; preemptions included).",
        ("namespace", "trainingjob"),
        exported_by="operator",
    ),
)

ALL_METRICS = TRAINER_METRICS + OPERATOR_METRICS
SKIP_REASONS = ("missing", "corrupt")  # values of the `reason` label of the skipped-samples counters
EXPERT_LABELS = ("high_noise", "low_noise")  # values of the `expert` label, indexed by routing's expert id
COST_MODEL_LABELS = ("in_use", "refit", "analytic")  # values of the `model` label of the cost-model error gauge
REFIT_OUTCOMES = ("accepted", "rejected", "kept")  # values of the `outcome` label of the refit counter


def metric(name: str) -> MetricDef:
    for m in ALL_METRICS:
        if m.name == name:
            return m
    raise KeyError(f"{name} is not in the metrics contract")
