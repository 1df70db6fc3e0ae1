"""From plans to backend inputs: the planner for a run, and loaded micro-batches → ``backend.Slot``.

Framework-free (numpy): both backends get the same rows, noise, timesteps and weights for the same plan.
The loss weight of a row is the plan's weight (1/globalBatch for real rows, 0 for padding and bad samples) times
the routing loss weight of its timestep (``routing.loss_weights``, normalised over the fixed 1000-point grid).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from wanloom_trainer.backends.interface import RankRows, Slot
from wanloom_trainer.backends.objective import batch_noise, caption_dropped, clean_first_frames
from wanloom_trainer.backends.packing import PackedRows, pack_rows
from wanloom_trainer.config.train_config import TrainConfig
from wanloom_trainer.feed.holdout import training_samples
from wanloom_trainer.routing import loss_weights


def make_planner(config: TrainConfig, sample_shapes: Any, *, layout: str) -> Any:
    """The AdaptiveLoad planner of this run (``layout``: "spmd" for JAX, "per-rank" for PyTorch); the cost model
    comes from ``adaptiveload.cost.cost_source`` (a stored shape benchmark, else the analytic FLOP model)."""
    from wanloom_trainer.adaptiveload.cost.cost_source import resolve_cost_model
    from wanloom_trainer.adaptiveload.planner import planner_from_config

    sample_shapes = training_samples(sample_shapes, config.validation, config.seed)  # held-out samples stay out
    al = config.adaptive_load
    cost = resolve_cost_model(config, sample_shapes=sample_shapes).model
    policy = al.scheduler if al.enabled else "equal-tokens"
    return planner_from_config(config, sample_shapes, cost, policy=policy, layout=layout)


def rank_rows(
    batch: Any,
    timesteps: np.ndarray,
    weights: np.ndarray,
    *,
    seed: int,
    step: int,
    loss_weighting: str,
    image_to_video: float | None = None,
    caption_dropout: float = 0.0,
    empty_text: np.ndarray | None = None,
) -> RankRows:
    """Loaded rows (``data.LatentBatch``) with their planned timesteps and weights as one rank's rows, with their
    noise and loss weights.

    ``image_to_video``: for a unified TI2V model, the share of video rows whose first frame is kept clean
    (``objective.clean_first_frames``); None for the other models (no per-token timesteps).
    ``caption_dropout``: the share of rows whose text is replaced by ``empty_text`` (float32 [L, D_text], the
    dataset's empty-prompt embedding zero-padded like every text; ``objective.caption_dropped``).
    """
    timesteps = timesteps.astype(np.float32)
    weights = (weights * loss_weights(timesteps, loss_weighting)).astype(np.float32)
    clean = None
    if image_to_video is not None:
        clean = clean_first_frames(seed, step, batch.sample_ids, batch.latents.shape[2], image_to_video)
    text = batch.text_embeds
    if caption_dropout > 0.0:
        if empty_text is None:
            raise ValueError("caption dropout needs the dataset's empty-prompt embedding")
        dropped = caption_dropped(seed, step, batch.sample_ids, caption_dropout)
        text = np.where(dropped[:, None, None], empty_text[None], text).astype(np.float32, copy=False)
    return RankRows(
        sample_ids=np.asarray(batch.sample_ids, dtype=np.int64),
        latents=batch.latents,
        text=text,
        noise=batch_noise(seed, step, batch.sample_ids, batch.latents.shape[1:]),
        timesteps=timesteps,
        weights=weights,
        condition=batch.condition,
        clean_first_frame=clean,
    )


def loaded_rows(loaded: Any, *, seed: int, patch: tuple[int, int, int], **options: Any) -> RankRows | PackedRows:
    """A loaded micro-batch (``data.LoadedMicroBatch``) as one rank's rows; a packed one as its packed row.
    ``options``: ``rank_rows``'s keyword arguments other than ``seed`` and ``step``."""
    if not loaded.packed:
        return rank_rows(loaded.batch, loaded.timesteps, loaded.weights, seed=seed, step=loaded.step, **options)
    t, w = loaded.timesteps, loaded.weights
    segments = [
        rank_rows(seg, t[j : j + 1], w[j : j + 1], seed=seed, step=loaded.step, **options)
        for j, seg in enumerate(loaded.batch)
    ]
    row = loaded.micro_batch.packed
    return pack_rows(
        [segments], row_tokens=row.row_tokens, groups=row.groups, patch=patch, max_segment_tokens=row.max_segment_tokens
    )


def step_slots(
    step_data: Sequence[Any], ranks: Sequence[int], *, num_experts: int
) -> tuple[list[Slot], tuple[int, ...]]:
    """The step's slots from each local rank's micro-batches (``data_process.PreparedStep``: same step, same number
    of micro-batches, rows built by ``step_rows``), and the planned samples per expert these ranks could not load
    (skipped: their rows carry weight 0)."""
    per_rank = [list(sd) for sd in step_data]
    counts = {len(mbs) for mbs in per_rank}
    if len(counts) != 1:
        raise ValueError(f"local ranks {list(ranks)} have different micro-batch counts {sorted(counts)}")
    slots, skipped = [], [0] * num_experts
    for k in range(counts.pop()):
        loaded = [mbs[k] for mbs in per_rank]
        for mb in loaded:
            skipped[mb.expert] += mb.skipped
        experts = {mb.expert for mb in loaded}
        if len(experts) != 1:
            raise ValueError(f"micro-batch slot {k} mixes experts {sorted(experts)} across ranks")
        rows = {r: mb.rows for r, mb in zip(ranks, loaded, strict=True)}
        slots.append(Slot(expert=experts.pop(), ranks=rows))
    return slots, tuple(skipped)


def renormalised(slots: list[Slot], factor: float) -> list[Slot]:
    """Slots with every loss weight times ``factor``: planned samples / samples actually loaded, so skipped rows
    leave the loss normaliser (weights were 1/planned) and the loss stays the mean over the samples trained on."""
    if factor == 1.0:
        return slots
    return [
        Slot(s.expert, {r: dataclasses.replace(rows, weights=rows.weights * np.float32(factor))
                        for r, rows in s.ranks.items()})
        for s in slots
    ]  # fmt: skip


def step_rows(config: Any, empty_text: np.ndarray | None = None) -> Any:
    """The prefetcher's ``prepare``: a loaded micro-batch as rows (``loaded_rows`` with the run's settings), built in
    the data process's loading threads so the training process does not generate noise or pack rows itself.
    ``empty_text``: the dataset's padded empty-prompt embedding, needed when ``config.caption_dropout`` > 0."""
    return functools.partial(
        loaded_rows,
        seed=config.seed,
        patch=config.model.wan.patch_size,
        loss_weighting=config.routing.loss_weighting,
        image_to_video=config.image_to_video_fraction if config.model.wan.per_token_timesteps else None,
        caption_dropout=config.caption_dropout,
        empty_text=empty_text,
    )
