"""AdaptiveLoad against the sampler users would otherwise run, by throughput over one sample stream.

Policies (``POLICIES``), each consuming the same stream: the (bucket, expert) of every sample of the balanced
planner's first ``steps`` steps (the job's data order and routing draws):

- ``bucket-sampler`` — the baseline, the sampler of Open-Sora, musubi-tuner, DiffSynth-Studio and VideoX-Fun: one
  queue per (bucket, expert); every micro-batch holds B = ⌊M_mem / S_b⌋ samples of one queue, the queue drawn in
  proportion to the samples it has left. Per-rank mode (PyTorch, FSDP in lockstep): a slot runs one expert on every
  rank (FSDP's collectives must match; the expert drawn in proportion to what it has left), each rank draws its own
  bucket, and the slot lasts as long as its slowest rank. SPMD mode (JAX on TPU): one queue per slot for all
  devices, R·B_b samples, one step program per bucket shape; its rows are identical, so its time is
  Σ_chunks (B_b·c_b + a).
- ``paper`` — the same sampler with the paper's B = max(1, min(⌊M_mem/S⌋, ⌊M_comp/S^p⌋)).
- ``balanced`` — the trainer's own planner (``Planner``, scheduler "balanced"), steps of ``globalBatch`` samples.

The samplers run the stream as they would an epoch: in SPMD mode a queue's last, short chunk is padded to its
program's rows; in per-rank mode a queue's last micro-batch is short, and the stream's tail — the slots in which
some rank finds its expert's queues empty — is left out (the next epoch would fill them), which favours the sampler.
``steady_state=True`` gives the *global* per-bucket sampler in either mode (every rank runs the same bucket, as SPMD
must) with each queue's short chunk charged pro rata, as if a long epoch had filled it. It idles nothing and pads
nothing, and its micro-batches are as large as memory allows: no plan of the same samples takes less than their
useful compute (``useful_time``), and this sampler's time exceeds that only by its call overheads, so in this cost
model no plan can be more than ``time / useful_time`` times as fast (its ceiling). Compute is the cost model's
(``CostModel.sample_cost`` per sample, ``overhead`` per micro-batch call); tokens/s is Σ tokens / Σ time.

Reported per policy (``PolicyResult``): throughput relative to the bucket sampler; load CV (CV across ranks of each
slot's useful compute, time-weighted over slots: what makes ranks wait in lockstep and SPMD); padding (share of
compute on padding rows, padding tokens and dummy micro-batches); idle (share of rank-time spent waiting);
compiled shapes (distinct step-program shapes the policy needs over the stream: per-rank (bucket, rows), packed
(row tokens, segment slots, longest segment)). For ``balanced`` also what its steps train (``StepSemantics``):
samples per step, the image share and tokens per sample of every third of every planning window against the
window's, and how often each expert is updated; ``semantics_problems`` says where they break the promise of the
step budget (``planner`` module docstring).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from wanloom_trainer.adaptiveload.assignment.layout import cost_grid
from wanloom_trainer.adaptiveload.metrics import coefficient_of_variation
from wanloom_trainer.adaptiveload.planner import Planner
from wanloom_trainer.adaptiveload.sizing.batch_size import equal_token_batch_sizes, paper_batch_sizes

BASELINE = "bucket-sampler"
POLICIES = (BASELINE, "paper", "balanced")
STEADY = "global-sampler-steady"  # compare(..., steady=True): the baseline's ceiling, not a policy a trainer runs
_SAMPLER_TAG = 0x5A3B  # the samplers' queue draws, apart from every other consumer of the seed


@dataclass(frozen=True)
class PolicyResult:
    """One policy over the stream; times in the cost model's unit."""

    policy: str
    tokens: int
    time: float
    load_cv: float
    padding_fraction: float
    idle_fraction: float
    compiled_shapes: int
    shapes_per_expert: tuple[int, int]
    useful_time: float = 0.0  # Σ useful compute / R: the time of a plan with no idle, padding or call overhead
    semantics: StepSemantics | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.time if self.time > 0 else 0.0

    def to_json(self, baseline: PolicyResult) -> dict[str, float]:
        return {
            "throughput_vs_baseline": self.tokens_per_second / baseline.tokens_per_second,
            "load_cv": self.load_cv,
            "padding_fraction": self.padding_fraction,
            "idle_fraction": self.idle_fraction,
            "compiled_shapes": self.compiled_shapes,
        }


SAMPLES_TOLERANCE = 0.10  # step budget "samples": p5..p95 of samples per step within ±10% of globalBatch
SAMPLES_MAX = 1.5  # ... and never above 1.5 × globalBatch
THIRD_TOLERANCE = 0.25  # every third of a window within ±25% of the window's image share and tokens per sample


