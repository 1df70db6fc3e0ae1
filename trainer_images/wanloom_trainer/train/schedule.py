"""Learning rate per expert and step: warmup, decay and the optional per-expert scaling (both backends).

The schedule follows the *global* step, not an expert's own update count, so both experts warm up and decay on
the same clock whatever routing hands them; an expert skipped by a step simply does not move.

    warmup    lr · (step + 1) / warmup_steps              for step < warmup_steps
    constant  lr
    linear    lr · (1 − p)                                p = (step − warmup) / (steps − warmup) ∈ [0, 1)
    cosine    lr · ½(1 + cos(π·p))

``per_expert_lr_scaling`` multiplies expert e's rate by its expected share of samples under the configured
timestep distribution (``Router.high_noise_share`` for the high-noise expert, the rest for the low-noise one); in
per-batch routing that share is exactly the expected fraction of steps the expert trains on.
"""

from __future__ import annotations

import math

from wanloom_api.trainingjob import OptimizerSpec
from wanloom_trainer.config.train_config import RoutingConfig


def base_learning_rate(opt: OptimizerSpec, step: int, total_steps: int) -> float:
    """The scheduled peak-relative rate at global ``step`` (0-based) of a ``total_steps`` run."""
    if step < opt.warmup_steps:
        return opt.learning_rate * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return opt.learning_rate
    decay_steps = max(1, total_steps - opt.warmup_steps)
    progress = min(1.0, (step - opt.warmup_steps) / decay_steps)
    if opt.schedule == "linear":
        return opt.learning_rate * (1.0 - progress)
    if opt.schedule == "cosine":
        return opt.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"spec.optimizer.schedule {opt.schedule!r} is not one of constant, linear, cosine")


def expert_lr_scales(opt: OptimizerSpec, routing: RoutingConfig, num_experts: int) -> tuple[float, ...]:
    """Per-expert multipliers: all 1, or each expert's expected sample share with ``per_expert_lr_scaling``."""
    if not opt.per_expert_lr_scaling or num_experts == 1:
        return (1.0,) * num_experts
    high = routing.router().high_noise_share
    return (high, 1.0 - high)


def learning_rates(opt: OptimizerSpec, scales: tuple[float, ...], step: int, total_steps: int) -> tuple[float, ...]:
    """The learning rate of every expert at ``step``."""
    base = base_learning_rate(opt, step, total_steps)
    return tuple(base * s for s in scales)
