"""Optional per-timestep loss weights, normalised over the fixed 1000-point grid.

Normalising over the grid rather than over the sampled batch keeps a sample's weight independent of what else is
in its batch: maxdiffusion's per-batch normalisation yields NaN at batch size 1 and always weights one sample 0.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from wanloom_trainer.routing.sampling import NUM_TRAIN_TIMESTEPS

_GRID = np.arange(NUM_TRAIN_TIMESTEPS, dtype=np.float64) + 0.5


def _bell(t: np.ndarray) -> np.ndarray:
    # Gaussian in t centred mid-schedule: emphasises the mid-noise region that dominates sample quality.
    return np.exp(-2.0 * ((t - NUM_TRAIN_TIMESTEPS / 2) / NUM_TRAIN_TIMESTEPS) ** 2)


_BELL_NORM = float(_bell(_GRID).mean())


def loss_weights(timesteps: np.ndarray, scheme: Literal["none", "bell"]) -> np.ndarray:
    """Per-sample loss weights (float32) for timesteps in [0, 1000); their mean over the grid is 1."""
    t = np.asarray(timesteps, dtype=np.float64)
    if scheme == "none":
        return np.ones_like(t, dtype=np.float32)
    if scheme == "bell":
        return (_bell(t) / _BELL_NORM).astype(np.float32)
    raise ValueError(f"loss weighting {scheme!r} is not one of 'none', 'bell'")
