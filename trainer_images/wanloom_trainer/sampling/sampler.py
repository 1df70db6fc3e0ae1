"""Flow-matching sampling with both experts: Euler steps over shifted sigmas, the expert switched at the routing
boundary, classifier-free guidance per expert.

The model predicts the velocity v = ε − x0 of x_σ = (1 − σ)·x0 + σ·ε (``train.objective``), so an Euler step from
σ to σ' is x + (σ' − σ)·v. Sigmas run from 1 to 0 in ``steps`` equal parts of the unshifted schedule, each shifted
as in training (σ' = sσ / (1 + (s − 1)σ)); the model sees t = 1000·σ, and t ≥ 1000·boundary goes to the high-noise
expert (0), lower t to the low-noise one (1), as in the Wan 2.2 pipelines. Guidance mixes the two halves of one
batch: v = v_uncond + g_expert·(v_cond − v_uncond), the unconditional half on the empty-prompt embedding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# (expert, x_t with any condition channels [B, C, T', H', W'], t [B], text [B, L, D]) -> velocity [B, C_out, ...]
Predict = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class SamplerConfig:
    """steps: Euler steps; shift: the sigma shift; boundary_ratio: None for a single model; guidance: scale per
    expert (high-noise, low-noise)."""

    steps: int
    shift: float
    boundary_ratio: float | None
    guidance: tuple[float, float]


def sigmas(steps: int, shift: float) -> np.ndarray:
    """float64 [steps + 1]: 1 → 0, shifted."""
    base = np.linspace(1.0, 0.0, steps + 1)
    return shift * base / (1.0 + (shift - 1.0) * base)


def expert_at(t: float, boundary_ratio: float | None) -> int:
    return 0 if boundary_ratio is None or t >= 1000.0 * boundary_ratio else 1


def sample(
    predict: Predict,
    noise: np.ndarray,
    text: np.ndarray,
    empty_text: np.ndarray,
    config: SamplerConfig,
    condition: np.ndarray | None = None,
) -> np.ndarray:
    """Latents x0 [B, C, T', H', W'] from ``noise`` (x at σ = 1) for ``text`` [B, L, D] (``empty_text`` [L, D] the
    unconditional prompt); ``condition`` [B, Cc, ...] rides along on the channel axis (I2V)."""
    x = noise.astype(np.float32)
    b = len(x)
    texts = np.concatenate([text, np.broadcast_to(empty_text, text.shape)]).astype(np.float32)
    s = sigmas(config.steps, config.shift)
    for i in range(config.steps):
        t = float(np.float32(1000.0 * s[i]))  # the t the model sees picks the expert
        expert = expert_at(t, config.boundary_ratio)
        inputs = x if condition is None else np.concatenate([x, condition.astype(np.float32)], axis=1)
        velocity = predict(expert, np.concatenate([inputs, inputs]), np.full(2 * b, t, np.float32), texts)
        cond, uncond = velocity[:b], velocity[b:]
        guided = uncond + config.guidance[expert] * (cond - uncond)
        x = (x + (s[i + 1] - s[i]) * guided).astype(np.float32)
    return x
