"""AdaptiveLoad against the sampler users would otherwise run, over one sample stream, in the trainers' modes.

Policies (``adaptiveload.comparison.compare``): ``bucket-sampler`` (the baseline: one bucket and one expert per
micro-batch, B = ⌊M_mem/S_b⌋; per-rank draws in lockstep on GPUs, one bucket per slot for all devices on TPUs),
``paper`` (the same sampler with the paper's B) and ``balanced`` (the trainer's planner: planning windows, lockstep
slots on GPUs, two-shape packing on TPUs). Each consumes the same stream: 1,024 samples per data-parallel rank of the
balanced planner's data order and routing draws, at 4 and 16 samples per rank per step.

- ``gpu``: the PyTorch trainer's layout, per-rank micro-batches with FSDP collectives in every micro-batch
  (lockstep), memoryBudgetTokens 151,200 (two 720p × 81 clips);
- ``tpu``: the JAX trainer's layout, SPMD, memoryBudgetTokens 75,600 per data-parallel rank (one 720p × 81 clip
  over a context group of 4). The sampler's last, short chunk per queue is padded to its program, as in an epoch
  of this stream's length.

Both modes also give the balanced plan against the *global* per-bucket sampler at steady state (every rank the same
bucket, short chunks charged pro rata, as in a much longer epoch), and that sampler's ceiling: it idles and pads
nothing and its micro-batches are as large as memory allows, so no plan of the same samples can be faster than it by
more than its call overheads (``time / useful_time``).

Costs come from the analytic Wan2.2-T2V-A14B FLOP model (``flops.py``) at 40% of the device's dense bf16 peak plus a
per-micro-batch overhead (0.05 s GPU, 0.02 s TPU); ratios do not depend on the rate. Three shape mixes: the reference
mix of ``adaptiveload.comparison.simulate``, a held-out one (more images, more 720p, shorter clips) and an unseen one
added after the planner was tuned (mostly 480p, portrait-heavy, 3 s clips, few images).

Planning cost at 1,024 ranks: ``plan_local`` (what one process computes) on one core, median and the slowest step
(the first step of a window plans the whole window), and the time the training loop waits for its plan when
planning runs in the ``PlansAhead`` thread and each step keeps the loop busy for 50 ms (a real A14B step takes
seconds).

Usage (writes benchmarks/results/adaptiveload_balance.{json,png}):

    PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/adaptiveload_balance.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from wanloom_trainer.adaptiveload.comparison.compare import BASELINE, POLICIES, STEADY, balanced, compare
from wanloom_trainer.adaptiveload.comparison.report import compare_steps
from wanloom_trainer.adaptiveload.comparison.simulate import MixSpec, synthetic_index
from wanloom_trainer.adaptiveload.cost.cost_model import FlopCost
from wanloom_trainer.adaptiveload.planner import PlanConfig, Planner
from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.feed.plan_ahead import PlansAhead
from wanloom_trainer.flops import get_accelerator
from wanloom_trainer.kernels.adaln_shapes import max_packed_segments
from wanloom_trainer.routing import Router, TimestepSampler

RESULTS = Path(__file__).parent / "results"
RANKS = (16, 64, 1024)
SAMPLES_PER_RANK = (4, 16)
SAMPLES = 200_000
A14B = get_variant("wan2.2-t2v-a14b")
MIXES = {
    "reference": MixSpec(),
    "held-out": MixSpec(image_share=0.45, clip_720p_share=0.6, duration_mean_s=5.0, duration_log_sigma=0.8),
    "unseen": MixSpec(
        image_share=0.1, clip_720p_share=0.2, duration_mean_s=3.0, duration_log_sigma=0.5, clip_aspects=(0.4, 0.5, 0.1)
    ),
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


def planner(index, mode: dict, ranks: int, per_rank: int) -> Planner:  # type: ignore[no-untyped-def]
    config = PlanConfig(
        ranks, "balanced", mode["layout"], global_batch=per_rank * ranks, memory_budget_tokens=mode["memory"],
        seed=0, sequence_multiple=mode["multiple"], max_segments=max_packed_segments(A14B.dim),
    )  # fmt: skip
    return Planner(index, A14B, config, mode["cost"], router())


def run_config(index, mode: dict, ranks: int, per_rank: int) -> dict[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    """Every policy over the same stream, and the balanced plan against the global sampler's steady state."""
    p = planner(index, mode, ranks, per_rank)
    steps = compare_steps(p)
    results = compare(p, steps, steady=True)
    # The global per-bucket sampler at steady state (every rank one bucket, short chunks pro rata): no idle, no
    # padding, the largest micro-batches; no plan of these samples can beat it by more than its call overheads.
    steady = results.pop(STEADY)
    rows = {name: r.to_json(results[BASELINE]) for name, r in results.items()}
    rows["balanced"]["shapes_per_expert"] = max(results["balanced"].shapes_per_expert)
    sem = results["balanced"].semantics
    g = per_rank * ranks
    rows["balanced"].update(
        samples_p5=sem.samples[0] / g, samples_p95=sem.samples[2] / g, samples_max=sem.samples[3] / g,
        worst_third=sem.worst_third, expert_update_share=min(sem.expert_update_share),
    )  # fmt: skip
    if p.window_steps > 1:  # what the other step budget would give over the same stream
        alt = balanced(p.with_step_budget("tokens"), steps)[0]
        rows["balanced"]["tokens_budget_vs_baseline"] = alt.tokens_per_second / results[BASELINE].tokens_per_second
    rows["balanced"]["throughput_vs_steady_sampler"] = results["balanced"].tokens_per_second / steady.tokens_per_second
    rows["balanced"]["steady_sampler_ceiling"] = steady.time / steady.useful_time
    return rows


