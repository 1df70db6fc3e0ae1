"""The rectified-flow objective's framework-free pieces, shared by the JAX and PyTorch trainers.

Everything random is a pure function of ``(seed, step, sample_id)``, so both backends, any parallel layout and a
resumed run see the same noise for the same sample at the same step:

    σ   = t / 1000                            (t: the routed timestep, float32, never bf16)
    x_t = (1 − σ)·x0 + σ·ε                     ε ~ N(0, I) from ``sample_noise(seed, step, sample_id, shape)``
    v   = ε − x0                               (the target velocity)
    loss_i = mean over (C, T', H', W') of (model(x_t, t) − v)²
    step loss = Σ_i w_i·loss_i / num_samples   (w_i: ``routing.loss_weights``; num_samples: the whole global step)

The normalisation by the global sample count (not per micro-batch or per rank) makes the gradient independent of
how AdaptiveLoad splits a step into micro-batches and ranks. ``flow_matching_loss_np`` is the numpy reference the
JAX and torch losses are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NUM_TRAIN_TIMESTEPS = 1000
_NOISE_STREAM = 0x4E01  # separates noise draws from routing (0x57A9) and data-order consumers of the same seed


def sample_noise(seed: int, step: int, sample_id: int, shape: Sequence[int]) -> np.ndarray:
    """Standard normal noise ε (float32, ``shape``) for one sample at one global step."""
    rng = np.random.default_rng([int(seed), int(step), int(sample_id), _NOISE_STREAM])
    return rng.standard_normal(tuple(shape), dtype=np.float32)


def batch_noise(seed: int, step: int, sample_ids: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """ε for a micro-batch: float32 [b, *shape], one independent draw per sample id (zeros for id < 0, the
    loader's placeholder rows, which carry no loss weight)."""
    rows = [
        sample_noise(seed, step, int(i), shape) if int(i) >= 0 else np.zeros(tuple(shape), np.float32)
        for i in sample_ids
    ]
    return np.stack(rows).astype(np.float32, copy=False)


def sigmas(timesteps: np.ndarray) -> np.ndarray:
    """σ = t / 1000 in float32."""
    return (np.asarray(timesteps, dtype=np.float32) / np.float32(NUM_TRAIN_TIMESTEPS)).astype(np.float32)


def noisy_latents_np(x0: np.ndarray, noise: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
    """x_t = (1 − σ)·x0 + σ·ε for x0, ε [b, C, T', H', W'] and t [b]."""
    sigma = sigmas(timesteps).reshape((-1,) + (1,) * (x0.ndim - 1))
    return ((1.0 - sigma) * x0 + sigma * noise).astype(np.float32)


def velocity_target_np(x0: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """v = ε − x0."""
    return (noise - x0).astype(np.float32)


def per_sample_loss_np(prediction: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Mean squared error per sample, float64 [b] (the reference accumulates in double)."""
    diff = prediction.astype(np.float64) - target.astype(np.float64)
    return np.mean(diff * diff, axis=tuple(range(1, diff.ndim)))


def flow_matching_loss_np(
    prediction: np.ndarray, x0: np.ndarray, noise: np.ndarray, weights: np.ndarray, num_samples: int
) -> float:
    """The step-loss contribution Σ_i w_i·loss_i / num_samples of one micro-batch (numpy reference)."""
    losses = per_sample_loss_np(prediction, velocity_target_np(x0, noise))
    return float(np.sum(np.asarray(weights, dtype=np.float64) * losses) / num_samples)