@dataclass(frozen=True)
class StepSemantics:
    """What the balanced planner's steps train, over the compared stream.

    Attributes:
        global_batch: G, the samples a step is asked to hold.
        samples: samples per step (p5, median, p95, max).
        tokens: tokens per step (p5, median, p95, max).
        image_share_by_third, tokens_per_sample_by_third: per third of a planning window (steps in order), pooled
            over the windows, relative to the windows' own value (1.0: the window's mix).
        worst_third: the largest |third / window − 1| of image share or tokens per sample in any one window.
        expert_update_share: per expert, the share of steps that update it (hold at least one of its samples).
        expert_samples_per_step: per expert, mean samples per step.
    """

    global_batch: int
    samples: tuple[float, float, float, float]
    tokens: tuple[float, float, float, float]
    image_share_by_third: tuple[float, float, float]
    tokens_per_sample_by_third: tuple[float, float, float]
    worst_third: float
    expert_update_share: tuple[float, float]
    expert_samples_per_step: tuple[float, float]

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def _spread(values: np.ndarray) -> tuple[float, float, float, float]:
    p5, median, p95 = np.percentile(values, [5, 50, 95])
    return float(p5), float(median), float(p95), float(values.max())


def step_semantics(steps: np.ndarray, window: int, global_batch: int) -> StepSemantics:
    """``StepSemantics`` from per-step [n, 5] (samples, images, tokens, expert-0, expert-1 samples), in step order,
    planned ``window`` steps at a time."""
    n = len(steps) // window * window
    by_window = steps[:n].reshape(-1, window, steps.shape[1])
    thirds = np.array_split(np.arange(window), 3) if window >= 3 else [np.arange(window)] * 3
    per_window = by_window.sum(axis=1)  # [windows, 5]

    def ratio(num: int, den: int, part: np.ndarray | None) -> np.ndarray:
        got = by_window[:, part].sum(axis=1) if part is not None else per_window
        base = per_window[:, num] / np.maximum(per_window[:, den], 1)
        return np.where(base > 0, got[:, num] / np.maximum(got[:, den], 1) / np.where(base > 0, base, 1), 1.0)

    image = np.stack([ratio(1, 0, t) for t in thirds])  # [3, windows]
    tokens = np.stack([ratio(2, 0, t) for t in thirds])
    worst = float(max(np.abs(image - 1).max(), np.abs(tokens - 1).max())) if n else 0.0
    weights = per_window[:, 0] / max(per_window[:, 0].sum(), 1)
    return StepSemantics(
        global_batch=global_batch,
        samples=_spread(steps[:, 0]),
        tokens=_spread(steps[:, 2]),
        image_share_by_third=tuple(float(x) for x in image @ weights),  # type: ignore[arg-type]
        tokens_per_sample_by_third=tuple(float(x) for x in tokens @ weights),  # type: ignore[arg-type]
        worst_third=worst,
        expert_update_share=(float((steps[:, 3] > 0).mean()), float((steps[:, 4] > 0).mean())),
        expert_samples_per_step=(float(steps[:, 3].mean()), float(steps[:, 4].mean())),
    )


def semantics_problems(semantics: StepSemantics, step_budget: str) -> list[str]:
    """Where the balanced steps break what the step budget promises (empty: they keep it)."""
    problems = []
    g = semantics.global_batch
    p5, _, p95, largest = semantics.samples
    if step_budget == "samples" and (p5 < (1 - SAMPLES_TOLERANCE) * g or p95 > (1 + SAMPLES_TOLERANCE) * g):
        problems.append(f"samples per step p5..p95 {p5:.0f}..{p95:.0f} are not within 10% of globalBatch {g}")
    if step_budget == "samples" and largest > SAMPLES_MAX * g:
        problems.append(f"a step holds {largest:.0f} samples, more than 1.5 x globalBatch {g}")
    if semantics.worst_third > THIRD_TOLERANCE:
        problems.append(
            f"a third of a planning window is {semantics.worst_third:.0%} off its window's image share or tokens per "
            "sample (at most 25%)"
        )
    return problems


