"""``wanloom plan FILE [--bench BENCH]``: what AdaptiveLoad will do with a TrainingJob's dataset.

Prints the bucket table with every policy's batch sizes, the cost model (and its fit quality when it comes from a
shape benchmark), and the predicted compute-load CV, idle fraction and throughput of the equal-token baseline, the
paper's rule and the balanced scheduler over the first steps of the job's own data order.

The cost model comes from ``cost_source.resolve_cost_model``; with ``--bench`` a missing benchmark entry is
measured first on this machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from wanloom_trainer.adaptiveload.batch_size import equal_token_batch_sizes, paper_batch_sizes
from wanloom_trainer.adaptiveload.cost_model import CostModel
from wanloom_trainer.adaptiveload.cost_source import resolve_cost_model
from wanloom_trainer.adaptiveload.planner import Planner, planner_from_config
from wanloom_trainer.adaptiveload.simulate import SimResult, simulate

PLAN_STEPS = 32


def _planner(config: Any, shapes: Any, cost: CostModel, policy: str) -> Planner:
    layout = "spmd" if config.backend == "jax" else "per-rank"
    return planner_from_config(config, shapes, cost, policy=policy, layout=layout)


def bucket_table(planner: Planner) -> str:
    """One line per non-empty bucket: shape, tokens, samples, memory cap and each policy's batch size."""
    f, m_mem = planner.facts, planner.config.memory_budget_tokens
    counts = np.bincount(planner.bucket_of, minlength=len(f.tokens))
    present = np.flatnonzero(counts)
    equal = equal_token_batch_sizes(f.tokens[present], m_mem)
    paper = paper_batch_sizes(f.tokens[present], m_mem, planner.compute_budget, planner.exponent)
    lines = [
        f"{'latent (T,H,W)':>16} {'tokens':>8} {'samples':>9} {'share':>6} {'cap':>5} "
        f"{'B equal':>8} {'B paper':>8} {'cost/sample':>12}"
    ]
    for i, b in enumerate(present.tolist()):
        shape = "x".join(str(x) for x in f.shapes[b])
        lines.append(
            f"{shape:>16} {f.tokens[b]:>8,} {counts[b]:>9,} {counts[b] / counts.sum():>6.1%} {f.cap[b]:>5} "
            f"{equal[i]:>8} {paper[i]:>8} {f.cost[b]:>12.4g}"
        )
    return "\n".join(lines)


def policy_table(results: dict[str, SimResult], chosen: str) -> str:
    base = results["equal-tokens"].tokens_per_second
    lines = [
        f"{'policy':14} {'load CV':>8} {'idle':>6} {'step time':>10} {'tokens/s':>12} {'vs equal':>9} {'slots':>6}"
    ]
    for name, r in results.items():
        mark = " *" if name == chosen else ""
        lines.append(
            f"{name + mark:14} {r.mean_cv:>8.1%} {r.idle_fraction:>6.1%} {r.mean_step_time:>10.4g} "
            f"{r.tokens_per_second:>12,.0f} {r.tokens_per_second / base:>8.2f}x {r.mean_slots:>6.1f}"
        )
    return "\n".join(lines)


def _expert_share_line(config: Any) -> str:
    r = config.routing
    shares = config.routing.expected_shares()
    where = f"{r.sampling} timesteps, shift {r.shift:g}"
    if len(shares) == 1:
        return f"routing: {where}; one model takes every sample"
    return (
        f"routing: {where}; expected share of samples: high-noise expert (t >= {r.boundary_ratio * 1000:g}) "
        f"{shares[0]:.1%}, low-noise {shares[1]:.1%}"
    )


def run_plan(trainingjob_path: str | Path, bench: Path | None = None, steps: int = PLAN_STEPS) -> str:
    """The report of ``wanloom plan`` for a TrainingJob file (see the module docstring)."""
    from wanloom_operator.api.validation import load_trainingjob_file
    from wanloom_trainer.config.train_config import from_trainingjob
    from wanloom_trainer.data.reader import read_index

    config = from_trainingjob(load_trainingjob_file(trainingjob_path), {})
    shapes = read_index(config.data.uri, config.data.index).sample_shapes()
    cost = resolve_cost_model(config, bench, shapes, measure=bench is not None)
    chosen = config.adaptive_load.scheduler if config.adaptive_load.enabled else "equal-tokens"
    planners = {p: _planner(config, shapes, cost.model, p) for p in ("equal-tokens", "paper", "balanced")}
    results = {p: simulate(pl, min(steps, config.steps)) for p, pl in planners.items()}
    pl = planners[chosen]
    head = [
        f"TrainingJob {config.job_name}: {config.model.variant}, {len(shapes):,} samples, "
        f"{config.parallel.batch_ranks} data-parallel ranks, layout {pl.config.layout}, sync {pl.config.sync}",
        f"memoryBudgetTokens {pl.config.memory_budget_tokens:,}; paper rule p = {pl.exponent:.3g}, "
        f"M_comp = {pl.compute_budget:.4g}; globalBatch {config.global_batch} (balanced)",
        f"cost model: {cost.description}",
        _expert_share_line(config),
    ]
    if cost.fit is not None:
        head.append(cost.fit.summary())
    body = [
        "",
        bucket_table(pl),
        "",
        f"predicted over {results[chosen].steps} steps (* = spec.adaptiveLoad.scheduler; times in cost-model units):",
        policy_table(results, chosen),
    ]
    return "\n".join(head + body)
