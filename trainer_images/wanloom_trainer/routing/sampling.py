"""The training timestep distribution of rectified flow, as an inverse CDF.

σ ∈ (0, 1) is the noise level (``x_t = (1 − σ)·x0 + σ·ε``) and ``t = 1000·σ`` the model's timestep input.
Sampling through the inverse CDF ``σ = F⁻¹(u)`` of a monotone map lets the router draw from any band
``[t_lo, t_hi)`` of the same distribution exactly, by restricting ``u`` to ``[F(t_lo), F(t_hi))``: this is what
keeps the per-batch routing mode's overall timestep distribution equal to the configured one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import special

NUM_TRAIN_TIMESTEPS = 1000
_U_EPS = 1e-6  # keeps σ strictly inside (0, 1): logit-normal is undefined at the ends


@dataclass(frozen=True)
class TimestepSampler:
    """σ = shift(G(u)), u ~ U(0, 1).

    Attributes:
        kind: ``uniform`` (G(u) = u) or ``logit-normal`` (G(u) = sigmoid(mean + std·Φ⁻¹(u))).
        shift: SD3/Wan time shift ``σ' = s·σ / (1 + (s − 1)·σ)``; 1 disables it.
        logit_mean, logit_std: parameters of the logit-normal.
    """

    kind: Literal["uniform", "logit-normal"] = "uniform"
    shift: float = 1.0
    logit_mean: float = 0.0
    logit_std: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("uniform", "logit-normal"):
            raise ValueError(f"sampling kind {self.kind!r} is not one of 'uniform', 'logit-normal'")
        if self.shift <= 0:
            raise ValueError(f"shift must be > 0, got {self.shift}")
        if self.logit_std <= 0:
            raise ValueError(f"logit_std must be > 0, got {self.logit_std}")

    def sigma_from_u(self, u: np.ndarray) -> np.ndarray:
        """The inverse CDF: maps u ∈ (0, 1) to σ, monotonically increasing."""
        u = np.clip(np.asarray(u, dtype=np.float64), _U_EPS, 1.0 - _U_EPS)
        base = u if self.kind == "uniform" else special.expit(self.logit_mean + self.logit_std * special.ndtri(u))
        return self.shift * base / (1.0 + (self.shift - 1.0) * base)

    def u_from_sigma(self, sigma: float) -> float:
        """The CDF F(σ): the inverse of :meth:`sigma_from_u`."""
        sigma = float(np.clip(sigma, 0.0, 1.0))
        base = sigma / (self.shift - (self.shift - 1.0) * sigma)  # un-shift
        if self.kind == "uniform":
            return base
        if base <= 0.0 or base >= 1.0:
            return base
        return float(special.ndtr((special.logit(base) - self.logit_mean) / self.logit_std))

    def cdf_t(self, t: float) -> float:
        """P(timestep < t) for t in timestep units [0, 1000]."""
        return self.u_from_sigma(t / NUM_TRAIN_TIMESTEPS)

    def timesteps(self, u: np.ndarray) -> np.ndarray:
        """Timesteps t = 1000·σ in float32 (kept fp32 end to end: bf16 cannot tell t=999 from t=1000)."""
        return (NUM_TRAIN_TIMESTEPS * self.sigma_from_u(u)).astype(np.float32)
