"""The metrics contract: every Prometheus series wanloom exports (docs/metrics.md is generated from this table).

One prefix (``wanloom_``), base units (seconds, ratios 0-1), counters end in ``_total``. No label is called ``job``:
Prometheus' own target label would rename it to ``exported_job``; the TrainingJob's name is ``trainingjob``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

STEP_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 45, 60, 120, 300)
SHORT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
CHECKPOINT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200)


class Metric(StrEnum):
    """Every series name, defined once: code refers to ``Metric.STEP``, never to a string."""

    STEP_TIME_SECONDS = "wanloom_step_time_seconds"
    DATA_WAIT_SECONDS = "wanloom_data_wait_seconds"
    LOAD_IMBALANCE_CV = "wanloom_load_imbalance_cv"
    RANK_BUSY_SECONDS = "wanloom_rank_busy_seconds"
    RANK_PREDICTED_BUSY_SECONDS = "wanloom_rank_predicted_busy_seconds"
    COST_MODEL_ERROR_RATIO = "wanloom_cost_model_error_ratio"
    COST_MODEL_REFITS_TOTAL = "wanloom_cost_model_refits_total"
    COMPUTE_LOAD_CV = "wanloom_compute_load_cv"
    STRAGGLER_OVERHEAD_RATIO = "wanloom_straggler_overhead_ratio"
    TOKENS_PER_SECOND = "wanloom_tokens_per_second"
    STEP_SAMPLES = "wanloom_step_samples"
    STEP_TOKENS = "wanloom_step_tokens"
    MFU_RATIO = "wanloom_mfu_ratio"
    LOSS = "wanloom_loss"
    GRAD_NORM = "wanloom_grad_norm"
    LEARNING_RATE = "wanloom_learning_rate"
    VALIDATION_LOSS = "wanloom_validation_loss"
    VALIDATION_SECONDS = "wanloom_validation_seconds"
    EXPERT_STEPS_TOTAL = "wanloom_expert_steps_total"
    EXPERT_SAMPLES_TOTAL = "wanloom_expert_samples_total"
    EXPERT_EXPECTED_SHARE_RATIO = "wanloom_expert_expected_share_ratio"
    EXPERT_SAMPLE_SHARE_RATIO = "wanloom_expert_sample_share_ratio"
    STEP = "wanloom_step"
    TOTAL_STEPS = "wanloom_total_steps"
    SKIPPED_SAMPLES_TOTAL = "wanloom_skipped_samples_total"
    SKIPPED_DISTINCT_SAMPLES_TOTAL = "wanloom_skipped_distinct_samples_total"
    STORAGE_OUTAGE_SECONDS = "wanloom_storage_outage_seconds"
    LAST_CHECKPOINT_STEP = "wanloom_last_checkpoint_step"
    LAST_CHECKPOINT_TIMESTAMP_SECONDS = "wanloom_last_checkpoint_timestamp_seconds"
    LAST_CHECKPOINT_DURATION_SECONDS = "wanloom_last_checkpoint_duration_seconds"
    CHECKPOINT_DURATION_SECONDS = "wanloom_checkpoint_duration_seconds"
    PREPARE_STAGE_SECONDS_TOTAL = "wanloom_prepare_stage_seconds_total"
    PREPARE_SAMPLES_TOTAL = "wanloom_prepare_samples_total"
    PREPARE_SKIPPED_TOTAL = "wanloom_prepare_skipped_total"
    PREPARE_UNITS_TOTAL = "wanloom_prepare_units_total"
    OPERATOR_RECONCILE_DURATION_SECONDS = "wanloom_operator_reconcile_duration_seconds"
    OPERATOR_RECONCILE_ERRORS_TOTAL = "wanloom_operator_reconcile_errors_total"
    OPERATOR_TRAININGJOBS = "wanloom_operator_trainingjobs"
    OPERATOR_JOB_STEP_TIME_SECONDS = "wanloom_operator_job_step_time_seconds"
    OPERATOR_JOB_LOAD_IMBALANCE_CV = "wanloom_operator_job_load_imbalance_cv"
    OPERATOR_JOB_RESTARTS = "wanloom_operator_job_restarts"


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    exported_by: Literal["trainer", "trainer rank 0", "dataset pod", "operator"] = "trainer rank 0"


_T = ("trainingjob",)
_TR = ("trainingjob", "rank")
_TE = ("trainingjob", "expert")

TRAINER_METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        Metric.STEP_TIME_SECONDS,
        "histogram",
        "Wall time of one training step on this rank.",
        _TR,
        STEP_TIME_BUCKETS,
        "trainer",
    ),
    MetricDef(
        Metric.DATA_WAIT_SECONDS,
        "histogram",
        "Time a step waited for its input on this rank.",
        _TR,
        SHORT_BUCKETS,
        "trainer",
    ),
    MetricDef(
        Metric.LOAD_IMBALANCE_CV,
        "gauge",
        "Coefficient of variation of the ranks' measured busy times of the last step (0 = balanced).",
        _T,
    ),
    MetricDef(
        Metric.RANK_BUSY_SECONDS,
        "gauge",
        "Each rank's measured forward and backward time of the last step, before the gradient update.",
        _TR,
    ),
    MetricDef(
        Metric.RANK_PREDICTED_BUSY_SECONDS,
        "gauge",
        "The cost model's prediction of each rank's busy time of the last step, in the model's unit (seconds "
        "unless spec.adaptiveLoad gives only an exponent).",
        _TR,
    ),
    MetricDef(
        Metric.COST_MODEL_ERROR_RATIO,
        "gauge",
        "Relative RMS error against the run's measured slot times: the model in use (after one best scale "
        "factor), and the k-fold held-out error of the online refit and of the analytic FLOP model fitted to the "
        "same timings.",
        ("trainingjob", "model"),
    ),
    MetricDef(
        Metric.COST_MODEL_REFITS_TOTAL,
        "counter",
        "Online refits of the cost model, by outcome: accepted, rejected (not better than the analytic FLOP model) "
        "or kept (no better than the model in use).",
        ("trainingjob", "outcome"),
    ),
    MetricDef(
        Metric.COMPUTE_LOAD_CV,
        "gauge",
        "Coefficient of variation of the per-rank compute load predicted by the AdaptiveLoad cost model.",
        _T,
    ),
    MetricDef(
        Metric.STRAGGLER_OVERHEAD_RATIO,
        "gauge",
        "Slowest rank's busy time over the mean rank's, minus one, for the last step.",
        _T,
    ),
    MetricDef(Metric.TOKENS_PER_SECOND, "gauge", "Transformer tokens trained per second, all ranks.", _T),
    MetricDef(
        Metric.STEP_SAMPLES,
        "gauge",
        "Samples the last step trained on, all ranks (spec.training.globalBatch with stepBudget samples).",
        _T,
    ),
    MetricDef(Metric.STEP_TOKENS, "gauge", "Transformer tokens the last step trained on, all ranks.", _T),
    MetricDef(
        Metric.MFU_RATIO,
        "gauge",
        "Model FLOP utilisation (0-1): model FLOPs per second over the dense bf16 peak of all devices "
        "(formula and peaks in docs/metrics.md).",
        _T,
    ),
    MetricDef(Metric.LOSS, "gauge", "Mean flow-matching loss of the last step, per expert.", _TE),
    MetricDef(Metric.GRAD_NORM, "gauge", "Global gradient norm of the last step, per expert.", _TE),
    MetricDef(Metric.LEARNING_RATE, "gauge", "Learning rate of the last step, per expert.", _TE),
    MetricDef(
        Metric.VALIDATION_LOSS,
        "gauge",
        "Mean flow-matching loss of the held-out samples at the fixed timesteps of each expert's band (last "
        "validation).",
        _TE,
    ),
    MetricDef(Metric.VALIDATION_SECONDS, "gauge", "Wall time of the last validation (not in step time).", _T),
    MetricDef(Metric.EXPERT_STEPS_TOTAL, "counter", "Optimizer steps that updated each expert.", _TE),
    MetricDef(Metric.EXPERT_SAMPLES_TOTAL, "counter", "Training samples routed to each expert.", _TE),
    MetricDef(
        Metric.EXPERT_EXPECTED_SHARE_RATIO,
        "gauge",
        "Fraction of samples the configured timestep distribution routes to each expert (0-1).",
        _TE,
    ),
    MetricDef(
        Metric.EXPERT_SAMPLE_SHARE_RATIO,
        "gauge",
        "Fraction of this run's samples routed to each expert so far (0-1); compare with the expected share.",
        _TE,
    ),
    MetricDef(Metric.STEP, "gauge", "Last completed optimizer step.", _T),
    MetricDef(Metric.TOTAL_STEPS, "gauge", "Configured number of optimizer steps.", _T),
    MetricDef(
        Metric.SKIPPED_SAMPLES_TOTAL,
        "counter",
        "Planned rows the loader could not fill (corrupt or missing samples), counted per draw.",
        ("trainingjob", "reason"),
        exported_by="trainer",
    ),
    MetricDef(
        Metric.SKIPPED_DISTINCT_SAMPLES_TOTAL,
        "counter",
        "Distinct corrupt or missing samples skipped (a sample drawn again is not counted again); "
        "spec.data.maxBadSamples bounds this one.",
        ("trainingjob", "reason"),
        exported_by="trainer",
    ),
    MetricDef(
        Metric.STORAGE_OUTAGE_SECONDS,
        "gauge",
        "How long dataset storage has been unreachable (0 when healthy); the run fails past "
        "spec.data.storageOutageSeconds.",
        _T,
        exported_by="trainer",
    ),
    MetricDef(Metric.LAST_CHECKPOINT_STEP, "gauge", "Step of the last completed checkpoint.", _T),
    MetricDef(
        Metric.LAST_CHECKPOINT_TIMESTAMP_SECONDS,
        "gauge",
        "Unix time of the last completed checkpoint (checkpoint age = time() - this).",
        _T,
    ),
    MetricDef(
        Metric.LAST_CHECKPOINT_DURATION_SECONDS,
        "gauge",
        "Wall time of the last completed checkpoint save, from its start to its commit.",
        _T,
    ),
    MetricDef(
        Metric.CHECKPOINT_DURATION_SECONDS, "histogram", "Wall time of a checkpoint save.", _T, CHECKPOINT_BUCKETS
    ),
)

# A LatentDataset's encode pods (`wanloom data build --step encode`), one set per pod; sum over pods for the
# dataset. Stages: wanloom_trainer/data/prepare/stages.py.
_DS = ("latentdataset",)
DATASET_METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        Metric.PREPARE_STAGE_SECONDS_TOTAL,
        "counter",
        "Seconds spent in each data-preparation stage (read, decode, resize on the CPU pool; vae, text; write), "
        "summed over the pod's sources; over samples_total it is the time per sample.",
        ("latentdataset", "stage"),
        exported_by="dataset pod",
    ),
    MetricDef(Metric.PREPARE_SAMPLES_TOTAL, "counter", "Samples encoded and written.", _DS, exported_by="dataset pod"),
    MetricDef(
        Metric.PREPARE_SKIPPED_TOTAL,
        "counter",
        "Inputs skipped, by kind (bad-row, duplicate-id, no-caption, missing, undecodable, no-bucket).",
        ("latentdataset", "reason"),
        exported_by="dataset pod",
    ),
    MetricDef(Metric.PREPARE_UNITS_TOTAL, "counter", "Work units (shards) written.", _DS, exported_by="dataset pod"),
)

OPERATOR_METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        Metric.OPERATOR_RECONCILE_DURATION_SECONDS,
        "histogram",
        "Duration of one operator handler call.",
        ("handler",),
        SHORT_BUCKETS,
        "operator",
    ),
    MetricDef(
        Metric.OPERATOR_RECONCILE_ERRORS_TOTAL,
        "counter",
        "Handler calls that raised.",
        ("handler", "kind"),
        exported_by="operator",
    ),
    MetricDef(
        Metric.OPERATOR_TRAININGJOBS,
        "gauge",
        "TrainingJobs known to the operator, by phase.",
        ("phase",),
        exported_by="operator",
    ),
    MetricDef(
        Metric.OPERATOR_JOB_STEP_TIME_SECONDS,
        "gauge",
        "Step time mirrored from a TrainingJob's status.",
        ("namespace", "trainingjob"),
        exported_by="operator",
    ),
    MetricDef(
        Metric.OPERATOR_JOB_LOAD_IMBALANCE_CV,
        "gauge",
        "Load-imbalance CV mirrored from a TrainingJob's status.",
        ("namespace", "trainingjob"),
        exported_by="operator",
    ),
    MetricDef(
        Metric.OPERATOR_JOB_RESTARTS,
        "gauge",
        "JobSet restarts of a TrainingJob (status.restarts; preemptions included).",
        ("namespace", "trainingjob"),
        exported_by="operator",
    ),
)

ALL_METRICS = TRAINER_METRICS + DATASET_METRICS + OPERATOR_METRICS
SKIP_REASONS = ("missing", "corrupt")  # values of the `reason` label of the skipped-samples counters
EXPERT_LABELS = ("high_noise", "low_noise")  # values of the `expert` label, indexed by routing's expert id
COST_MODEL_LABELS = ("in_use", "refit", "analytic")  # values of the `model` label of the cost-model error gauge
REFIT_OUTCOMES = ("accepted", "rejected", "kept")  # values of the `outcome` label of the refit counter
PREPARE_STAGES = ("read", "decode", "resize", "vae", "text", "write")  # values of the `stage` label


def metric(name: str) -> MetricDef:
    for m in ALL_METRICS:
        if m.name == name:
            return m
    raise KeyError(f"{name} is not in the metrics contract")
