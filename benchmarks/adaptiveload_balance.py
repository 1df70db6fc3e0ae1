"""AdaptiveLoad balance: equal-token batches vs the paper's dual-constraint rule vs the balanced scheduler.

Simulates training steps on a synthetic mixed image/video dataset whose shapes follow public corpus statistics
(assumptions in ``wanloom_trainer.adaptiveload.simulate``) at 8, 16 and 64 data-parallel ranks (per-rank layout,
PyTorch FSDP style), with step costs from

  (a) the analytic Wan2.2-A14B FLOP model at 40% of an H200's dense bf16 peak, plus 0.05 s per micro-batch, and
  (b) a cost model fitted to this machine's measured training steps of the tiny Wan model (diffusers
      ``WanTransformer3DModel``, CPU, one thread) on the same mix at 1/4 linear resolution.

Both synchronisation models are reported: "slowest rank" (one gradient sync per step: step time = max over ranks
of the rank's total) and "lockstep" (FSDP collectives in every micro-batch: step time = Σ over micro-batch slots of
the slowest rank's micro-batch). Also times the planning of one step for 1,024 ranks.

Usage (writes benchmarks/results/adaptiveload_balance.{json,png}):

    PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/adaptiveload_balance.py [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from wanloom_trainer.adaptiveload.cost_model import CostModel, FlopCost
from wanloom_trainer.adaptiveload.planner import PlanConfig, Planner
from wanloom_trainer.adaptiveload.shape_bench import fit_points, run_shape_bench, shape_grid
from wanloom_trainer.adaptiveload.shape_index import SampleShapes
from wanloom_trainer.adaptiveload.simulate import MixSpec, SimResult, simulate, synthetic_index
from wanloom_trainer.config.variants import WanVariant, get_variant
from wanloom_trainer.flops import get_accelerator
from wanloom_trainer.routing import Router, TimestepSampler

RESULTS = Path(__file__).parent / "results"
POLICIES = ("equal-tokens", "paper", "balanced")
SYNCS = ("step", "micro-batch")
RANKS = (8, 16, 64)
PER_RANK_BATCH = 16  # balanced: globalBatch = 16 × ranks
A14B_MEMORY = 151_200  # two 720p×81 clips per micro-batch: H200 with full remat (assumption, see docs)
SAMPLES = 200_000


def routers() -> dict[str, Router]:
    """The product default (per-sample joint routing, logit-normal t) and one expert per step."""
    sampler = TimestepSampler("logit-normal")
    return {"per-sample": Router(sampler, 0.875, "per-sample"), "per-batch": Router(sampler, 0.875, "per-batch")}


def run_grid(
    index: SampleShapes, variant: WanVariant, cost: CostModel, memory: int, router: Router, steps: int
) -> dict[tuple[int, str, str], SimResult]:
    out = {}
    for ranks in RANKS:
        for policy in POLICIES:
            for sync in SYNCS:
                cfg = PlanConfig(ranks, policy, "per-rank", PER_RANK_BATCH * ranks, memory, sync=sync, seed=0)
                out[(ranks, policy, sync)] = simulate(Planner(index, variant, cfg, cost, router), steps)
    return out


def tiny_cost_model(index: SampleShapes, memory: int) -> tuple[CostModel, str, list]:
    """Time real tiny-model training steps on this CPU and fit the cost model (auto: chosen by held-out error)."""
    from wanloom_trainer.adaptiveload.buckets import derive_buckets
    from wanloom_trainer.adaptiveload.torch_step import diffusers_step_fn

    tiny = get_variant("tiny")
    shapes = derive_buckets(index.latent_shapes).latent_shapes.tolist()
    grid = shape_grid(tiny, shapes, memory, max_shapes=6, max_batches=3)
    start = time.perf_counter()
    points = run_shape_bench(diffusers_step_fn(tiny, threads=1), grid, tiny, warmup=1, repeats=5)
    fit = fit_points(points)
    took = time.perf_counter() - start
    return fit.model, f"{len(points)} points in {took:.1f} s\n{fit.summary()}", points


def planning_time(index: SampleShapes, variant: WanVariant, cost: CostModel, router: Router) -> dict[str, float]:
    """Median milliseconds to plan one step for 1,024 ranks (8 samples each): decisions only, plus this rank's
    plan objects (what one trainer process does), and all 1,024 ranks' plan objects."""
    cfg = PlanConfig(1024, "balanced", "per-rank", 8 * 1024, A14B_MEMORY, seed=0)
    planner = Planner(index, variant, cfg, cost, router)
    planner.plan(0)  # builds the epoch permutation once, as a running trainer would have
    out = {}
    for name, fn in {
        "assign": lambda s: planner.assign(s),
        "assign+own rank": lambda s: planner.plan_rank(s, 7),
        "full StepPlan": lambda s: planner.plan(s),
    }.items():
        times = []
        for step in range(1, 21):
            start = time.perf_counter()
            fn(step)
            times.append(1e3 * (time.perf_counter() - start))
        out[name] = statistics.median(times)
    return out


