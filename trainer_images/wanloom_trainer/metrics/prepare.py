"""A data-preparation pod's Prometheus metrics (the contract's ``DATASET_METRICS``), fed one report per unit.

The encode pods of a LatentDataset carry the operator's labels and a ``metrics`` port, so the chart's PodMonitor
scrapes them like trainer pods; the dashboard's data-preparation row sums them over a dataset's pods.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from wanloom_api.metrics import DATASET_METRICS, PREPARE_STAGES, Metric
from wanloom_trainer.data.prepare.sources import SKIP_KINDS
from wanloom_trainer.data.prepare.stages import PrepareProgress
from wanloom_trainer.metrics.collectors import HttpServer, build_collectors, process_registry

log = logging.getLogger(__name__)


class PrepareMetrics:
    """Counters of one encode pod, labelled with its LatentDataset's name."""

    def __init__(self, latentdataset: str, *, registry: CollectorRegistry | None = None) -> None:
        if not latentdataset:
            raise ValueError("PrepareMetrics: latentdataset (the LatentDataset's name) must be non-empty")
        self.latentdataset = latentdataset
        self.registry = registry if registry is not None else process_registry()
        self._m = build_collectors(DATASET_METRICS, self.registry)
        self._server: HttpServer | None = None
        # Every series from the start at 0, so rate() sees the first sample, skip and unit.
        for stage in PREPARE_STAGES:
            self._m[Metric.PREPARE_STAGE_SECONDS_TOTAL].labels(latentdataset, stage)
        for kind in SKIP_KINDS:
            self._m[Metric.PREPARE_SKIPPED_TOTAL].labels(latentdataset, kind)
        self._m[Metric.PREPARE_SAMPLES_TOTAL].labels(latentdataset)
        self._m[Metric.PREPARE_UNITS_TOTAL].labels(latentdataset)

    def observe(self, progress: PrepareProgress) -> None:
        """Add one report (``prepare``'s ``on_progress``)."""
        name = self.latentdataset
        for stage, seconds in progress.seconds.items():
            self._m[Metric.PREPARE_STAGE_SECONDS_TOTAL].labels(name, stage).inc(max(0.0, seconds))
        for kind, n in progress.skipped.items():
            self._m[Metric.PREPARE_SKIPPED_TOTAL].labels(name, kind).inc(n)
        self._m[Metric.PREPARE_SAMPLES_TOTAL].labels(name).inc(progress.samples)
        self._m[Metric.PREPARE_UNITS_TOTAL].labels(name).inc(progress.units)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        self._server = HttpServer(self.registry, port, addr)
        log.info("serving Prometheus metrics on %s:%d", addr, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