@dataclass
class _Tally:
    """Running totals over slots: slot work per rank → time, useful and padding compute, CV."""

    overhead: float
    time: float = 0.0
    useful: float = 0.0
    padding: float = 0.0
    rank_time: float = 0.0
    weighted_cv: float = 0.0
    slots: int = 0
    ranks: int = 0

    def slot(self, useful: np.ndarray, padding: np.ndarray | float = 0.0) -> None:
        """One lockstep/SPMD slot: useful [R] and padding [R] compute of every rank."""
        busy = useful + padding
        t = float(busy.max()) + self.overhead
        cv = coefficient_of_variation(useful)
        self.time += t
        self.weighted_cv += cv * t
        self.useful += float(useful.sum())
        self.padding += float(np.sum(padding))
        self.rank_time += t * len(useful)
        self.slots += 1
        self.ranks = len(useful)

    def result(self, policy: str, tokens: int, shapes: set, shapes_per_expert: tuple[int, int]) -> PolicyResult:
        compute = self.useful + self.padding
        busy = compute + self.overhead * self.slots * self.ranks
        return PolicyResult(
            policy=policy,
            tokens=tokens,
            time=self.time,
            load_cv=self.weighted_cv / self.time if self.time > 0 else 0.0,
            padding_fraction=self.padding / compute if compute > 0 else 0.0,
            idle_fraction=max(0.0, 1.0 - busy / self.rank_time) if self.rank_time > 0 else 0.0,
            compiled_shapes=len(shapes),
            shapes_per_expert=shapes_per_expert,
            useful_time=self.useful / self.ranks if self.ranks else 0.0,
        )


def balanced(planner: Planner, steps: int) -> tuple[PolicyResult, np.ndarray, np.ndarray]:
    """The trainer's planner over its first ``steps`` steps, and the stream it consumed: (bucket int64 [N],
    expert int64 [N]) of every sample, in order."""
    facts = planner.facts
    tally, tokens, shapes = _Tally(facts.overhead), 0, set()
    per_expert: tuple[set, set] = (set(), set())
    buckets, experts, contents = [], [], np.zeros((steps, 5))
    for step in range(steps):
        a = planner.assign(step)
        buckets.append(a.rows.bucket[a.real])
        experts.append(a.rows.expert[a.real])
        contents[step] = (
            len(buckets[-1]),
            int((facts.shapes[buckets[-1], 0] == 1).sum()),
            int(facts.tokens[buckets[-1]].sum()),
            int((experts[-1] == 0).sum()),
            int((experts[-1] == 1).sum()),
        )
        grid = cost_grid(a, facts)
        useful = np.zeros_like(grid)
        np.add.at(useful, (a.owner[a.real], a.slot[a.real]), facts.cost[a.rows.bucket[a.real]])
        for k in range(a.num_slots):
            tally.slot(useful[:, k], grid[:, k] - useful[:, k])
        tokens += int(facts.tokens[buckets[-1]].sum())
        for key, expert in _program_shapes(a):
            shapes.add(key)
            per_expert[expert].add(key)
    result = tally.result("balanced", tokens, shapes, (len(per_expert[0]), len(per_expert[1])))
    semantics = step_semantics(contents, planner.window_steps, int(planner.config.global_batch or 0))
    result = dataclasses.replace(result, semantics=semantics)
    return result, np.concatenate(buckets).astype(np.int64), np.concatenate(experts).astype(np.int64)


def _program_shapes(a) -> list[tuple[tuple, int]]:  # type: ignore[no-untyped-def]
    """(shape key, expert) of every micro-batch program of an assignment."""
    if a.packed is not None:
        p = a.packed
        return [
            (("packed", int(p.row_tokens[k]), int(p.groups[k]), int(p.max_segment_tokens[k])), int(a.slot_expert[k]))
            for k in range(a.num_slots)
        ]
    cells = a.owner * max(a.num_slots, 1) + a.slot
    _, first, rows = np.unique(cells, return_index=True, return_counts=True)
    return [(("rows", int(a.rows.bucket[i]), int(n)), int(a.rows.expert[i])) for i, n in zip(first, rows, strict=True)]


def sampler_batch_sizes(planner: Planner, policy: str) -> np.ndarray:
    """B per bucket [k] of a sampler policy: the memory cap (bucket sampler) or the paper's rule."""
    m_mem = planner.config.memory_budget_tokens
    tokens = np.minimum(planner.facts.tokens, m_mem)  # buckets with no samples may exceed the budget; never drawn
    if policy == BASELINE:
        return equal_token_batch_sizes(tokens, m_mem)
    if policy == "paper":
        return paper_batch_sizes(tokens, m_mem, planner.compute_budget, planner.exponent)
    raise ValueError(f"{policy!r} is not a sampler policy ({BASELINE}, paper)")


