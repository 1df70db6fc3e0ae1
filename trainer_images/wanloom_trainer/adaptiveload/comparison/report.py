"""``wanloom plan FILE [--shapes CSV] [--bench BENCH] [--json]``: what AdaptiveLoad will do with a TrainingJob's data.

Prints the bucket table with every policy's batch sizes, the cost model (and its fit quality when it comes from a shape
benchmark), and the predicted throughput, load CV, padding, idle share and compiled step shapes of the bucket sampler
users would otherwise run, the same sampler with the paper's batch sizes, and the balanced scheduler, each consuming the
same sample stream: the job's own data order and routing (``adaptiveload.comparison.compare``). The simulation runs the
mode the job's backend runs (JAX: SPMD, balanced = packed rows; PyTorch: per-rank micro-batches in lockstep).

The samples' shapes come from ``--shapes`` (a CSV of pixel sizes), else the job's dataset index, else the synthetic
dataset ``spec.data.synthetic`` would write (so a job can be planned before its data exists).

The cost model comes from ``cost_source.resolve_cost_model``; with ``--bench`` a missing benchmark entry is
measured first on this machine by the ``measure`` the caller passes (the CLI: ``train.bench_step``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from wanloom_trainer.adaptiveload.comparison.compare import (
    BASELINE,
    PolicyResult,
    StepSemantics,
    balanced,
    compare,
    semantics_problems,
)
from wanloom_trainer.adaptiveload.cost.cost_source import resolve_cost_model
from wanloom_trainer.adaptiveload.planner import Planner, planner_from_config
from wanloom_trainer.adaptiveload.sizing.batch_size import equal_token_batch_sizes, paper_batch_sizes

# The compared stream: at least this many samples per rank (whole planning windows), so that the samplers' short
# last chunk per queue weighs what it would in an epoch of that length.
COMPARE_SAMPLES_PER_RANK = 1024


def compare_steps(planner: Planner, samples_per_rank: int = COMPARE_SAMPLES_PER_RANK) -> int:
    """Steps of the compared stream: ``samples_per_rank`` per rank, rounded up to whole planning windows."""
    cfg, window = planner.config, planner.window_steps
    steps = -(-samples_per_rank * cfg.num_ranks // int(cfg.global_batch or 1))
    return -(-steps // window) * window


def plan_mode(planner: Planner) -> str:
    """The execution mode a plan is simulated in: "spmd" (JAX) or "per-rank-lockstep" (PyTorch FSDP)."""
    cfg = planner.config
    return "spmd" if cfg.layout == "spmd" else f"per-rank-{'lockstep' if cfg.sync == 'micro-batch' else 'step'}"


def plan_shapes(config: Any, shapes_csv: Path | None = None) -> Any:
    """The samples to plan: ``--shapes``, the dataset index, or the synthetic dataset the spec would write."""
    from wanloom_trainer.adaptiveload.sizing.shape_index import SampleShapes
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
    from wanloom_trainer.adaptiveload.sizing.tokens import latent_shapes_for_pixels
    from wanloom_trainer.data.synthetic import synthetic_pixel_shapes

    synthetic = config.data.synthetic
    pixels = synthetic_pixel_shapes(variant, synthetic.samples, synthetic.seed)
    return SampleShapes.from_arrays(latent_shapes_for_pixels(variant, pixels))


def bucket_rows(planner: Planner) -> list[dict[str, Any]]:
    """Every non-empty bucket: latent shape, tokens, samples, share, memory cap, each sampler's batch size and the
    cost model's per-sample cost."""
    f, m_mem = planner.facts, planner.config.memory_budget_tokens
    counts = np.bincount(planner.bucket_of, minlength=len(f.tokens))
    present = np.flatnonzero(counts)
    equal = equal_token_batch_sizes(f.tokens[present], m_mem)
    paper = paper_batch_sizes(f.tokens[present], m_mem, planner.compute_budget, planner.exponent)
    return [
        {
            "latent_shape": [int(x) for x in f.shapes[b]],
            "tokens": int(f.tokens[b]),
            "samples": int(counts[b]),
            "share": float(counts[b] / counts.sum()),
            "cap": int(f.cap[b]),
            "batch_bucket_sampler": int(equal[i]),
            "batch_paper": int(paper[i]),
            "cost_per_sample": float(f.cost[b]),
        }
        for i, b in enumerate(present.tolist())
    ]


