"""The trainers' Prometheus exporter: one ``TrainerMetrics`` per process, fed one ``StepRecord`` per step.

Every metric comes from the contract table (``wanloom_api.metrics.TRAINER_METRICS``); a row's
``exported_by`` decides where it lives: "trainer" rows on every rank, "trainer rank 0" rows only on rank 0, which
alone sees the cross-rank numbers (load-imbalance CV, compute-load CV, straggler overhead, tokens/s, MFU, loss).
Definitions of the derived numbers are in docs/metrics.md; the CV and straggler math is AdaptiveLoad's
(``wanloom_trainer.adaptiveload.metrics``), so the exported numbers are the ones the planner reasons about.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from wanloom_api.metrics import (
    COST_MODEL_LABELS,
    EXPERT_LABELS,
    REFIT_OUTCOMES,
    SKIP_REASONS,
    TRAINER_METRICS,
    Metric,
    MetricDef,
)
from wanloom_trainer import flops
from wanloom_trainer.adaptiveload.metrics import coefficient_of_variation, straggler_overhead
from wanloom_trainer.metrics.collectors import HttpServer, build_collectors, process_registry
from wanloom_trainer.metrics.records import StepRecord, per_rank

log = logging.getLogger(__name__)


class TrainerMetrics:
    """Prometheus metrics of one trainer process (rank), labelled with its TrainingJob's name."""

    def __init__(self, trainingjob: str, rank: int, *, registry: CollectorRegistry | None = None) -> None:
        _require(bool(trainingjob), "TrainerMetrics: trainingjob (the TrainingJob's name) must be non-empty")
        _require(rank >= 0, f"TrainerMetrics: rank must be >= 0, got {rank}")
        self.trainingjob = trainingjob
        self.rank = rank
        self.registry = registry if registry is not None else process_registry()
        self._m = build_collectors((m for m in TRAINER_METRICS if _exported_here(m, rank)), self.registry)
        self._server: HttpServer | None = None
        self._unknown_accelerators: set[str] = set()
        self._expert_samples: dict[int, int] = {}  # samples per expert id in this process, for the share gauge
        # Series at 0 from the start, so rate() and increase() see the first skip instead of a new series.
        for reason in SKIP_REASONS:
            self._metric(Metric.SKIPPED_SAMPLES_TOTAL).labels(trainingjob, reason)
            self._metric(Metric.SKIPPED_DISTINCT_SAMPLES_TOTAL).labels(trainingjob, reason)
        self._metric(Metric.STORAGE_OUTAGE_SECONDS).labels(trainingjob).set(0.0)
        if rank == 0:
            for outcome in REFIT_OUTCOMES:
                self._metric(Metric.COST_MODEL_REFITS_TOTAL).labels(trainingjob, outcome)

    # -- serving --------------------------------------------------------------------------------------------------

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve /metrics on ``addr:port`` from a daemon thread (returns at once)."""
        self._server = HttpServer(self.registry, port, addr)
        log.info("serving Prometheus metrics on %s:%d (rank %d)", addr, port, self.rank)

    def close(self) -> None:
        """Stop the HTTP server started by ``serve`` (no-op if none)."""
        if self._server is not None:
            self._server.close()
            self._server = None

    # -- recording ------------------------------------------------------------------------------------------------

    def record_step(self, record: StepRecord) -> None:
        """Observe this rank's step time; on rank 0 also set progress, balance, throughput and expert metrics."""
        self._metric(Metric.STEP_TIME_SECONDS).labels(self.trainingjob, str(self.rank)).observe(record.log.step_time_s)
        if self.rank != 0:
            return
        self._metric(Metric.STEP).labels(self.trainingjob).set(record.completed_steps)
        self._metric(Metric.TOTAL_STEPS).labels(self.trainingjob).set(record.total_steps)
        self._record_balance(record)
        self._record_throughput(record)
        self._record_experts(record)

    def record_checkpoint(self, step: int, duration_s: float, timestamp: float) -> None:
        """A completed checkpoint save (rank 0 exports it; other ranks ignore the call)."""
        _require(step >= 0, f"record_checkpoint: step must be >= 0, got {step}")
        _require(duration_s >= 0 and math.isfinite(duration_s), f"record_checkpoint: bad duration_s {duration_s}")
        if self.rank != 0:
            return
        self._metric(Metric.CHECKPOINT_DURATION_SECONDS).labels(self.trainingjob).observe(duration_s)
        self._metric(Metric.LAST_CHECKPOINT_STEP).labels(self.trainingjob).set(step)
        self._metric(Metric.LAST_CHECKPOINT_DURATION_SECONDS).labels(self.trainingjob).set(duration_s)
        self._metric(Metric.LAST_CHECKPOINT_TIMESTAMP_SECONDS).labels(self.trainingjob).set(timestamp)

    def record_restored_checkpoint(self, step: int, timestamp: float | None) -> None:
        """The checkpoint a resumed run starts from: its step and save time, so checkpoint age reads right before
        the run's first save (rank 0; no duration: this process did not save it)."""
        _require(step >= 0, f"record_restored_checkpoint: step must be >= 0, got {step}")
        if self.rank != 0:
            return
        self._metric(Metric.LAST_CHECKPOINT_STEP).labels(self.trainingjob).set(step)
        if timestamp is not None:
            self._metric(Metric.LAST_CHECKPOINT_TIMESTAMP_SECONDS).labels(self.trainingjob).set(timestamp)

    def record_validation(self, losses: dict[int, float], seconds: float) -> None:
        """A validation's loss per expert id and its wall time (rank 0 exports it; other ranks ignore the call)."""
        _require(seconds >= 0 and math.isfinite(seconds), f"record_validation: bad seconds {seconds}")
        if self.rank != 0:
            return
        for expert, loss in losses.items():
            self._metric(Metric.VALIDATION_LOSS).labels(self.trainingjob, expert_label(expert)).set(loss)
        self._metric(Metric.VALIDATION_SECONDS).labels(self.trainingjob).set(seconds)

    def record_skipped(self, reason: str, n: int = 1, *, distinct: int = 0) -> None:
        """``n`` planned rows the loader could not fill on this rank, ``distinct`` of them samples not skipped before
        (``reason``: a short fixed word, e.g. "corrupt")."""
        _require(bool(reason), "record_skipped: reason must be a non-empty string")
        _require(n >= 0 and distinct >= 0, f"record_skipped: n and distinct must be >= 0, got {n}, {distinct}")
        self._metric(Metric.SKIPPED_SAMPLES_TOTAL).labels(self.trainingjob, reason).inc(n)
        self._metric(Metric.SKIPPED_DISTINCT_SAMPLES_TOTAL).labels(self.trainingjob, reason).inc(distinct)

    def record_storage_outage(self, seconds: float) -> None:
        """How long dataset storage has been unreachable (0: healthy again)."""
        self._metric(Metric.STORAGE_OUTAGE_SECONDS).labels(self.trainingjob).set(seconds)

    def record_data_wait(self, seconds: float) -> None:
        """Time this rank's step waited for its input batch."""
        _require(seconds >= 0 and math.isfinite(seconds), f"record_data_wait: seconds must be >= 0, got {seconds}")
        self._metric(Metric.DATA_WAIT_SECONDS).labels(self.trainingjob, str(self.rank)).observe(seconds)

    # -- rank-0 pieces --------------------------------------------------------------------------------------------

    def record_cost_model(self, errors: dict[str, float | None], outcome: str | None) -> None:
        """The cost model against the run's measured slot times (``errors`` by ``COST_MODEL_LABELS``; None: not
        known yet) and a refit's outcome ("accepted", "rejected"; None: no refit). Rank 0 only."""
        if self.rank != 0:
            return
        for model, error in errors.items():
            _require(model in COST_MODEL_LABELS, f"record_cost_model: model {model!r} not in {COST_MODEL_LABELS}")
            if error is not None:
                self._metric(Metric.COST_MODEL_ERROR_RATIO).labels(self.trainingjob, model).set(error)
        if outcome is not None:
            _require(outcome in REFIT_OUTCOMES, f"record_cost_model: outcome {outcome!r} not in {REFIT_OUTCOMES}")
            self._metric(Metric.COST_MODEL_REFITS_TOTAL).labels(self.trainingjob, outcome).inc()

    def _record_balance(self, record: StepRecord) -> None:
        fields = ("rank_step_times_s", "rank_busy_s", "rank_predicted_busy_s")
        times, busy, predicted = (per_rank(v, f"StepRecord.{f}") if (v := getattr(record, f)) else None for f in fields)
        # Busy times leave out the gradient synchronisation, where every rank waits for the slowest.
        measured = busy if busy is not None else times
        if measured is not None:
            self._metric(Metric.LOAD_IMBALANCE_CV).labels(self.trainingjob).set(coefficient_of_variation(measured))
            self._metric(Metric.STRAGGLER_OVERHEAD_RATIO).labels(self.trainingjob).set(straggler_overhead(measured))
        for name, values in ((Metric.RANK_BUSY_SECONDS, busy), (Metric.RANK_PREDICTED_BUSY_SECONDS, predicted)):
            for rank, value in enumerate(values if values is not None else ()):
                self._metric(name).labels(self.trainingjob, str(rank)).set(value)
        if record.rank_predicted_costs:
            costs = per_rank(record.rank_predicted_costs, "StepRecord.rank_predicted_costs")
            self._metric(Metric.COMPUTE_LOAD_CV).labels(self.trainingjob).set(coefficient_of_variation(costs))

    def _record_throughput(self, record: StepRecord) -> None:
        wall = record.wall_time_s
        self._metric(Metric.TOKENS_PER_SECOND).labels(self.trainingjob).set(record.log.tokens / wall)
        self._metric(Metric.STEP_SAMPLES).labels(self.trainingjob).set(sum(record.log.expert_samples.values()))
        self._metric(Metric.STEP_TOKENS).labels(self.trainingjob).set(record.log.tokens)
        try:
            ratio = flops.mfu(record.log.model_flops, wall, record.num_devices, record.accelerator)
        except ValueError as err:
            # An accelerator without a known peak must not stop training: MFU stays unset and we say why once.
            if record.accelerator not in self._unknown_accelerators:
                self._unknown_accelerators.add(record.accelerator)
                log.warning("%s not exported: %s", Metric.MFU_RATIO, err)
            return
        self._metric(Metric.MFU_RATIO).labels(self.trainingjob).set(ratio)

    def _record_experts(self, record: StepRecord) -> None:
        for name, values in (
            (Metric.LOSS, record.log.expert_loss),
            (Metric.GRAD_NORM, record.log.grad_norm),
            (Metric.LEARNING_RATE, record.log.learning_rate),
        ):
            for expert, value in values.items():
                self._metric(name).labels(self.trainingjob, expert_label(expert)).set(value)
        for expert, n in record.log.expert_samples.items():
            label = expert_label(expert)
            # .labels() alone creates the series at 0, so rate() sees an expert's first samples too.
            samples = self._metric(Metric.EXPERT_SAMPLES_TOTAL).labels(self.trainingjob, label)
            steps = self._metric(Metric.EXPERT_STEPS_TOTAL).labels(self.trainingjob, label)
            self._expert_samples[expert] = self._expert_samples.get(expert, 0) + n
            if n > 0:
                samples.inc(n)
                steps.inc()
        total = sum(self._expert_samples.values())
        for expert, n in self._expert_samples.items():
            share = self._metric(Metric.EXPERT_SAMPLE_SHARE_RATIO).labels(self.trainingjob, expert_label(expert))
            share.set(n / total if total else 0.0)

    def record_expected_shares(self, shares: Sequence[float]) -> None:
        """The configured distribution's share of samples per expert id (``RoutingConfig.expected_shares``); rank 0
        exports it, other ranks ignore the call."""
        if self.rank != 0:
            return
        for expert, share in enumerate(shares):
            self._metric(Metric.EXPERT_EXPECTED_SHARE_RATIO).labels(self.trainingjob, expert_label(expert)).set(share)

    def _metric(self, name: str) -> MetricWrapperBase:
        return self._m[name]


def expert_label(expert: int) -> str:
    """The `expert` label value of routing's expert id (``EXPERT_LABELS``)."""
    if not 0 <= expert < len(EXPERT_LABELS):
        raise ValueError(f"expert id {expert} has no label; valid ids: 0..{len(EXPERT_LABELS) - 1} {EXPERT_LABELS}")
    return EXPERT_LABELS[expert]


def _exported_here(spec: MetricDef, rank: int) -> bool:
    return spec.exported_by == "trainer" or (spec.exported_by == "trainer rank 0" and rank == 0)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
