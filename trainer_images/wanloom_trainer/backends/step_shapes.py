"""What ``wanloom compile`` checks a job at, for either accelerator (``compile_tpu``, ``compile_gpu``): the job's
configuration with the command's overrides, and its micro-batch shapes."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from wanloom_trainer.config.train_config import TrainConfig

# The shape a job is compiled at when it names no buckets: each variant's flagship training clip (pixels F×H×W).
REFERENCE_PIXELS = {
    "wan2.2-t2v-a14b": (81, 720, 1280),
    "wan2.2-i2v-a14b": (81, 720, 1280),
    "wan2.2-ti2v-5b": (121, 704, 1280),
}


def compile_shapes(config: TrainConfig, pixels: np.ndarray | None = None) -> np.ndarray:
    """Latent shapes [k, 3] to compile: the given pixel shapes (F, H, W), else the job's buckets, else the
    variant's reference clip."""
    from wanloom_trainer.adaptiveload.sizing.tokens import latent_shapes_for_pixels

    if pixels is None and config.adaptive_load.buckets is not None:
        pixels = np.asarray([b.pixels for b in config.adaptive_load.buckets])
    if pixels is None:
        reference = REFERENCE_PIXELS.get(config.model.variant)
        if reference is None:
            raise ValueError(
                f"wanloom compile: spec.adaptiveLoad.buckets is unset and {config.model.variant} has no reference "
                "shape; name the shapes with spec.adaptiveLoad.buckets or --shape FxHxW"
            )
        pixels = np.asarray([reference])
    return latent_shapes_for_pixels(config.model.wan, np.atleast_2d(pixels))


def checked_config(job: Any, *, layers: int | None, remat: str | None) -> TrainConfig:
    """The job's trainer configuration with ``--layers`` / ``--remat`` applied and checkpoints off (nothing is
    trained)."""
    from wanloom_trainer.config.train_config import from_trainingjob

    config = from_trainingjob(job, {})
    model = config.model
    if layers is not None:
        model = dataclasses.replace(model, num_layers=layers)
    if remat is not None:
        model = dataclasses.replace(model, remat=remat)
    return dataclasses.replace(config, model=model, checkpoint=config.checkpoint.model_copy(update={"uri": None}))
