"""AdaptiveLoad balance in the modes the trainers run: equal-token batches vs the paper's rule vs balanced.

Every policy gets the same samples per step (16 per data-parallel rank from the same seeded stream), and each
configuration is simulated in the execution mode of one trainer:

- ``gpu``: the PyTorch trainer's layout, per-rank micro-batches with FSDP collectives in every micro-batch
  (lockstep: a step takes Σ over slots of the slowest rank), memoryBudgetTokens 151,200 (two 720p × 81 clips);
- ``tpu``: the JAX trainer's layout, SPMD (every slot one program on every device): the baselines group each
  bucket over all ranks, padding with zero-weight rows; balanced packs samples into one row per rank per slot;
  memoryBudgetTokens 75,600 per data-parallel rank (one 720p × 81 clip over a context group of 4).

Costs come from the analytic Wan2.2-T2V-A14B FLOP model (``flops.py``) at 40% of the device's dense bf16 peak plus a
per-micro-batch overhead (0.05 s GPU, 0.02 s TPU); ratios do not depend on the rate. Two shape mixes: the reference
mix of ``adaptiveload.simulate`` and a held-out one the planner was never tuned on (more images, more 720p, shorter
clips). Reported per configuration: load CV over useful compute (padding is not load), padding share of compute,
idle share of rank-time, throughput relative to equal tokens, micro-batches per rank.

Planning cost at 1,024 ranks (16,384 samples): ``plan_local`` (what one process computes: the step's decisions and
its own rank's micro-batches) on one core, and the time the training loop waits for its plan when planning runs in
the ``PlansAhead`` thread and each step keeps the loop busy for 50 ms (a real A14B step takes seconds).

Usage (writes benchmarks/results/adaptiveload_balance.{json,png}):

    PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/adaptiveload_balance.py [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from wanloom_trainer.adaptiveload.cost_model import FlopCost
from wanloom_trainer.adaptiveload.planner import PlanConfig, Planner
from wanloom_trainer.adaptiveload.simulate import MixSpec, SimResult, simulate, synthetic_index
from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.flops import get_accelerator
from wanloom_trainer.routing import Router, TimestepSampler
from wanloom_trainer.train.plan_ahead import PlansAhead

RESULTS = Path(__file__).parent / "results"
POLICIES = ("equal-tokens", "paper", "balanced")
RANKS = (16, 64, 1024)
PER_RANK_SAMPLES = 16
SAMPLES = 200_000
A14B = get_variant("wan2.2-t2v-a14b")
MIXES = {
    "reference": MixSpec(),
    "held-out": MixSpec(image_share=0.45, clip_720p_share=0.6, duration_mean_s=5.0, duration_log_sigma=0.8),
}


def modes() -> dict[str, dict]:
    gpu = FlopCost(A14B.name, 0.4 * get_accelerator("h200").peak_bf16_flops, a=0.05)
    tpu_group = 4 * get_accelerator("tpu7x-tensorcore").peak_bf16_flops  # one data rank = a context group of 4
    tpu = FlopCost(A14B.name, 0.4 * tpu_group, a=0.02)
    return {
        "gpu": {"layout": "per-rank", "memory": 151_200, "cost": gpu, "multiple": 1},
        "tpu": {"layout": "spmd", "memory": 75_600, "cost": tpu, "multiple": 4},
    }


def router() -> Router:
    """The A14B recipe default (uniform timesteps, shift 5, per-sample joint routing at t = 875)."""
    return Router(TimestepSampler("uniform", shift=5.0), 0.875, "per-sample")


def planner(index, mode: dict, policy: str, ranks: int) -> Planner:  # type: ignore[no-untyped-def]
    config = PlanConfig(
        ranks, policy, mode["layout"], global_batch=PER_RANK_SAMPLES * ranks, memory_budget_tokens=mode["memory"],
        seed=0, sequence_multiple=mode["multiple"], same_samples=True,
    )  # fmt: skip
    return Planner(index, A14B, config, mode["cost"], router())


def row(result: SimResult, base: SimResult) -> dict[str, float]:
    return {
        "load_cv": result.mean_cv,
        "padding_fraction": result.padding_fraction,
        "idle_fraction": max(0.0, result.idle_fraction),
        "throughput_vs_equal_tokens": result.tokens_per_second / base.tokens_per_second,
        "micro_batches_per_rank": result.mean_slots,
    }


def planning(index, mode: dict, step_s: float = 0.05, steps: int = 20) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Milliseconds per step at 1,024 ranks: plan_local on one core, and the loop's wait with PlansAhead."""
    p = planner(index, mode, "balanced", 1024)
    p.plan_local(0, [7])  # the epoch permutation, built once as in a running trainer
    times = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        p.plan_local(step, [7])
        times.append(1e3 * (time.perf_counter() - start))
    ahead = PlansAhead((p.plan_local(s, [7]) for s in range(steps + 1, 2 * steps + 1)), depth=2)
    waits = []
    for _ in range(steps):
        start = time.perf_counter()
        next(ahead)
        waits.append(1e3 * (time.perf_counter() - start))
        time.sleep(step_s)  # the device-bound step
    ahead.close()
    return {"plan_local_ms": statistics.median(times), "loop_wait_ms": statistics.median(waits[1:])}