def sampler(
    planner: Planner, policy: str, bucket: np.ndarray, expert: np.ndarray, *, steady_state: bool = False
) -> PolicyResult:
    """A bucket-sampler policy (module docstring) over the stream ``(bucket, expert)``; ``steady_state``: the
    global per-bucket sampler (every rank the same bucket, in either layout) with each queue's short last chunk
    charged pro rata, as if a long epoch had filled it."""
    facts, cfg = planner.facts, planner.config
    batch = sampler_batch_sizes(planner, policy)
    counts = np.zeros((2, len(facts.tokens)), dtype=np.int64)
    np.add.at(counts, (expert, bucket), 1)
    if cfg.layout == "spmd" or steady_state:
        return _global_sampler(policy, counts, batch, planner, steady_state)
    return _per_rank_sampler(policy, counts, batch, planner, np.random.default_rng([cfg.seed, _SAMPLER_TAG]))


def _global_sampler(
    policy: str, counts: np.ndarray, batch: np.ndarray, planner: Planner, steady_state: bool
) -> PolicyResult:
    """Every chunk is one bucket on all ranks with B_b rows each (SPMD: one program over all devices): its time does
    not depend on the order the queues are drawn in, only on how many chunks each queue makes (its last one padded
    to the chunk's rows, or charged pro rata in the steady state)."""
    facts, num_ranks = planner.facts, planner.config.num_ranks
    per_chunk = num_ranks * batch[None, :]
    chunks = counts / per_chunk if steady_state else np.ceil(counts / per_chunk)
    time = float((chunks * (batch * facts.cost + facts.overhead)[None, :]).sum())
    useful = float((counts * facts.cost[None, :]).sum())
    compute = float((chunks * per_chunk * facts.cost[None, :]).sum())
    present = counts > 0
    # Experts share step programs: a chunk's shape is its bucket's [B_b, S_b] whichever expert runs it.
    shapes = np.flatnonzero(present.any(axis=0))
    rank_time = time * num_ranks
    return PolicyResult(
        policy=policy,
        tokens=int((counts * facts.tokens[None, :]).sum()),
        time=time,
        load_cv=0.0,
        padding_fraction=1.0 - useful / compute if compute > 0 else 0.0,
        idle_fraction=max(0.0, 1.0 - (compute + float(chunks.sum()) * num_ranks * facts.overhead) / rank_time),
        compiled_shapes=len(shapes),
        shapes_per_expert=(int(present[0].sum()), int(present[1].sum())),
        useful_time=useful / num_ranks,
    )


def _per_rank_sampler(
    policy: str, counts: np.ndarray, batch: np.ndarray, planner: Planner, rng: np.random.Generator
) -> PolicyResult:
    facts, num_ranks = planner.facts, planner.config.num_ranks
    left = counts.astype(np.int64).copy()
    tally, tokens, shapes = _Tally(facts.overhead), 0, set()
    per_expert: tuple[set, set] = (set(), set())
    useful = np.zeros(num_ranks)
    while left.sum() > 0:
        per_expert_left = left.sum(axis=1)
        e = int(rng.choice(2, p=per_expert_left / per_expert_left.sum()))
        slot_tokens, slot_shapes, complete = 0, [], True
        for r in range(num_ranks):
            queue = left[e]
            n = int(queue.sum())
            if n == 0:
                complete = False
                break
            b = int(rng.choice(len(queue), p=queue / n))
            take = int(min(batch[b], queue[b]))
            queue[b] -= take
            useful[r] = take * facts.cost[b]
            slot_tokens += take * int(facts.tokens[b])
            slot_shapes.append((b, take))
        if not complete:  # the stream's tail: a long epoch has none
            break
        tally.slot(useful)
        tokens += slot_tokens
        for b, take in slot_shapes:
            shapes.add(("rows", b, take))
            per_expert[e].add(("rows", b, take))
    return tally.result(policy, tokens, shapes, (len(per_expert[0]), len(per_expert[1])))


def compare(planner: Planner, steps: int, *, steady: bool = False) -> dict[str, PolicyResult]:
    """Every policy over the stream of ``planner``'s first ``steps`` steps (``planner``: scheduler "balanced");
    ``steady``: also the global per-bucket sampler at steady state over the same stream, under ``STEADY``."""
    if planner.config.policy != "balanced":
        raise ValueError(f"compare needs the balanced planner, got scheduler {planner.config.policy!r}")
    ours, bucket, expert = balanced(planner, steps)
    results = {p: sampler(planner, p, bucket, expert) for p in POLICIES if p != "balanced"}
    results["balanced"] = ours
    if steady:
        results[STEADY] = sampler(planner, BASELINE, bucket, expert, steady_state=True)
    return results