def planning(index, mode: dict, step_s: float = 0.05, steps: int = 16) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Milliseconds per step at 1,024 ranks, 16 samples per rank: plan_local on one core (median, slowest), and the
    loop's wait with PlansAhead."""
    p = planner(index, mode, 1024, 16)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        p.plan_local(step, [7])
        times.append(1e3 * (time.perf_counter() - start))
    ahead = PlansAhead((p.plan_local(s, [7]) for s in range(steps, 2 * steps)), depth=2)
    waits = []
    for _ in range(steps):
        start = time.perf_counter()
        next(ahead)
        waits.append(1e3 * (time.perf_counter() - start))
        time.sleep(step_s)  # the device-bound step
    ahead.close()
    return {
        "plan_local_ms": statistics.median(times),
        "plan_local_max_ms": max(times),
        "loop_wait_ms": statistics.median(waits[1:]),
        "window_steps": p.window_steps,
    }


def table(results: dict) -> str:
    lines = [
        "| mix | mode | ranks | samples/rank | policy | × bucket sampler | × global sampler at steady state (ceiling) "
        "| load CV | padding | idle | step programs | samples/step ÷ G (p5–p95, max) | worst window third "
        "| × sampler, token budget |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for key, r in results.items():
        mix, mode, ranks, per_rank, policy = key.split("/")
        ratio = f"{r['throughput_vs_baseline']:.2f}"
        if "throughput_vs_steady_sampler" in r:
            ratio += f" | {r['throughput_vs_steady_sampler']:.3f} (≤ {r['steady_sampler_ceiling']:.3f})"
        else:
            ratio += " |"
        semantics = " | |"
        if "samples_p5" in r:
            tokens = f"{r['tokens_budget_vs_baseline']:.2f}" if "tokens_budget_vs_baseline" in r else ""
            semantics = (
                f" {r['samples_p5']:.2f}–{r['samples_p95']:.2f}, {r['samples_max']:.2f} | {r['worst_third']:.0%} | "
                f"{tokens} |"
            )
        lines.append(
            f"| {mix} | {mode} | {int(ranks):,} | {per_rank} | {policy} | {ratio} | {r['load_cv']:.1%} | "
            f"{r['padding_fraction']:.1%} | {r['idle_fraction']:.1%} | {r['compiled_shapes']} |{semantics}"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"bucket-sampler": "tab:gray", "paper": "tab:orange", "balanced": "tab:blue"}
    styles = {"reference": "-", "held-out": "--", "unseen": ":"}
    for ax, mode in zip(axes, ("gpu", "tpu"), strict=True):
        for mix, style in styles.items():
            for policy in POLICIES:
                ys = [results[f"{mix}/{mode}/{r}/16/{policy}"]["throughput_vs_baseline"] for r in RANKS]
                ax.plot(RANKS, ys, style, marker="o", color=colors[policy], label=f"{policy} ({mix})")
        title = "GPU: per-rank lockstep" if mode == "gpu" else "TPU: SPMD (balanced = packed)"
        ax.set(title=f"{title}, 16 samples/rank", xlabel="data-parallel ranks", ylabel="throughput vs bucket sampler")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(RANKS, [str(r) for r in RANKS])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, float]] = {}
    for seed, (mix_name, mix) in enumerate(MIXES.items()):
        index = synthetic_index(A14B, SAMPLES, seed=seed, mix=mix)
        for mode_name, mode in modes().items():
            for ranks in RANKS:
                for per_rank in SAMPLES_PER_RANK:
                    rows = run_config(index, mode, ranks, per_rank)
                    for policy, row in rows.items():
                        results[f"{mix_name}/{mode_name}/{ranks}/{per_rank}/{policy}"] = row
                    print(f"{mix_name} {mode_name} {ranks} ranks {per_rank}/rank: balanced "
                          f"{rows['balanced']['throughput_vs_baseline']:.3f}x", flush=True)  # fmt: skip
    print(table(results))
    index = synthetic_index(A14B, SAMPLES, seed=0)
    timing = {name: planning(index, mode) for name, mode in modes().items()}
    for name, t in timing.items():
        print(f"planning at 1,024 ranks ({name}, windows of {t['window_steps']} steps): plan_local median "
              f"{t['plan_local_ms']:.1f} ms, slowest {t['plan_local_max_ms']:.0f} ms on one core; the loop waits "
              f"{t['loop_wait_ms']:.2f} ms per step")  # fmt: skip
    report = {
        "samples_per_rank_streamed": 1024,
        "modes": {k: {**v, "cost": asdict(v["cost"])} for k, v in modes().items()},
        "results": results,
        "planning_1024_ranks": timing,
    }
    (RESULTS / "adaptiveload_balance.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(results, RESULTS / "adaptiveload_balance.png")
    print(f"wrote {RESULTS / 'adaptiveload_balance.json'} and {RESULTS / 'adaptiveload_balance.png'}")


if __name__ == "__main__":
    main()
