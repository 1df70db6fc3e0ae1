"""Learning rate per expert and step: warmup, decay and the optional per-expert scaling (both backends).

The schedule follows the *global* step, not an expert's own update count, so both experts warm up and decay on
the same clock whatever routing hands them; an expert skipped by a step simply does not move.

    warmup    lr · (step + 1) / warmup_steps              for step < warmup_steps
    constant  lr
    linear    lr · (1 − p)                                p = (step − warmup) / (steps − warmup) ∈ [0, 1)
    cosine    lr · ½(1 + cos(π·p))

**Changing the length of a run** (``wanloom run --steps N`` or a new ``spec.training.steps`` on resume) keeps the
rates continuous: the steps already trained keep theirs, and from the resumed step on the schedule's decay is
re-laid over the steps that remain, starting from the rate the run had reached (``Segment``): a cosine run
extended from 200 to 300 steps continues from its step-200 rate and decays over steps 200..299 to 0. A run that
had finished its decay therefore trains its extra steps at (near) zero; to train further at a higher rate, start a
new run from its exported weights (``model.weights``). A change during warmup only moves the decay's end. The
checkpoint records the segment, so later resumes follow it; the trainer logs the change when it happens.

``per_expert_lr_scaling`` multiplies expert e's rate by its expected share of samples under the configured
timestep distribution (``Router.high_noise_share`` for the high-noise expert, the rest for the low-noise one); in
per-batch routing that share is exactly the expected fraction of steps the expert trains on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from wanloom_api.trainingjob import OptimizerSpec
from wanloom_trainer.config.train_config import RoutingConfig


@dataclass(frozen=True)
class Segment:
    """The decay from ``start`` to the end of a ``total_steps`` run, starting at ``rate`` (the rate the run had
    reached at ``start``); the default segment is the schedule as configured."""

    total_steps: int
    start: int | None = None  # None: the configured schedule from step 0 (warmup, then decay)
    rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"total_steps": self.total_steps, "start": self.start, "rate": self.rate}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Segment:
        return cls(int(doc["total_steps"]), doc.get("start"), doc.get("rate"))


def _decay(schedule: str, peak: float, progress: float) -> float:
    if schedule == "constant":
        return peak
    progress = min(1.0, max(0.0, progress))
    if schedule == "linear":
        return peak * (1.0 - progress)
    if schedule == "cosine":
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"spec.optimizer.schedule {schedule!r} is not one of constant, linear, cosine")


def base_learning_rate(opt: OptimizerSpec, step: int, total_steps: int, segment: Segment | None = None) -> float:
    """The scheduled rate at global ``step`` (0-based) of a ``total_steps`` run; ``segment`` (a changed run
    length) re-lays the decay from its start on."""
    if segment is not None and segment.start is not None and step >= segment.start:
        remaining = max(1, segment.total_steps - segment.start)
        return _decay(opt.schedule, segment.rate, (step - segment.start) / remaining)
    if step < opt.warmup_steps:
        return opt.learning_rate * (step + 1) / opt.warmup_steps
    return _decay(opt.schedule, opt.learning_rate, (step - opt.warmup_steps) / max(1, total_steps - opt.warmup_steps))


def resumed_segment(opt: OptimizerSpec, saved: Segment | None, step: int, total_steps: int) -> Segment:
    """The schedule of a run resumed at ``step`` for ``total_steps`` from a checkpoint that was following
    ``saved`` (None: written before checkpoints recorded it, taken as the same length)."""
    if saved is None or saved.total_steps == total_steps:
        return saved or Segment(total_steps)
    if saved.start is None and step <= opt.warmup_steps:
        return Segment(total_steps)  # warmup does not depend on the length: only the decay's end moves
    rate = base_learning_rate(opt, step, saved.total_steps, saved)
    return Segment(total_steps, step, rate)


def expert_lr_scales(opt: OptimizerSpec, routing: RoutingConfig, num_experts: int) -> tuple[float, ...]:
    """Per-expert multipliers: all 1, or each expert's expected sample share with ``per_expert_lr_scaling``."""
    if not opt.per_expert_lr_scaling or num_experts == 1:
        return (1.0,) * num_experts
    high = routing.router().high_noise_share
    return (high, 1.0 - high)


def learning_rates(
    opt: OptimizerSpec, scales: tuple[float, ...], step: int, total_steps: int, segment: Segment | None = None
) -> tuple[float, ...]:
    """The learning rate of every expert at ``step``."""
    base = base_learning_rate(opt, step, total_steps, segment)
    return tuple(base * s for s in scales)
