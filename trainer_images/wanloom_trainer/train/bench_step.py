"""The shape benchmark's step: one optimizer step of the job's own backend on synthetic rows.

``wanloom plan --bench`` times this over a grid of (B, latent shape) (``measure_shape_bench``; the grid and the fit
are ``adaptiveload.cost.shape_bench``'s) and hands AdaptiveLoad the timing points to fit its cost model. It runs what
the trainer runs — the job's mesh and sharding (FSDP2 / the SPMD program), kernels, attention, remat, precision and
AdamW update — so the fitted costs include the collectives and the kernels' real
speed; an unsharded model on one device would leave both out. Every data-parallel rank this process feeds gets
B rows of the shape; both experts exist, the high-noise one is stepped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wanloom_trainer.adaptiveload.cost.shape_bench import BenchPoint, run_shape_bench, shape_grid
from wanloom_trainer.adaptiveload.sizing.buckets import derive_buckets
from wanloom_trainer.backends.interface import RankRows, Slot, StepInputs


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


def measure_shape_bench(config: Any, sample_shapes: Any) -> list[BenchPoint]:
    """Time the job's own training step (its backend, mesh and kernels) over the shape grid of its buckets, on this
    machine's device of the job's kind (``config``: ``config.TrainConfig``; ``sample_shapes``: the dataset's)."""
    if not _on_job_devices(config):
        raise ValueError(
            f"the shape benchmark must run on the job's {config.accelerator_type or config.accelerator} devices; "
            "run `wanloom plan --bench FILE` where they are (e.g. in a trainer pod), or drop --bench to plan "
            "with the analytic FLOP model"
        )
    variant = config.model.wan
    shapes = derive_buckets(sample_shapes.latent_shapes).latent_shapes.tolist()
    grid = shape_grid(variant, shapes, config.adaptive_load.memory_budget_tokens)
    return run_shape_bench(BackendStep(config), grid, variant, warmup=1, repeats=3)


def _on_job_devices(config: Any) -> bool:
    if config.accelerator == "cpu":
        return True
    if config.backend == "torch":
        import torch

        return config.accelerator == "gpu" and torch.cuda.is_available()
    import jax

    return jax.default_backend() == config.accelerator
