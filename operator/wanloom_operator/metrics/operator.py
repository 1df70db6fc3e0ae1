"""OperatorMetrics: handler durations and errors, TrainingJobs by phase, per-job step time, imbalance CV, restarts.

One instance per running operator, on its own ``CollectorRegistry`` (several operators can live in one test
process). Per-job series are mirrored from each TrainingJob's status and removed when the job goes away.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from wanloom_api.conditions import Phase
from wanloom_api.metrics import Metric, metric

UNKNOWN_PHASE = "Unknown"  # a TrainingJob the operator has not given a phase yet


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconcile_duration = _histogram(Metric.OPERATOR_RECONCILE_DURATION_SECONDS, self.registry)
        self.reconcile_errors = _counter(Metric.OPERATOR_RECONCILE_ERRORS_TOTAL, self.registry)
        self.trainingjobs = _gauge(Metric.OPERATOR_TRAININGJOBS, self.registry)
        self.job_step_time = _gauge(Metric.OPERATOR_JOB_STEP_TIME_SECONDS, self.registry)
        self.job_load_cv = _gauge(Metric.OPERATOR_JOB_LOAD_IMBALANCE_CV, self.registry)
        self.job_restarts = _gauge(Metric.OPERATOR_JOB_RESTARTS, self.registry)
        self._phases: dict[tuple[str, str], str] = {}
        self._refresh_phase_counts()

    @contextmanager
    def handler(self, name: str, expected: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Time one handler call; count it as an error (by exception class) if it raises, unless ``expected``
        (flow control such as "retry once the old JobSet is gone")."""
        start = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, expected):
                self.reconcile_errors.labels(handler=name, kind=type(exc).__name__).inc()
            raise
        finally:
            self.reconcile_duration.labels(handler=name).observe(time.perf_counter() - start)

    def observe_job(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Mirror one TrainingJob's status: its phase into the by-phase count, its progress into gauges."""
        self._phases[(namespace, name)] = status.get("phase") or UNKNOWN_PHASE
        self._refresh_phase_counts()
        progress = status.get("progress") or {}
        for gauge, key in ((self.job_step_time, "stepTimeSeconds"), (self.job_load_cv, "loadImbalanceCV")):
            if progress.get(key) is not None:
                gauge.labels(namespace=namespace, trainingjob=name).set(float(progress[key]))
        if status.get("restarts") is not None:
            self.job_restarts.labels(namespace=namespace, trainingjob=name).set(int(status["restarts"]))

    def forget_job(self, namespace: str, name: str) -> None:
        self._phases.pop((namespace, name), None)
        self._refresh_phase_counts()
        for gauge in (self.job_step_time, self.job_load_cv, self.job_restarts):
            with suppress(KeyError):  # never had progress
                gauge.remove(namespace, name)

    def known_jobs(self) -> int:
        return len(self._phases)

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Start /metrics in a background thread; returns the server (``.shutdown()`` stops it)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server

    def _refresh_phase_counts(self) -> None:
        counts = Tally(self._phases.values())
        for phase in (*Phase, UNKNOWN_PHASE):
            self.trainingjobs.labels(phase=phase).set(counts.get(phase, 0))


def _histogram(name: str, registry: CollectorRegistry) -> Histogram:
    d = metric(name)
    return Histogram(d.name, d.help, d.labels, buckets=d.buckets or Histogram.DEFAULT_BUCKETS, registry=registry)


def _counter(name: str, registry: CollectorRegistry) -> Counter:
    d = metric(name)
    return Counter(d.name, d.help, d.labels, registry=registry)


def _gauge(name: str, registry: CollectorRegistry) -> Gauge:
    d = metric(name)
    return Gauge(d.name, d.help, d.labels, registry=registry)