def table(results: dict) -> str:
    lines = [
        "| mix | mode | ranks | policy | load CV | padding | idle | × equal tokens | micro-batches/rank |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for key, r in results.items():
        mix, mode, ranks, policy = key.split("/")
        lines.append(
            f"| {mix} | {mode} | {ranks} | {policy} | {r['load_cv']:.1%} | {r['padding_fraction']:.1%} | "
            f"{r['idle_fraction']:.1%} | {r['throughput_vs_equal_tokens']:.2f} | {r['micro_batches_per_rank']:.1f} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"equal-tokens": "tab:gray", "paper": "tab:orange", "balanced": "tab:blue"}
    for ax, mode in zip(axes, ("gpu", "tpu"), strict=True):
        for mix, style in (("reference", "-"), ("held-out", "--")):
            for policy in POLICIES:
                ys = [results[f"{mix}/{mode}/{r}/{policy}"]["throughput_vs_equal_tokens"] for r in RANKS]
                ax.plot(RANKS, ys, style, marker="o", color=colors[policy], label=f"{policy} ({mix})")
        title = "GPU: per-rank lockstep" if mode == "gpu" else "TPU: SPMD (balanced = packed)"
        ax.set(title=f"{title}, same samples", xlabel="data-parallel ranks", ylabel="throughput vs equal tokens")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(RANKS, [str(r) for r in RANKS])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="simulated steps per configuration")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, float]] = {}
    for mix_name, mix in MIXES.items():
        index = synthetic_index(A14B, SAMPLES, seed=0 if mix_name == "reference" else 1, mix=mix)
        for mode_name, mode in modes().items():
            for ranks in RANKS:
                sims = {p: simulate(planner(index, mode, p, ranks), args.steps) for p in POLICIES}
                for policy, sim in sims.items():
                    results[f"{mix_name}/{mode_name}/{ranks}/{policy}"] = row(sim, sims["equal-tokens"])
    print(table(results))
    index = synthetic_index(A14B, SAMPLES, seed=0)
    timing = {name: planning(index, mode) for name, mode in modes().items()}
    for name, t in timing.items():
        print(f"planning at 1,024 ranks ({name}): plan_local {t['plan_local_ms']:.1f} ms on one core; "
              f"the loop waits {t['loop_wait_ms']:.2f} ms per step")  # fmt: skip
    report = {
        "steps": args.steps,
        "samples_per_rank": PER_RANK_SAMPLES,
        "modes": {k: {**v, "cost": asdict(v["cost"])} for k, v in modes().items()},
        "results": results,
        "planning_1024_ranks": timing,
    }
    (RESULTS / "adaptiveload_balance.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(results, RESULTS / "adaptiveload_balance.png")
    print(f"wrote {RESULTS / 'adaptiveload_balance.json'} and {RESULTS / 'adaptiveload_balance.png'}")


if __name__ == "__main__":
    main()