def bucket_table(planner: Planner) -> str:
    """``bucket_rows`` as a table."""
    lines = [
        f"{'latent (T,H,W)':>16} {'tokens':>8} {'samples':>9} {'share':>6} {'cap':>5} "
        f"{'B sampler':>9} {'B paper':>8} {'cost/sample':>12}"
    ]
    for r in bucket_rows(planner):
        shape = "x".join(str(x) for x in r["latent_shape"])
        lines.append(
            f"{shape:>16} {r['tokens']:>8,} {r['samples']:>9,} {r['share']:>6.1%} {r['cap']:>5} "
            f"{r['batch_bucket_sampler']:>9} {r['batch_paper']:>8} {r['cost_per_sample']:>12.4g}"
        )
    return "\n".join(lines)


def policy_table(results: dict[str, PolicyResult]) -> str:
    base = results[BASELINE].tokens_per_second
    lines = [
        f"{'policy':15} {'throughput':>10} {'load CV':>8} {'padding':>8} {'idle':>6} {'shapes':>7} {'tokens/s':>12}"
    ]
    for name, r in results.items():
        lines.append(
            f"{name:15} {r.tokens_per_second / base:>9.2f}x {r.load_cv:>8.1%} {r.padding_fraction:>8.1%} "
            f"{r.idle_fraction:>6.1%} {r.compiled_shapes:>7} {r.tokens_per_second:>12,.0f}"
        )
    return "\n".join(lines)


def policies_json(results: dict[str, PolicyResult]) -> dict[str, dict[str, float]]:
    return {name: r.to_json(results[BASELINE]) for name, r in results.items()}


def comparison_warnings(results: dict[str, PolicyResult], step_budget: str = "samples") -> list[str]:
    """Said once, where the balanced scheduler is predicted slower than the bucket sampler, or its steps break what
    the step budget promises."""
    ours = results["balanced"]
    warnings = []
    if ours.semantics is not None:
        warnings.extend(f"balanced steps: {p}" for p in semantics_problems(ours.semantics, step_budget))
    ratio = ours.tokens_per_second / results[BASELINE].tokens_per_second
    if ratio < 1.0:
        warnings.append(
            f"spec.adaptiveLoad.scheduler balanced is predicted at {ratio:.2f}x the bucket sampler on this data: "
            "balancing cannot help here; set spec.adaptiveLoad.scheduler: equal-tokens (one bucket per micro-batch)"
        )
    return warnings


def other_budget(planner: Planner, steps: int, results: dict[str, PolicyResult]) -> dict[str, Any] | None:
    """The balanced plan with the other ``adaptiveLoad.stepBudget`` over the same stream: what the choice costs or
    buys (None when a step is its own window: both budgets plan the same steps)."""
    if planner.window_steps == 1:
        return None
    other = "tokens" if planner.config.step_budget == "samples" else "samples"
    result = balanced(planner.with_step_budget(other), steps)[0]
    return {
        "step_budget": other,
        "throughput_vs_baseline": result.tokens_per_second / results[BASELINE].tokens_per_second,
        "samples_per_step": result.semantics.samples if result.semantics else None,
    }


