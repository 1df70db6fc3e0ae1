"""Trainer-side Prometheus metrics; names, types and labels come from ``wanloom_api.metrics``."""

from wanloom_trainer.metrics.exporter import TrainerMetrics, expert_label
from wanloom_trainer.metrics.records import StepLog, StepRecord

__all__ = ["StepLog", "StepRecord", "TrainerMetrics", "expert_label"]
