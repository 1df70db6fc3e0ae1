"""``plan_step``: a step's samples → ranks → micro-batches, deterministic in (seed, step).

Policies (``PlanConfig.policy``):

- ``balanced`` (beyond the paper): a fixed global batch of ``global_batch`` samples per step from the seeded
  epoch stream (``scheduler.SampleStream``); per-rank layout: samples are assigned to (rank, slot) so that every
  lockstep slot is balanced (``lockstep``) or, synchronising once per step, per-rank totals are
  (``balance.balance``); SPMD layout: samples are packed into one row per rank per slot under the dual constraint
  and balanced across rows (``packing``).
- ``paper``: per-bucket batch sizes ``B = max(1, min(⌊M_mem/S⌋, ⌊M_comp/S^p⌋))``; each rank draws one bucket chunk
  per step (``scheduler.BucketChunks``), so the global sample count varies per step.
- ``equal-tokens``: the same with ``B = ⌊M_mem/S⌋``.

``PlanConfig.same_samples`` (the simulator, ``wanloom plan``) gives the two baselines the balanced policy's
samples instead: each step takes ``global_batch`` samples from the same stream, dealt to ranks in stream order
(per-rank layout) or grouped by bucket over all ranks (SPMD), then cut into micro-batches of their batch sizes, so
every policy is compared on the same work.

Routing draws the step's timesteps and experts once for all its samples (``Router.draw(seed, step, n)``); each
micro-batch is then expert-homogeneous.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from wanloom_trainer.adaptiveload.balance import balance
from wanloom_trainer.adaptiveload.batch_size import (
    default_compute_budget,
    equal_token_batch_sizes,
    paper_batch_sizes,
)
from wanloom_trainer.adaptiveload.buckets import BucketTable, derive_buckets
from wanloom_trainer.adaptiveload.cost_model import CostModel, effective_exponent
from wanloom_trainer.adaptiveload.layout import (
    Assignment,
    BucketFacts,
    StepItems,
    cost_grid,
    critical_work,
    materialise,
    per_rank_assignment,
    slots_by_group,
    spmd_assignment,
)
from wanloom_trainer.adaptiveload.lockstep import lockstep_assign
from wanloom_trainer.adaptiveload.packing import packed_assignment
from wanloom_trainer.adaptiveload.plan import LAYOUTS, POLICIES, LocalPlan, StepPlan
from wanloom_trainer.adaptiveload.scheduler import BucketChunks, SampleStream
from wanloom_trainer.adaptiveload.shape_index import SampleShapes
from wanloom_trainer.adaptiveload.tokens import tokens_for_latents
from wanloom_trainer.config.variants import WanVariant

SYNCS = ("micro-batch", "step")


class Router(Protocol):
    """``wanloom_trainer.routing.Router``: ``draw(seed, step, n)`` → object with ``timesteps`` and ``experts``."""

    def draw(self, seed: int, step: int, n: int) -> Any: ...


@dataclass(frozen=True)
class PlanConfig:
    """Planner settings (from ``spec.adaptiveLoad`` and ``spec.training``).

    Attributes:
        num_ranks: data-parallel ranks R.
        policy: "balanced", "paper" or "equal-tokens".
        layout: "per-rank" (PyTorch FSDP) or "spmd" (JAX).
        global_batch: samples per step; required by "balanced".
        memory_budget_tokens: M_mem, tokens per micro-batch.
        compute_budget: M_comp of the paper rule; default the median memory-full batch compute
            (``batch_size.default_compute_budget``).
        exponent: p of the paper rule; default fitted to the cost model over the dataset's buckets.
        seed: data-order and routing seed.
        sync: when per-rank ranks synchronise: "micro-batch" (FSDP: collectives in every micro-batch, so the
            step takes Σ_slots max_rank; "balanced" balances every slot, see ``lockstep``) or "step" (DDP-style
            accumulation without sync until the last micro-batch: the step takes max_rank Σ_slots; "balanced"
            balances per-rank totals, see ``balance``).
        repair_iters: local-search iterations after LPT (sync "step").
        sequence_multiple: packed rows are multiples of this many tokens (context × tensor: the sequence sharding).
        same_samples: baselines run the balanced policy's samples (module docstring).
    """

    num_ranks: int
    policy: str = "balanced"
    layout: str = "per-rank"
    global_batch: int | None = None
    memory_budget_tokens: int = 32_768
    compute_budget: float | None = None
    exponent: float | None = None
    seed: int = 0
    sync: str = "micro-batch"
    repair_iters: int = 64
    sequence_multiple: int = 1
    same_samples: bool = False

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.policy not in POLICIES:
            raise ValueError(f"adaptiveLoad.scheduler {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if self.sync not in SYNCS:
            raise ValueError(f"sync {self.sync!r} is not one of {', '.join(SYNCS)}")
        needs_batch = self.policy == "balanced" or self.same_samples
        if needs_batch and (self.global_batch is None or self.global_batch < 1):
            raise ValueError(f"scheduler 'balanced' needs training.globalBatch >= 1, got {self.global_batch}")


# Balanced scheduling moves whole samples between ranks; with fewer per rank it cannot even out long clips.
MIN_SAMPLES_PER_RANK = 4


def plan_warnings(config: PlanConfig, dataset_size: int) -> list[str]:
    """What makes a plan worse than the user expects, in words naming the fields (logged by the trainer, printed
    by ``wanloom plan``)."""
    out = []
    batch = config.global_batch
    if batch is not None and (config.policy == "balanced" or config.same_samples):
        if batch > dataset_size:
            out.append(
                f"training.globalBatch {batch} exceeds the dataset's {dataset_size} samples: samples repeat within "
                "a step; lower globalBatch or add data"
            )
        if batch < MIN_SAMPLES_PER_RANK * config.num_ranks:
            out.append(
                f"training.globalBatch {batch} gives {batch / config.num_ranks:.2g} samples per data-parallel rank "
                f"({config.num_ranks} ranks); balancing needs about {MIN_SAMPLES_PER_RANK} or more per rank, "
                f"so raise globalBatch to >= {MIN_SAMPLES_PER_RANK * config.num_ranks} or expect idle ranks"
            )
    return out


def _check_costs(cost_model: CostModel, facts: BucketFacts) -> None:
    """A cost model predicting a NaN, infinite, zero or negative cost would silently mis-balance every step."""
    bad = ~np.isfinite(facts.cost) | (facts.cost <= 0)
    if bad.any() or not np.isfinite(facts.overhead) or facts.overhead < 0:
        where = f"bucket {tuple(facts.shapes[int(np.argmax(bad))])}" if bad.any() else "per-call overhead"
        raise ValueError(
            f"adaptiveLoad cost model {cost_model.to_dict()} predicts an invalid cost for {where} (costs must be "
            "finite and positive, the overhead finite and >= 0); refit it (wanloom plan --bench) or fix "
            "spec.adaptiveLoad"
        )


class Planner:
    """Plans steps for one dataset; holds only derived, immutable tables and epoch caches."""

    def __init__(
        self,
        index: SampleShapes,
        variant: WanVariant,
        config: PlanConfig,
        cost_model: CostModel,
        router: Router,
        buckets: BucketTable | None = None,
    ) -> None:
        self.index, self.variant, self.config, self.router = index, variant, config, router
        self.buckets = buckets if buckets is not None else derive_buckets(index.latent_shapes)
        self.bucket_of = self.buckets.assign(index.latent_shapes)
        # Only buckets that hold samples can break the memory budget or set the paper rule's defaults.
        self._present = np.unique(self.bucket_of)
        equal_token_batch_sizes(
            tokens_for_latents(variant, self.buckets.latent_shapes)[self._present], config.memory_budget_tokens
        )
        self._use_cost_model(cost_model)
        self.warnings = plan_warnings(config, len(index))
        self._stream = SampleStream(len(index), config.seed)

    def _use_cost_model(self, cost_model: CostModel) -> None:
        """Everything derived from the cost model: bucket costs, p, M_comp, batch sizes, the chunk streams."""
        config, tokens = self.config, tokens_for_latents(self.variant, self.buckets.latent_shapes)
        m_mem, present = config.memory_budget_tokens, self._present
        self.cost_model = cost_model
        self.exponent = config.exponent or effective_exponent(cost_model, tokens[present])
        counts = np.bincount(self.bucket_of, minlength=len(tokens))[present]
        self.compute_budget = config.compute_budget or default_compute_budget(
            tokens[present], self.exponent, m_mem, counts
        )
        self.facts = BucketFacts(
            shapes=self.buckets.latent_shapes,
            tokens=tokens,
            cap=np.maximum(1, m_mem // tokens),
            cost=np.asarray(cost_model.sample_cost(tokens), dtype=np.float64),
            overhead=float(cost_model.overhead),
        )
        _check_costs(cost_model, self.facts)
        self.batch_sizes = self._batch_sizes(config.policy)
        self._chunks: BucketChunks | None = None
        if config.policy != "balanced" and not config.same_samples:
            group = config.num_ranks if config.layout == "spmd" else 1
            self._chunks = BucketChunks(self.bucket_of, self.batch_sizes * group, config.seed)

    def with_cost_model(self, cost_model: CostModel) -> Planner:
        """The same planner (dataset, buckets, sample order) planning with ``cost_model`` (an online refit)."""
        planner = copy.copy(self)
        planner._use_cost_model(cost_model)
        return planner

    def _batch_sizes(self, policy: str) -> np.ndarray:
        """Rows per rank per step for each bucket: the paper's B_shape, or the memory cap for "balanced"."""
        m_mem = self.config.memory_budget_tokens
        tokens = np.minimum(self.facts.tokens, m_mem)  # empty buckets may exceed it; they are never drawn
        if policy == "paper":
            return paper_batch_sizes(tokens, m_mem, self.compute_budget, self.exponent)
        return equal_token_batch_sizes(tokens, m_mem)

    def step_samples(self, step: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Index positions [n] of the step's samples and, for bucket-chunk policies, their rank [n] (else None)."""
        cfg = self.config
        if self._chunks is None:
            pos = self._stream.step(step, int(cfg.global_batch or 0))
            dealt = cfg.policy != "balanced" and cfg.layout == "per-rank"
            return pos, (np.arange(len(pos)) % cfg.num_ranks if dealt else None)
        if cfg.layout == "spmd":
            _, pos = self._chunks.chunk(step)
            return pos, None
        chunks = [self._chunks.chunk(step * cfg.num_ranks + r)[1] for r in range(cfg.num_ranks)]
        owner = np.repeat(np.arange(cfg.num_ranks), [len(c) for c in chunks])
        return np.concatenate(chunks), owner

    def assign(self, step: int) -> Assignment:
        """The decisions of global step ``step`` as arrays: a pure function of the seed, the step and the fixed
        inputs. This is the planning work; ``plan``/``plan_local`` only turn it into objects."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        cfg, facts = self.config, self.facts
        pos, owner = self.step_samples(step)
        draw = self.router.draw(cfg.seed, step, len(pos))
        timesteps, experts = (draw.timesteps, draw.experts) if hasattr(draw, "timesteps") else draw
        items = StepItems(
            ids=self.index.ids[pos],
            bucket=self.bucket_of[pos],
            expert=np.asarray(experts, dtype=np.int64),
            timesteps=np.asarray(timesteps, dtype=np.float32),
        )
        if cfg.layout == "spmd" and cfg.policy == "balanced":
            return packed_assignment(
                items,
                cfg.num_ranks,
                facts,
                memory_budget_tokens=cfg.memory_budget_tokens,
                compute_budget=self.compute_budget,
                exponent=self.exponent,
                pad_cost=self.cost_model.sample_cost,
                sequence_multiple=cfg.sequence_multiple,
            )
        if cfg.layout == "spmd":
            return spmd_assignment(items, cfg.num_ranks, facts, self.batch_sizes)
        if owner is None and cfg.sync == "micro-batch":
            owner, slot = lockstep_assign(
                items.bucket, items.expert, facts.cost, facts.cap, cfg.num_ranks, facts.overhead
            )
        else:
            if owner is None:
                groups = items.expert * len(facts.tokens) + items.bucket
                owner = balance(facts.cost[items.bucket], groups, cfg.num_ranks, cfg.repair_iters)
            slot = slots_by_group(items, owner, cfg.num_ranks, facts, self.batch_sizes)
        return per_rank_assignment(items, owner, slot, cfg.num_ranks)

    def plan(self, step: int) -> StepPlan:
        """The full plan of global step ``step`` (every rank's micro-batches)."""
        a = self.assign(step)
        ranks = tuple(materialise(a, self.facts))
        return StepPlan(step, ranks, a.num_samples, layout=self.config.layout, policy=self.config.policy)

    def plan_local(self, step: int, ranks: Sequence[int]) -> LocalPlan:
        """What one trainer process needs of global step ``step``: the micro-batches of its ``ranks`` and the step's
        global totals, without building the other ranks' plans (``LocalPlan``)."""
        bad = [r for r in ranks if not 0 <= r < self.config.num_ranks]
        if bad:
            raise ValueError(f"ranks {bad} are outside [0, {self.config.num_ranks})")
        a, facts = self.assign(step), self.facts
        real_buckets = a.rows.bucket[a.real]
        tokens, counts = np.unique(facts.tokens[real_buckets], return_counts=True)
        experts = np.bincount(a.rows.expert[a.real], minlength=2)
        grid = cost_grid(a, facts)
        rank_costs = grid.sum(axis=1) + facts.overhead * a.num_slots
        return LocalPlan(
            step=step,
            ranks=dict(zip(ranks, materialise(a, facts, ranks), strict=True)),
            num_samples=a.num_samples,
            expert_samples=(int(experts[0]), int(experts[1])),
            token_counts=tuple(zip(tokens.tolist(), counts.tolist(), strict=True)),
            rank_costs=tuple(rank_costs.tolist()),
            slot_work=critical_work(a, facts, grid),
            layout=self.config.layout,
            policy=self.config.policy,
        )

    def cost_grid(self, step: int) -> np.ndarray:
        """Predicted compute [R, K] per (rank, slot), without building the plan objects (metrics, simulation)."""
        return cost_grid(self.assign(step), self.facts)


def plan_step(
    index: SampleShapes,
    *,
    step: int,
    variant: WanVariant,
    config: PlanConfig,
    cost_model: CostModel,
    router: Router,
    buckets: BucketTable | None = None,
) -> StepPlan:
    """One-shot planning of ``step``; a trainer keeps a :class:`Planner` instead to reuse its tables and caches."""
    return Planner(index, variant, config, cost_model, router, buckets).plan(step)


def planner_from_config(
    config: Any, sample_shapes: Any, cost: CostModel, *, policy: str, layout: str, same_samples: bool = False
) -> Planner:
    """The planner a run's ``config.TrainConfig`` describes, with ``policy`` and ``layout`` chosen by the caller
    (the trainer: the spec's scheduler; ``wanloom plan``: each policy in turn, on the same samples)."""
    al = config.adaptive_load
    plan_config = PlanConfig(
        num_ranks=config.parallel.batch_ranks,
        policy=policy,
        layout=layout,
        global_batch=config.global_batch,
        memory_budget_tokens=al.memory_budget_tokens,
        compute_budget=al.compute_budget,
        exponent=al.exponent,
        seed=config.seed,
        sequence_multiple=config.parallel.context * config.parallel.tensor,
        same_samples=same_samples,
    )
    buckets = None if al.buckets is None else BucketTable.from_pixels(config.model.wan, [b.pixels for b in al.buckets])
    return Planner(sample_shapes, config.model.wan, plan_config, cost, config.routing.router(), buckets)
