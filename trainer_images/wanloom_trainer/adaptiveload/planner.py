"""``plan_step``: a step's samples → ranks → micro-batches, deterministic in (seed, step).

Policies (``PlanConfig.policy``):

- ``balanced`` (beyond the paper): ``global_batch`` samples per step on average from the seeded epoch stream
  (``scheduler.SampleStream``), planned a **window** of W steps at a time (W·``global_batch`` ≥
  ``window_samples_per_rank``·R samples, at most an epoch): a handful of samples per rank cannot even out long
  clips, a window can. Per-rank layout: the window's samples are assigned to (rank, slot) so that every lockstep
  slot is balanced (``lockstep``); SPMD layout: they are packed into rows of two shapes, alike rows in a slot
  (``packing``). The window's slots are then dealt to its W steps (``layout.deal_steps``), each a small copy of the
  window's mix, in a seeded order stratified so that no part of a window is a curriculum. With ``global_batch`` ≥
  that many samples per rank, with ``window_samples_per_rank`` 0, or when ranks synchronise once per step (per-rank
  totals balanced by ``balance.balance``), W = 1 and a step is its own window of exactly ``global_batch`` samples.

  **What a step trains** (``step_budget``). "samples": every step holds ``global_batch`` samples (within a few
  percent: a slot's micro-batches hold at most G/(4R) rows per rank, a packed row G/(2R) samples, so slots are
  small enough to deal), and every sample weighs 1/G in the gradient wherever it lands — the mean over the batch
  the user asked for. "tokens": every step holds G × the dataset's mean tokens per sample, micro-batches as full as
  memory allows, and every token weighs the same (1/that budget per token): the sample count varies by step, and
  a long clip weighs more than an image, as in trainers that normalise the loss by tokens.
- ``paper``: per-bucket batch sizes ``B = max(1, min(⌊M_mem/S⌋, ⌊M_comp/S^p⌋))``; each rank draws one bucket chunk
  per step (``scheduler.BucketChunks``), so the global sample count varies per step.
- ``equal-tokens``: the same with ``B = ⌊M_mem/S⌋``.

The comparison with the sampler users would otherwise run is ``adaptiveload.comparison.compare``.

Routing draws timesteps and experts once for all samples of a window (``Router.draw(seed, first step, n)``); each
micro-batch is then expert-homogeneous.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from wanloom_trainer.adaptiveload.assignment.balance import balance
from wanloom_trainer.adaptiveload.assignment.layout import (
    Assignment,
    BucketFacts,
    StepItems,
    cost_grid,
    critical_work,
    deal_steps,
    materialise,
    per_rank_assignment,
    slots_by_group,
    spmd_assignment,
)
from wanloom_trainer.adaptiveload.assignment.lockstep import lockstep_assign
from wanloom_trainer.adaptiveload.assignment.packing import RowShapes, packed_assignment, row_shapes
from wanloom_trainer.adaptiveload.assignment.scheduler import BucketChunks, SampleStream
from wanloom_trainer.adaptiveload.cost.cost_model import CostModel, effective_exponent
from wanloom_trainer.adaptiveload.plan import LAYOUTS, POLICIES, LocalPlan, StepPlan
from wanloom_trainer.adaptiveload.sizing.batch_size import (
    default_compute_budget,
    equal_token_batch_sizes,
    paper_batch_sizes,
)
from wanloom_trainer.adaptiveload.sizing.buckets import (
    BucketTable,
    cut_to_token_multiple,
    derive_buckets,
    require_token_multiple,
)
from wanloom_trainer.adaptiveload.sizing.shape_index import SampleShapes
from wanloom_trainer.adaptiveload.sizing.tokens import tokens_for_latents
from wanloom_trainer.config.variants import WanVariant
from wanloom_trainer.kernels.adaln_shapes import max_packed_segments

SYNCS = ("micro-batch", "step")
STEP_BUDGETS = ("samples", "tokens")
_WINDOW_TAG = 0x3D0  # the order a window's slots are dealt to its steps in


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
        sequence_multiple: context × tensor, the ranks a sequence is split over: packed rows are multiples of this
            many tokens, and where micro-batches hold whole samples so is every bucket's token count.
        window_samples_per_rank: "balanced" plans this many samples per rank at once, at most an epoch (module
            docstring); 0: every step alone.
        max_segments: segment slots a packed row may have (the AdaLN kernel's VMEM budget).
        step_budget: "balanced": "samples" or "tokens", what every step holds the same amount of (module docstring).
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
    window_samples_per_rank: int = 256
    max_segments: int = 128
    step_budget: str = "samples"

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.policy not in POLICIES:
            raise ValueError(f"adaptiveLoad.scheduler {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if self.step_budget not in STEP_BUDGETS:
            raise ValueError(f"adaptiveLoad.stepBudget {self.step_budget!r} is not one of {', '.join(STEP_BUDGETS)}")
        if self.sync not in SYNCS:
            raise ValueError(f"sync {self.sync!r} is not one of {', '.join(SYNCS)}")
        if self.policy == "balanced" and (self.global_batch is None or self.global_batch < 1):
            raise ValueError(f"scheduler 'balanced' needs training.globalBatch >= 1, got {self.global_batch}")


def check_batch(config: PlanConfig, dataset_size: int) -> None:
    """A step holds at most an epoch: a larger ``globalBatch`` would repeat samples within the step (and a huge
    one would plan forever), so it is refused before any planning."""
    batch = config.global_batch
    if batch is not None and batch > dataset_size:
        raise ValueError(
            f"spec.training.globalBatch {batch:,} is more than the {dataset_size:,} samples the run trains on (one "
            f"epoch); use at most {dataset_size:,} or add data"
        )


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
        check_batch(config, len(index))
        # Packed rows are padded to the sequence multiple; whole samples must be cut to it (buckets.py).
        multiple = 1 if (config.layout == "spmd" and config.policy == "balanced") else config.sequence_multiple
        if buckets is None:
            buckets = cut_to_token_multiple(derive_buckets(index.latent_shapes), variant, multiple)
        require_token_multiple(buckets, variant, multiple)
        self.buckets = buckets
        self.bucket_of = self.buckets.assign(index.latent_shapes)
        # Only buckets that hold samples can break the memory budget or set the paper rule's defaults.
        self._present = np.unique(self.bucket_of)
        equal_token_batch_sizes(
            tokens_for_latents(variant, self.buckets.latent_shapes)[self._present], config.memory_budget_tokens
        )
        self._use_cost_model(cost_model)
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
        if config.policy != "balanced":
            group = config.num_ranks if config.layout == "spmd" else 1
            self._chunks = BucketChunks(self.bucket_of, self.batch_sizes * group, config.seed)
        self._windows: dict[int, list[Assignment]] = {}  # planned windows, by window (their steps' assignments)

    def with_cost_model(self, cost_model: CostModel) -> Planner:
        """The same planner (dataset, buckets, sample order) planning with ``cost_model`` (an online refit)."""
        planner = copy.copy(self)
        planner._use_cost_model(cost_model)
        return planner

    def with_step_budget(self, step_budget: str) -> Planner:
        """The same planner with the other ``step_budget`` ("samples" or "tokens"): ``wanloom plan`` shows both."""
        planner = copy.copy(self)
        planner.config = dataclasses.replace(self.config, step_budget=step_budget)
        planner._windows = {}
        return planner

    def _batch_sizes(self, policy: str) -> np.ndarray:
        """Rows per rank per step for each bucket: the paper's B_shape, or the memory cap for "balanced"."""
        m_mem = self.config.memory_budget_tokens
        tokens = np.minimum(self.facts.tokens, m_mem)  # empty buckets may exceed it; they are never drawn
        if policy == "paper":
            return paper_batch_sizes(tokens, m_mem, self.compute_budget, self.exponent)
        return equal_token_batch_sizes(tokens, m_mem)

    @property
    def window_steps(self) -> int:
        """W: the steps "balanced" plans at once (module docstring); 1 for the other policies."""
        cfg = self.config
        batch = int(cfg.global_batch or 0)
        # Fewer samples than ranks: a window cannot help. Ranks synchronising once per step are balanced per step.
        if cfg.policy != "balanced" or batch < cfg.num_ranks or (cfg.layout == "per-rank" and cfg.sync == "step"):
            return 1
        wanted = -(-cfg.window_samples_per_rank * cfg.num_ranks // batch)
        return max(1, min(wanted, len(self.index) // batch))  # never more than an epoch at once

    @functools.cached_property
    def row_shapes(self) -> RowShapes:
        """The packed programs of the run (SPMD layout, "balanced"): fixed by the buckets that hold samples."""
        cfg = self.config
        mean_tokens = float(self.facts.tokens[self.bucket_of].mean())
        step_tokens = mean_tokens * int(cfg.global_batch or 0) / cfg.num_ranks
        return row_shapes(self.facts.tokens[self._present], cfg.memory_budget_tokens, cfg.sequence_multiple,
                          cfg.max_segments, step_tokens)  # fmt: skip

    def step_samples(self, step: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Index positions [n] of a bucket-chunk policy's step and their rank [n] (SPMD: None, one group)."""
        cfg = self.config
        assert self._chunks is not None
        if cfg.layout == "spmd":
            _, pos = self._chunks.chunk(step)
            return pos, None
        chunks = [self._chunks.chunk(step * cfg.num_ranks + r)[1] for r in range(cfg.num_ranks)]
        owner = np.repeat(np.arange(cfg.num_ranks), [len(c) for c in chunks])
        return np.concatenate(chunks), owner

    def _items(self, pos: np.ndarray, first_step: int) -> StepItems:
        """The samples at index positions ``pos`` with the routing draw of ``first_step``."""
        draw = self.router.draw(self.config.seed, first_step, len(pos))
        timesteps, experts = (draw.timesteps, draw.experts) if hasattr(draw, "timesteps") else draw
        return StepItems(
            ids=self.index.ids[pos],
            bucket=self.bucket_of[pos],
            expert=np.asarray(experts, dtype=np.int64),
            timesteps=np.asarray(timesteps, dtype=np.float32),
        )

    def assign(self, step: int) -> Assignment:
        """The decisions of global step ``step`` as arrays: a pure function of the seed, the step and the fixed
        inputs. This is the planning work; ``plan``/``plan_local`` only turn it into objects."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        cfg, facts = self.config, self.facts
        if cfg.policy == "balanced":
            window, j = divmod(step, self.window_steps)
            if window not in self._windows:
                if len(self._windows) >= 2:
                    self._windows.pop(min(self._windows))
                self._windows[window] = self._plan_window(window)
            return self._windows[window][j]
        pos, owner = self.step_samples(step)
        items = self._items(pos, step)
        if cfg.layout == "spmd":
            return spmd_assignment(items, cfg.num_ranks, facts, self.batch_sizes)
        slot = slots_by_group(items, owner, cfg.num_ranks, facts, self.batch_sizes)
        return per_rank_assignment(items, owner, slot, cfg.num_ranks)

    def _plan_window(self, window: int) -> list[Assignment]:
        """The assignments of the window's W steps (module docstring)."""
        cfg, facts, steps = self.config, self.facts, self.window_steps
        first = window * steps
        batch = int(cfg.global_batch or 0)
        items = self._items(self._stream.take(first * batch, steps * batch), first)
        # Every step needs a slot: each expert gets at least its share of W slots.
        experts = np.bincount(items.expert, minlength=2)
        min_slots = tuple(int(-(-steps * n // len(items.expert))) if n else 0 for n in experts.tolist())
        # Steps of G samples are dealt whole slots: a slot must be a small part of G (module docstring).
        per_sample = steps > 1 and cfg.step_budget == "samples"
        if cfg.layout == "spmd":
            shapes = self.row_shapes
            if per_sample:
                shapes = dataclasses.replace(shapes, samples_per_row=max(1, batch // (2 * cfg.num_ranks)))
            a = packed_assignment(
                items, cfg.num_ranks, facts, shapes=shapes, pad_cost=self.cost_model.sample_cost,
                min_slots=(min_slots[0], min_slots[1]),
            )  # fmt: skip
        elif cfg.sync == "micro-batch":
            cap = facts.cap
            if per_sample:  # slots small enough to deal, and each bucket in enough of them to reach every step
                spread = np.bincount(items.bucket, minlength=len(cap)) // (cfg.num_ranks * steps)
                cap = np.clip(spread, 1, np.minimum(cap, max(1, batch // (4 * cfg.num_ranks))))
            owner, slot = lockstep_assign(
                items.bucket, items.expert, facts.cost, cap, cfg.num_ranks, facts.overhead, min_slots=min_slots
            )
            a = per_rank_assignment(items, owner, slot, cfg.num_ranks)
        else:
            groups = items.expert * len(facts.tokens) + items.bucket
            owner = balance(facts.cost[items.bucket], groups, cfg.num_ranks, cfg.repair_iters)
            a = per_rank_assignment(items, owner, slots_by_group(items, owner, cfg.num_ranks, facts), cfg.num_ranks)
        a = dataclasses.replace(a, weight_norm=self.weight_norm, token_weights=cfg.step_budget == "tokens")
        if steps == 1:
            return [a]
        rng = np.random.default_rng([cfg.seed, window, _WINDOW_TAG])
        return deal_steps(a, steps, facts, rng, bound=cfg.step_budget)

    @property
    def weight_norm(self) -> float:
        """ "balanced": a sample's loss weight is 1/G ("samples"), a token's 1/(G × mean tokens per sample)."""
        batch = float(self.config.global_batch or 0)
        if self.config.step_budget == "tokens":
            return batch * float(self.facts.tokens[self.bucket_of].mean())
        return batch

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


def planner_from_config(config: Any, sample_shapes: Any, cost: CostModel, *, policy: str, layout: str) -> Planner:
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
        window_samples_per_rank=al.window_samples_per_rank,
        max_segments=max_packed_segments(config.model.wan.dim),
        step_budget=al.step_budget,
    )
    buckets = None if al.buckets is None else BucketTable.from_pixels(config.model.wan, [b.pixels for b in al.buckets])
    return Planner(sample_shapes, config.model.wan, plan_config, cost, config.routing.router(), buckets)
