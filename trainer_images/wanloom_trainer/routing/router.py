"""Joint routing of training samples to Wan 2.2's two experts.

The high-noise expert (diffusers ``transformer/``) takes ``t ≥ boundary_ratio · 1000``, the low-noise expert
(``transformer_2/``) takes the rest, as at inference. Two modes:

- ``per-sample``: each sample's own t decides its expert. The AdaptiveLoad planner then groups a step's samples
  into expert-homogeneous micro-batches, so no sample runs through both experts.
- ``per-batch``: one draw per step decides the expert for the whole step (the maxdiffusion PR's behaviour), with
  probability equal to the configured distribution's mass above the boundary, and every t of the step is drawn
  from the configured distribution restricted to that expert's band. Over many steps the marginal distribution
  of t is therefore exactly the configured one; the PR's ``uniform() > boundary_ratio`` only matches it for an
  unshifted uniform sampler.

With ``only`` (LoRA on one expert, ``spec.lora.experts``) every draw comes from the configured distribution
restricted to that expert's band, as a per-batch step of that expert would: every sample trains it.

Draws are a pure function of (seed, step, n): a resumed run replays them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from wanloom_trainer.routing.sampling import NUM_TRAIN_TIMESTEPS, TimestepSampler

HIGH_NOISE = 0
LOW_NOISE = 1
_ROUTING_STREAM = 0x57A9  # separates routing draws from other consumers of the same (seed, step)


@dataclass(frozen=True)
class RoutingDraw:
    """One step's timesteps (float32, [n]) and experts (int8, [n]; HIGH_NOISE or LOW_NOISE)."""

    timesteps: np.ndarray
    experts: np.ndarray


@dataclass(frozen=True)
class Router:
    """Draws timesteps and assigns experts.

    Attributes:
        sampler: the configured timestep distribution.
        boundary_ratio: fraction of the 1000-step schedule above which the high-noise expert runs; ``None`` for
            single-model variants (everything goes to expert 0).
        mode: ``per-sample`` or ``per-batch``.
        only: HIGH_NOISE or LOW_NOISE to route every sample to that expert (module docstring); None: both.
    """

    sampler: TimestepSampler
    boundary_ratio: float | None
    mode: Literal["per-sample", "per-batch"] = "per-sample"
    only: int | None = None

    def __post_init__(self) -> None:
        if self.boundary_ratio is not None and not 0.0 < self.boundary_ratio < 1.0:
            raise ValueError(f"boundary_ratio must lie in (0, 1), got {self.boundary_ratio}")
        if self.mode not in ("per-sample", "per-batch"):
            raise ValueError(f"routing mode {self.mode!r} is not one of 'per-sample', 'per-batch'")
        if self.only is not None and (self.boundary_ratio is None or self.only not in (HIGH_NOISE, LOW_NOISE)):
            raise ValueError(f"routing to one expert ({self.only}) needs two experts and an expert id of 0 or 1")

    @property
    def boundary_timestep(self) -> float | None:
        return None if self.boundary_ratio is None else self.boundary_ratio * NUM_TRAIN_TIMESTEPS

    @property
    def high_noise_share(self) -> float:
        """Expected fraction of samples routed to the high-noise expert (1 for single-model variants)."""
        if self.boundary_timestep is None:
            return 1.0
        if self.only is not None:
            return 1.0 if self.only == HIGH_NOISE else 0.0
        return 1.0 - self.sampler.cdf_t(self.boundary_timestep)

    def draw(self, seed: int, step: int, n: int) -> RoutingDraw:
        """Timesteps and experts for the ``n`` samples of global step ``step``."""
        rng = np.random.default_rng([seed, step, _ROUTING_STREAM])
        if self.boundary_timestep is None:
            t = self.sampler.timesteps(rng.random(n))
            return RoutingDraw(t, np.full(n, HIGH_NOISE, dtype=np.int8))
        if self.mode == "per-sample" and self.only is None:
            t = self.sampler.timesteps(rng.random(n))
            return RoutingDraw(t, self.expert_of(t))
        u_boundary = self.sampler.cdf_t(self.boundary_timestep)
        is_high = rng.random() >= u_boundary if self.only is None else self.only == HIGH_NOISE
        lo, hi = (u_boundary, 1.0) if is_high else (0.0, u_boundary)
        t = self.sampler.timesteps(lo + (hi - lo) * rng.random(n))
        # The inverse CDF is exact up to float32 rounding at the band edge; clamp so the band holds.
        experts = np.full(n, HIGH_NOISE if is_high else LOW_NOISE, dtype=np.int8)
        return RoutingDraw(self._clamp_to_band(t, is_high), experts)

    def expert_of(self, t: np.ndarray) -> np.ndarray:
        if self.boundary_timestep is None:
            return np.full(np.shape(t), HIGH_NOISE, dtype=np.int8)
        return np.where(np.asarray(t) >= self.boundary_timestep, HIGH_NOISE, LOW_NOISE).astype(np.int8)

    def _clamp_to_band(self, t: np.ndarray, is_high: bool) -> np.ndarray:
        b = np.float32(self.boundary_timestep)
        if is_high:
            return np.maximum(t, b)
        return np.minimum(t, np.nextafter(b, np.float32(0)))
