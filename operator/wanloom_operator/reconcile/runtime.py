"""Runtime: what every handler shares for one running operator (settings, API access, metrics).

It travels in kopf's ``memo`` (``memo.runtime``): built by :func:`runner.run_operator`, or by the start-up handler
from the environment, or handed in by a test with its own settings (a kmock server, a static rank-0 address).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wanloom_operator.metrics.operator import OperatorMetrics
from wanloom_operator.reconcile.cluster import Cluster
from wanloom_operator.settings import OperatorSettings


@dataclass
class Runtime:
    settings: OperatorSettings
    cluster: Cluster
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    metrics_server: Any = None  # the /metrics HTTP server once started

    @classmethod
    def create(cls, settings: OperatorSettings) -> Runtime:
        return cls(settings=settings, cluster=Cluster.connect(settings))

    def start_metrics_server(self) -> None:
        if self.metrics_server is None and self.settings.metrics_port:
            self.metrics_server = self.metrics.serve(self.settings.metrics_port)

    def stop_metrics_server(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None