def table(results: dict[tuple[int, str, str], SimResult]) -> str:
    rows = [
        "| ranks | policy | slowest rank: load CV | idle | tokens/s | × equal | lockstep: load CV | idle | tokens/s "
        "| × equal |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ranks in RANKS:
        base = {s: results[(ranks, "equal-tokens", s)].tokens_per_second for s in SYNCS}
        for policy in POLICIES:
            st, ls = results[(ranks, policy, "step")], results[(ranks, policy, "micro-batch")]
            rows.append(
                f"| {ranks} | {policy} | {st.mean_cv:.1%} | {st.idle_fraction:.1%} | {st.tokens_per_second:,.0f} | "
                f"{st.tokens_per_second / base['step']:.2f} | {ls.mean_cv:.1%} | {ls.idle_fraction:.1%} | "
                f"{ls.tokens_per_second:,.0f} | "
                f"{ls.tokens_per_second / base['micro-batch']:.2f} |"
            )
    return "\n".join(rows)


def plot(results: dict[str, dict[tuple[int, str, str], SimResult]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {"a": "-", "b": "--"}
    colors = {"equal-tokens": "tab:gray", "paper": "tab:orange", "balanced": "tab:blue"}
    for case, res in results.items():
        for policy in POLICIES:
            kw = {"color": colors[policy], "linestyle": styles[case], "marker": "o", "label": f"{policy} ({case})"}
            axes[0].plot(RANKS, [100 * res[(r, policy, "micro-batch")].mean_cv for r in RANKS], **kw)
            for ax, sync in zip(axes[1:], SYNCS, strict=True):
                ratio = [
                    res[(r, policy, sync)].tokens_per_second / res[(r, "equal-tokens", sync)].tokens_per_second
                    for r in RANKS
                ]
                ax.plot(RANKS, ratio, **kw)
    axes[0].set(title="compute-load CV across ranks, FSDP lockstep plans (%)", xlabel="ranks", xscale="log")
    axes[1].set(title="throughput vs equal-token (slowest rank)", xlabel="ranks", xscale="log")
    axes[2].set(title="throughput vs equal-token (FSDP lockstep)", xlabel="ranks", xscale="log")
    for ax in axes:
        ax.minorticks_off()
        ax.set_xticks(RANKS, [str(r) for r in RANKS])
        ax.grid(alpha=0.3)
    axes[1].axhline(1.3, color="k", lw=0.8, ls=":")
    axes[2].axhline(1.3, color="k", lw=0.8, ls=":")
    axes[0].legend(fontsize=7)
    fig.suptitle("AdaptiveLoad balance: (a) analytic Wan2.2-A14B FLOPs, (b) fitted tiny-model CPU timings")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="simulated steps per configuration")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    a14b, tiny = get_variant("wan2.2-t2v-a14b"), get_variant("tiny")
    peak = get_accelerator("h200").peak_bf16_flops
    flop_cost = FlopCost(a14b.name, 0.4 * peak, a=0.05)
    index_a = synthetic_index(a14b, SAMPLES, seed=0)

    results: dict[str, dict] = {}
    report: dict[str, object] = {"steps": args.steps, "samples": SAMPLES}
    for name, router in routers().items():
        res = run_grid(index_a, a14b, flop_cost, A14B_MEMORY, router, args.steps)
        print(f"\n(a) analytic Wan2.2-A14B FLOPs, routing {name}\n{table(res)}")
        report[f"a/{name}"] = {f"{r}/{p}/{s}": asdict(v) for (r, p, s), v in res.items()}
        if name == "per-sample":
            results["a"] = res

    index_b = synthetic_index(tiny, SAMPLES, seed=0, mix=MixSpec(scale=4))
    memory_b = 2 * int(max(tiny.tokens(*s) for s in np.unique(index_b.latent_shapes, axis=0)))
    fitted, summary, points = tiny_cost_model(index_b, memory_b)
    print(f"\n(b) tiny-model cost model fitted on this CPU ({summary})")
    res_b = run_grid(index_b, tiny, fitted, memory_b, routers()["per-sample"], args.steps)
    print(f"\n(b) fitted tiny-model timings, routing per-sample, memoryBudgetTokens {memory_b}\n{table(res_b)}")
    results["b"] = res_b
    report["b/per-sample"] = {f"{r}/{p}/{s}": asdict(v) for (r, p, s), v in res_b.items()}
    report["b/fit"] = {"model": fitted.to_dict(), "summary": summary, "points": [asdict(p) for p in points]}

    timing = planning_time(index_a, a14b, flop_cost, routers()["per-sample"])
    print(
        "\nplanning one step for 1,024 ranks (8,192 samples), median ms: "
        + ", ".join(f"{k} {v:.2f}" for k, v in timing.items())
    )
    report["planning_ms_1024_ranks"] = timing
    (RESULTS / "adaptiveload_balance.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    plot(results, RESULTS / "adaptiveload_balance.png")
    print(f"\nwrote {RESULTS / 'adaptiveload_balance.json'} and {RESULTS / 'adaptiveload_balance.png'}")


if __name__ == "__main__":
    main()
