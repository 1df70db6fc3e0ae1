"""Prometheus collectors built from the metrics contract (``wanloom_api.metrics``), never from literals.

The contract row says the name, type, help, labels and buckets; this module only turns a row into the matching
prometheus-client object, so a renamed or relabelled metric changes in exactly one place.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.metrics import MetricWrapperBase

from wanloom_api.metrics import MetricDef


def build_collector(spec: MetricDef, registry: CollectorRegistry) -> MetricWrapperBase:
    """One prometheus-client collector for one contract row, registered in ``registry``."""
    # `<name>_created` samples would reach Prometheus as series outside the contract (a counter's `_created` does
    # not end in `_total`). prometheus-client only offers a process-wide switch.
    disable_created_metrics()
    labels = list(spec.labels)
    if spec.kind == "counter":
        # prometheus-client appends `_total` itself; the contract spells the full exposed name.
        return Counter(spec.name.removesuffix("_total"), spec.help, labels, registry=registry)
    if spec.kind == "gauge":
        return Gauge(spec.name, spec.help, labels, registry=registry)
    if spec.kind == "histogram":
        if not spec.buckets:
            raise ValueError(f"histogram {spec.name} has no buckets in the metrics contract")
        return Histogram(spec.name, spec.help, labels, buckets=spec.buckets, registry=registry)
    raise ValueError(f"{spec.name}: unknown metric kind {spec.kind!r}; valid: counter, gauge, histogram")


def build_collectors(specs: Iterable[MetricDef], registry: CollectorRegistry) -> dict[str, MetricWrapperBase]:
    """Collectors for every row of ``specs``, keyed by the contract name (the exposed name, `_total` included)."""
    return {spec.name: build_collector(spec, registry) for spec in specs}


def process_registry() -> CollectorRegistry:
    """A private registry (two exporters in one process never clash) with the usual process/GC/platform series."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class HttpServer:
    """/metrics of ``registry`` on ``addr:port``, served from a daemon thread until ``close``."""

    def __init__(self, registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> None:
        self._server, self._thread = start_http_server(port, addr, registry=registry)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
