"""The shape benchmark's step: one optimizer step of the job's own backend on synthetic rows.

``wanloom plan --bench`` times this over a grid of (B, latent shape) (``adaptiveload.shape_bench``) to fit the
cost model. It runs what the trainer runs — the job's mesh and sharding (FSDP2 / the SPMD program), kernels,
attention, remat, precision and AdamW update — so the fitted costs include the collectives and the kernels' real
speed; an unsharded model on one device would leave both out. Every data-parallel rank this process feeds gets
B rows of the shape; both experts exist, the high-noise one is stepped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wanloom_trainer.train.backend import RankRows, Slot, StepInputs


def synthetic_rows(variant: Any, batch: int, latent_shape: tuple[int, int, int], weight: float, seed: int) -> RankRows:
    """``batch`` rows of ``latent_shape`` with random latents, text and noise (timing does not depend on values)."""
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal((batch, variant.out_channels, *latent_shape), dtype=np.float32)
    condition = None
    if variant.in_channels > variant.out_channels:
        condition = np.zeros((batch, variant.in_channels - variant.out_channels, *latent_shape), np.float32)
    return RankRows(
        sample_ids=np.zeros(batch, np.int64),
        latents=latents,
        text=rng.standard_normal((batch, variant.text_len, variant.text_dim), dtype=np.float32),
        noise=rng.standard_normal(latents.shape, dtype=np.float32),
        timesteps=rng.uniform(0.0, 1000.0, batch).astype(np.float32),
        weights=np.full(batch, weight, np.float32),
        condition=condition,
        clean_first_frame=np.zeros(batch, np.float32) if variant.per_token_timesteps else None,
    )


class BackendStep:
    """``step(batch, latent_shape)``: the job's training step (``config``: ``config.TrainConfig``) on the backend
    given (default: the job's, built here); ``state`` is the training state it has stepped so far."""

    def __init__(self, config: Any, backend: Any | None = None) -> None:
        from wanloom_trainer.train.run import make_backend

        self.config = config
        self.backend = backend if backend is not None else make_backend(config)
        self.state = self.backend.init_state()
        self._ranks = self.backend.local_ranks(config.parallel.batch_ranks)

    def __call__(self, batch: int, latent_shape: tuple[int, int, int]) -> None:
        cfg = self.config
        samples, experts = batch * cfg.parallel.batch_ranks, cfg.model.num_experts
        rows = {r: synthetic_rows(cfg.model.wan, batch, latent_shape, 1.0 / samples, seed=r) for r in self._ranks}
        inputs = StepInputs(
            step=0,
            slots=[Slot(0, rows)],
            num_samples=samples,
            expert_samples=(samples, *([0] * (experts - 1))),
            learning_rates=(cfg.optimizer.learning_rate,) * experts,
        )
        # train_step returns host floats (loss, gradient norm): the device has finished the step.
        self.state, _ = self.backend.train_step(self.state, inputs)