def semantics_lines(semantics: StepSemantics, step_budget: str) -> list[str]:
    """What a balanced step trains, in a few lines."""
    p5, median, p95, largest = semantics.samples
    t5, tmed, t95, _ = semantics.tokens
    third = "/".join(f"{x:.2f}" for x in semantics.image_share_by_third)
    third_tokens = "/".join(f"{x:.2f}" for x in semantics.tokens_per_sample_by_third)
    rule = "1/globalBatch per sample" if step_budget == "samples" else "the same weight per token"
    return [
        f"balanced steps (stepBudget {step_budget}, {rule}): samples per step p5 {p5:.0f}, median {median:.0f}, "
        f"p95 {p95:.0f}, max {largest:.0f} (globalBatch {semantics.global_batch}); tokens per step p5 {t5:,.0f}, "
        f"median {tmed:,.0f}, p95 {t95:,.0f}",
        f"window thirds against their window: image share {third}, tokens per sample {third_tokens} (worst third "
        f"{semantics.worst_third:.0%} off)",
        f"expert updates: high-noise in {semantics.expert_update_share[0]:.0%} of steps "
        f"({semantics.expert_samples_per_step[0]:.1f} samples/step), low-noise in "
        f"{semantics.expert_update_share[1]:.0%} ({semantics.expert_samples_per_step[1]:.1f} samples/step)",
    ]


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
    *,
    shapes_csv: Path | None = None,
    as_json: bool = False,
    measure: Callable[[Any, Any], Any] | None = None,
) -> str:
    """The report of ``wanloom plan`` for a TrainingJob file (see the module docstring); ``as_json``: one JSON
    object ``{"mode", "ranks", "samples_per_rank", "expert_share", "baseline", "policies": {policy: {...}},
    "buckets", ...}``."""
    import json

    from wanloom_api.metrics import EXPERT_LABELS
    from wanloom_api.validation import load_trainingjob_file
    from wanloom_trainer.config.train_config import from_trainingjob

    config = from_trainingjob(load_trainingjob_file(trainingjob_path), {})
    shapes = plan_shapes(config, shapes_csv)
    cost = resolve_cost_model(config, bench, shapes, measure=measure)
    layout = "spmd" if config.backend == "jax" else "per-rank"
    pl = planner_from_config(config, shapes, cost.model, policy="balanced", layout=layout)
    steps = compare_steps(pl)
    results = compare(pl, steps)
    budget = pl.config.step_budget
    warnings = comparison_warnings(results, budget)
    alternative = other_budget(pl, steps, results)
    semantics = results["balanced"].semantics
    if as_json:
        shares = config.routing.expected_shares()
        return json.dumps(
            {
                "mode": plan_mode(pl),
                "ranks": pl.config.num_ranks,
                "samples_per_step": pl.config.global_batch,
                "samples_per_rank": pl.config.global_batch / pl.config.num_ranks,
                "window_steps": pl.window_steps,
                "compared_steps": steps,
                "expert_share": {EXPERT_LABELS[e]: float(shares[e]) if e < len(shares) else 0.0 for e in (0, 1)},
                "scheduler": config.adaptive_load.scheduler if config.adaptive_load.enabled else "equal-tokens",
                "baseline": BASELINE,
                "policies": policies_json(results),
                "step_budget": budget,
                "step_semantics": semantics.to_json() if semantics else None,
                "other_step_budget": alternative,
                "buckets": bucket_rows(pl),
                "warnings": warnings,
            }
        )
    head = [
        f"TrainingJob {config.job_name}: {config.model.variant}, {len(shapes):,} samples, "
        f"{config.parallel.batch_ranks} data-parallel ranks, mode {plan_mode(pl)}",
        f"memoryBudgetTokens {pl.config.memory_budget_tokens:,}; paper rule p = {pl.exponent:.3g}, "
        f"M_comp = {pl.compute_budget:.4g}",
        f"cost model: {cost.description}",
        _expert_share_line(config),
        f"balanced plans {pl.window_steps} step(s) of {pl.config.global_batch} samples at once",
    ]
    if cost.fit is not None:
        head.append(cost.fit.summary())
    head.extend(f"WARNING: {w}" for w in warnings)
    body = [
        "",
        bucket_table(pl),
        "",
        f"predicted over the same stream ({steps} steps of {pl.config.global_batch} samples; throughput relative to "
        f"the {BASELINE}; load CV over each slot's useful compute; shapes: step programs needed):",
        policy_table(results),
    ]
    if semantics is not None:
        body += ["", *semantics_lines(semantics, budget)]
    if alternative is not None:
        body.append(
            f"with spec.adaptiveLoad.stepBudget {alternative['step_budget']}: balanced at "
            f"{alternative['throughput_vs_baseline']:.2f}x the {BASELINE} (samples per step p5 "
            f"{alternative['samples_per_step'][0]:.0f} .. max {alternative['samples_per_step'][3]:.0f})"
        )
    return "\n".join(head + body)
