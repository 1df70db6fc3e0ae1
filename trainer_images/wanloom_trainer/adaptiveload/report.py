"""``wanloom plan FILE [--shapes CSV] [--bench BENCH] [--json]``: what AdaptiveLoad will do with a TrainingJob's data.

Prints the bucket table with every policy's batch sizes, the cost model (and its fit quality when it comes from a
shape benchmark), and the predicted compute-load CV, padding, idle fraction and throughput of the equal-token
baseline, the paper's rule and the balanced scheduler over the first steps of the job's own data order. The
simulation runs the layout the job's backend runs (JAX: SPMD, balanced = packed rows; PyTorch: per-rank micro-batches
in lockstep) and gives every policy the same samples per step (``PlanConfig.same_samples``).

The samples' shapes come from ``--shapes`` (a CSV of pixel sizes), else the job's dataset index, else the synthetic
dataset ``spec.data.synthetic`` would write (so a job can be planned before its data exists).

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


POLICIES = ("equal-tokens", "paper", "balanced")


def _planner(config: Any, shapes: Any, cost: CostModel, policy: str) -> Planner:
    layout = "spmd" if config.backend == "jax" else "per-rank"
    return planner_from_config(config, shapes, cost, policy=policy, layout=layout, same_samples=True)


def plan_mode(planner: Planner) -> str:
    """The execution mode a plan is simulated in: "spmd" (JAX) or "per-rank-lockstep" (PyTorch FSDP)."""
    cfg = planner.config
    return "spmd" if cfg.layout == "spmd" else f"per-rank-{'lockstep' if cfg.sync == 'micro-batch' else 'step'}"


def plan_shapes(config: Any, shapes_csv: Path | None = None) -> Any:
    """The samples to plan: ``--shapes``, the dataset index, or the synthetic dataset the spec would write."""
    from wanloom_trainer.adaptiveload.shape_index import SampleShapes
    from wanloom_trainer.data.reader import read_index

    variant = config.model.wan
    if shapes_csv is not None:
        grid = (variant.vae_stride[1] * variant.patch_size[1], variant.vae_stride[2] * variant.patch_size[2])
        return SampleShapes.from_pixel_csv(shapes_csv, variant.vae_stride, grid)
    try:
        return read_index(config.data.uri, config.data.index).sample_shapes()
    except FileNotFoundError:
        if config.data.synthetic is None:
            raise FileNotFoundError(
                f"spec.data: no dataset index at {config.data.uri}; plan with --shapes SHAPES.csv (header "
                "frames,height,width in pixels), set spec.data.synthetic, or prepare the data first"
            ) from None
    from wanloom_trainer.adaptiveload.tokens import latent_shapes_for_pixels
    from wanloom_trainer.data.synth import synthetic_pixel_shapes

    synthetic = config.data.synthetic
    pixels = synthetic_pixel_shapes(variant, synthetic.samples, synthetic.seed)
    return SampleShapes.from_arrays(latent_shapes_for_pixels(variant, pixels))


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
        f"{'policy':14} {'load CV':>8} {'padding':>8} {'idle':>6} {'step time':>10} {'tokens/s':>12} {'vs equal':>9} "
        f"{'slots':>6}"
    ]
    for name, r in results.items():
        mark = " *" if name == chosen else ""
        lines.append(
            f"{name + mark:14} {r.mean_cv:>8.1%} {r.padding_fraction:>8.1%} {r.idle_fraction:>6.1%} "
            f"{r.mean_step_time:>10.4g} {r.tokens_per_second:>12,.0f} {r.tokens_per_second / base:>8.2f}x "
            f"{r.mean_slots:>6.1f}"
        )
    return "\n".join(lines)


def policies_json(results: dict[str, SimResult]) -> dict[str, dict[str, float]]:
    base = results["equal-tokens"].tokens_per_second
    return {
        name: {
            "load_cv": r.mean_cv,
            "padding_fraction": r.padding_fraction,
            "idle_fraction": max(0.0, r.idle_fraction),  # not -1e-17 from rounding
            "throughput_vs_equal_tokens": r.tokens_per_second / base,
            "micro_batches_per_rank": r.mean_slots,
        }
        for name, r in results.items()
    }


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


def run_plan(
    trainingjob_path: str | Path,
    bench: Path | None = None,
    steps: int = PLAN_STEPS,
    *,
    shapes_csv: Path | None = None,
    as_json: bool = False,
) -> str:
    """The report of ``wanloom plan`` for a TrainingJob file (see the module docstring); ``as_json``: one JSON
    object ``{"mode", "ranks", "expert_share", "policies": {policy: {...}}}``."""
    import json

    from wanloom_api.metrics import EXPERT_LABELS
    from wanloom_api.validation import load_trainingjob_file
    from wanloom_trainer.config.train_config import from_trainingjob

    config = from_trainingjob(load_trainingjob_file(trainingjob_path), {})
    shapes = plan_shapes(config, shapes_csv)
    cost = resolve_cost_model(config, bench, shapes, measure=bench is not None)
    chosen = config.adaptive_load.scheduler if config.adaptive_load.enabled else "equal-tokens"
    planners = {p: _planner(config, shapes, cost.model, p) for p in POLICIES}
    results = {p: simulate(pl, min(steps, config.steps)) for p, pl in planners.items()}
    pl = planners[chosen]
    if as_json:
        shares = config.routing.expected_shares()
        return json.dumps(
            {
                "mode": plan_mode(pl),
                "ranks": pl.config.num_ranks,
                "samples_per_step": pl.config.global_batch,
                "expert_share": {EXPERT_LABELS[e]: float(shares[e]) if e < len(shares) else 0.0 for e in (0, 1)},
                "scheduler": chosen,
                "policies": policies_json(results),
                "warnings": pl.warnings,
            }
        )
    head = [
        f"TrainingJob {config.job_name}: {config.model.variant}, {len(shapes):,} samples, "
        f"{config.parallel.batch_ranks} data-parallel ranks, mode {plan_mode(pl)}",
        f"memoryBudgetTokens {pl.config.memory_budget_tokens:,}; paper rule p = {pl.exponent:.3g}, "
        f"M_comp = {pl.compute_budget:.4g}",
        f"cost model: {cost.description}",
        _expert_share_line(config),
    ]
    if cost.fit is not None:
        head.append(cost.fit.summary())
    head.extend(f"WARNING: {w}" for w in pl.warnings)
    body = [
        "",
        bucket_table(pl),
        "",
        f"predicted over {results[chosen].steps} steps, {pl.config.global_batch} samples each for every policy "
        "(* = spec.adaptiveLoad.scheduler; times in cost-model units; load CV over useful compute):",
        policy_table(results, chosen),
    ]
    return "\n".join(head + body)
