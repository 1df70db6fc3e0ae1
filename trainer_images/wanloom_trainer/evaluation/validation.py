"""Held-out validation loss while training (``spec.validation``).

``samples`` dataset samples, a seeded choice, are held out of training (``holdout.training_samples`` filters
them from what the planner sees). Every ``everySteps`` steps and after the last one, each held-out sample is scored at
``timestepsPerExpert`` fixed timesteps per expert band (the midpoints of equal parts of ``[boundary, 1000)`` for
the high-noise expert and ``[0, boundary)`` for the low-noise one; ``[0, 1000)`` for a single model) through the
expert that owns the band, with noise that depends only on (seed, sample): the numbers are comparable from one
validation to the next, and a resumed run reproduces them.

With ``videos``, the first held-out samples are also generated (``evaluation.samples``). It all runs on the training
mesh through ``Backend.evaluate`` and ``Backend.predict`` (the training loss without gradients, sharded like
training), leaves parameters, optimizer state and every random stream untouched, and the loop reports its time
apart from step time. Rows are dealt one per data-parallel rank per slot (rows of one latent shape and expert);
ranks without a row get a copy of one with weight 0.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from wanloom_trainer.backends.interface import Slot
from wanloom_trainer.config.train_config import EvaluationConfig
from wanloom_trainer.evaluation.samples import SampleWriter
from wanloom_trainer.feed.holdout import held_out_ids
from wanloom_trainer.feed.inputs import rank_rows

# The noise of validation rows comes from this "step", far from any training step's.
VALIDATION_STEP = 1 << 40


def band_timesteps(boundary_ratio: float | None, per_expert: int) -> list[tuple[int, float]]:
    """(expert, t) for every fixed validation timestep, high-noise band first."""
    if boundary_ratio is None:
        bands = [(0, 0.0, 1000.0)]
    else:
        edge = 1000.0 * boundary_ratio
        bands = [(0, edge, 1000.0), (1, 0.0, edge)]
    return [(e, lo + (hi - lo) * (k + 0.5) / per_expert) for e, lo, hi in bands for k in range(per_expert)]


@dataclass(frozen=True)
class ValidationResult:
    """One validation: after ``step`` steps, each expert's mean loss over its band and its wall time, and the
    videos generated (``samples.Samples``; None without ``videos``) with theirs."""

    step: int
    losses: dict[int, float]
    seconds: float
    samples: Any = None
    sample_seconds: float = 0.0


class Validator:
    """Scores the held-out samples with the current weights; every process calls ``run`` at the same steps."""

    def __init__(self, config: EvaluationConfig, backend: Any, dataset: Any, ranks: Sequence[int]) -> None:
        self.config, self.spec, self.backend, self.dataset = config, config.spec, backend, dataset
        self.ranks = list(ranks)
        self.ids = held_out_ids(dataset.sample_shapes().ids, self.spec, config.seed)
        self.pairs = [
            (int(sid), e, t)
            for sid in self.ids
            for e, t in band_timesteps(config.boundary_ratio, self.spec.timesteps_per_expert)
        ]
        self._batches: dict[int, Any] = {}  # held-out samples, loaded once
        generates = self.spec.videos or self.spec.prompt_size is not None
        self.videos = SampleWriter(config, backend, dataset, self.ids) if generates else None

    def due(self, steps_done: int) -> bool:
        return steps_done % self.spec.every_steps == 0 or steps_done == self.config.steps

    def run(self, state: Any, steps_done: int) -> ValidationResult:
        started = time.perf_counter()
        losses: dict[int, float] = {}
        for slot in self._slots():
            losses[slot.expert] = losses.get(slot.expert, 0.0) + self.backend.evaluate(state, slot)
        seconds = time.perf_counter() - started
        if self.videos is None:
            return ValidationResult(steps_done, losses, seconds)
        started = time.perf_counter()
        samples = self.videos.run(state, steps_done)
        return ValidationResult(steps_done, losses, seconds, samples, time.perf_counter() - started)

    def _slots(self) -> list[Slot]:
        """Slots of one expert and latent shape, a row per data-parallel rank (pairs in a fixed order)."""
        shapes = self.dataset.latent_shapes
        per_expert: dict[int, int] = {}
        groups: dict[tuple[int, tuple[int, ...]], list[tuple[int, float]]] = {}
        for sid, e, t in self.pairs:
            per_expert[e] = per_expert.get(e, 0) + 1
            groups.setdefault((e, tuple(int(v) for v in shapes[sid])), []).append((sid, t))
        num_ranks = self.config.batch_ranks
        slots = []
        for (e, _), pairs in sorted(groups.items()):
            for start in range(0, len(pairs), num_ranks):
                chunk = pairs[start : start + num_ranks]
                rows = {}
                for r in self.ranks:
                    sid, t = chunk[r] if r < len(chunk) else chunk[0]
                    weight = 1.0 / per_expert[e] if r < len(chunk) else 0.0
                    rows[r] = self._rows(sid, t, weight)
                slots.append(Slot(expert=e, ranks=rows))
        return slots

    def _rows(self, sample_id: int, t: float, weight: float) -> Any:
        if sample_id not in self._batches:
            self._batches[sample_id] = self.dataset.load([sample_id])
        per_token = self.config.model.wan.per_token_timesteps
        return rank_rows(
            self._batches[sample_id],
            np.asarray([t], np.float32),
            np.asarray([weight], np.float32),
            seed=self.config.seed,
            step=VALIDATION_STEP,
            loss_weighting="none",
            image_to_video=0.0 if per_token else None,
        )
