"""The dataset samples ``spec.validation`` holds out of training: chosen here, left out of planning by
``inputs.make_planner`` and scored by ``validation.Validator``."""

from __future__ import annotations

from typing import Any

import numpy as np

from wanloom_api.trainingjob import ValidationSpec

_HOLD_OUT_STREAM = 0x7A11


def held_out_ids(sample_ids: np.ndarray, spec: ValidationSpec, seed: int) -> np.ndarray:
    """The sorted ids held out of training: a seeded choice of ``spec.samples`` among ``sample_ids``."""
    n = len(sample_ids)
    if spec.samples >= n:
        raise ValueError(
            f"spec.validation.samples={spec.samples} would hold out every sample of the dataset ({n}); "
            f"use at most {n - 1}"
        )
    rng = np.random.default_rng([seed, _HOLD_OUT_STREAM])
    return np.sort(rng.choice(np.asarray(sample_ids, np.int64), spec.samples, replace=False))


def training_samples(shapes: Any, spec: ValidationSpec | None, seed: int) -> Any:
    """``shapes`` (``adaptiveload.SampleShapes``) without the held-out samples."""
    if spec is None:
        return shapes
    from wanloom_trainer.adaptiveload.sizing.shape_index import SampleShapes

    keep = ~np.isin(shapes.ids, held_out_ids(shapes.ids, spec, seed))
    return SampleShapes(shapes.ids[keep], shapes.latent_shapes[keep])
