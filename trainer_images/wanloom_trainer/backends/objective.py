"""The rectified-flow objective's framework-free pieces, shared by the JAX and PyTorch trainers.

Everything random is a pure function of ``(seed, step, sample_id)``, so both backends, any parallel layout and a
resumed run see the same noise for the same sample at the same step:

    σ   = t / 1000                            (t: the routed timestep, float32, never bf16)
    x_t = (1 − σ)·x0 + σ·ε                     ε ~ N(0, I) from ``sample_noise(seed, step, sample_id, shape)``
    v   = ε − x0                               (the target velocity)
    loss_i = mean over (C, T', H', W') of (model(x_t, t) − v)²
    step loss = Σ_i w_i·loss_i / num_samples   (w_i: ``routing.loss_weights``; num_samples: the whole global step)

The normalisation by the global sample count (not per micro-batch or per rank) makes the gradient independent of
how AdaptiveLoad splits a step into micro-batches and ranks.

Image-to-video rows of a unified model (Wan 2.2 TI2V: per-token timesteps) keep their first latent frame clean:
its timestep is 0 (so σ = 0 and x_t equals x0 there, and the model sees t = 0 on that frame's tokens) and the
loss is the mean over the other frames only. ``clean_first_frames`` picks those rows; the other rows train
text-to-video with the same per-token layout (every token at t). ``flow_matching_loss_np`` is the numpy reference the
JAX and torch losses are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NUM_TRAIN_TIMESTEPS = 1000
_NOISE_STREAM = 0x4E01  # separates noise draws from routing (0x57A9) and data-order consumers of the same seed
_I2V_STREAM = 0x1F2E
_CAPTION_STREAM = 0xCA9D


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


def clean_first_frames(
    seed: int, step: int, sample_ids: Sequence[int], latent_frames: int, fraction: float
) -> np.ndarray:
    """float32 [b]: 1 for the rows trained as image-to-video (first latent frame clean), else 0.

    Each real sample is drawn independently with probability ``fraction`` from ``(seed, step, sample_id)``;
    images (one latent frame: nothing left to predict) and placeholder rows (id < 0) are never chosen.
    """
    if latent_frames < 2 or fraction <= 0.0:
        return np.zeros(len(sample_ids), np.float32)
    draws = [
        np.random.default_rng([int(seed), int(step), int(i), _I2V_STREAM]).random() if int(i) >= 0 else 1.0
        for i in sample_ids
    ]
    return (np.asarray(draws) < fraction).astype(np.float32)


def caption_dropped(seed: int, step: int, sample_ids: Sequence[int], share: float) -> np.ndarray:
    """bool [b]: the rows trained on the empty prompt this step, each real sample drawn independently with
    probability ``share`` from ``(seed, step, sample_id)`` (so a resumed run drops the same ones); placeholder
    rows (id < 0) never."""
    if share <= 0.0:
        return np.zeros(len(sample_ids), bool)
    draws = [
        np.random.default_rng([int(seed), int(step), int(i), _CAPTION_STREAM]).random() if int(i) >= 0 else 1.0
        for i in sample_ids
    ]
    return np.asarray(draws) < share


def frame_timesteps_np(timesteps: np.ndarray, clean_first_frame: np.ndarray, latent_frames: int) -> np.ndarray:
    """float32 [b, T']: each row's t on every latent frame, 0 on frame 0 of the rows whose first frame is clean."""
    t = np.repeat(np.asarray(timesteps, np.float32)[:, None], latent_frames, axis=1)
    t[:, 0] *= np.float32(1.0) - np.asarray(clean_first_frame, np.float32)
    return t


def sigmas(timesteps: np.ndarray) -> np.ndarray:
    """σ = t / 1000 in float32."""
    return (np.asarray(timesteps, dtype=np.float32) / np.float32(NUM_TRAIN_TIMESTEPS)).astype(np.float32)


def noisy_latents_np(x0: np.ndarray, noise: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
    """x_t = (1 − σ)·x0 + σ·ε for x0, ε [b, C, T', H', W'] and t [b], or per latent frame [b, T']."""
    t = np.asarray(timesteps)
    shape = (-1, 1, t.shape[1], 1, 1) if t.ndim == 2 else (-1,) + (1,) * (x0.ndim - 1)
    sigma = sigmas(t).reshape(shape)
    return ((1.0 - sigma) * x0 + sigma * noise).astype(np.float32)


def velocity_target_np(x0: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """v = ε − x0."""
    return (noise - x0).astype(np.float32)


def per_sample_loss_np(
    prediction: np.ndarray, target: np.ndarray, clean_first_frame: np.ndarray | None = None
) -> np.ndarray:
    """Mean squared error per sample, float64 [b] (the reference accumulates in double); rows whose first frame
    is clean average over the other frames only."""
    diff = prediction.astype(np.float64) - target.astype(np.float64)
    if clean_first_frame is None:
        return np.mean(diff * diff, axis=tuple(range(1, diff.ndim)))
    rows = [d[:, 1:] if c else d for d, c in zip(diff, clean_first_frame, strict=True)]
    return np.array([np.mean(r * r) for r in rows])


def flow_matching_loss_np(
    prediction: np.ndarray,
    x0: np.ndarray,
    noise: np.ndarray,
    weights: np.ndarray,
    num_samples: int,
    clean_first_frame: np.ndarray | None = None,
) -> float:
    """The step-loss contribution Σ_i w_i·loss_i / num_samples of one micro-batch (numpy reference)."""
    losses = per_sample_loss_np(prediction, velocity_target_np(x0, noise), clean_first_frame)
    return float(np.sum(np.asarray(weights, dtype=np.float64) * losses) / num_samples)
