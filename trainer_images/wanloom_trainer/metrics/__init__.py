"""Trainer-side Prometheus metrics; names, types and labels come from ``wanloom_api.metrics``."""

from wanloom_trainer.metrics.exporter import StepRecord, TrainerMetrics, expert_label

__all__ = ["StepRecord", "TrainerMetrics", "expert_label"]
