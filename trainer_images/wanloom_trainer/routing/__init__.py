"""Timestep sampling and expert routing for Wan 2.2's two-expert models (pure numpy).

Exports ``TimestepSampler`` (the configured σ distribution), ``Router`` (joint routing around the boundary) and
``loss_weights`` (optional timestep weighting normalised over the fixed grid).
"""

from wanloom_trainer.routing.router import HIGH_NOISE, LOW_NOISE, Router, RoutingDraw
from wanloom_trainer.routing.sampling import TimestepSampler
from wanloom_trainer.routing.weighting import loss_weights

__all__ = ["HIGH_NOISE", "LOW_NOISE", "Router", "RoutingDraw", "TimestepSampler", "loss_weights"]
