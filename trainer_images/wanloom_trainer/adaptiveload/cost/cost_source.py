"""Where a run's cost model comes from: a stored shape benchmark, a new measurement, or the analytic FLOP model.

``resolve_cost_model(config)`` (``config``: ``config.TrainConfig``) is shared by the trainer and ``wanloom plan``:

1. a shape benchmark for the job's ``variant|accelerator|parallelism`` key in ``--bench`` or
   ``spec.adaptiveLoad.benchFile``, fitted with ``spec.adaptiveLoad.costModel`` (auto: by held-out error);
2. with ``measure`` (``wanloom plan --bench``: ``train.bench_step.measure_shape_bench``, the job's own step timed on
   this machine) a missing entry is first measured and stored;
3. ``costModel: power`` with ``exponent`` and no benchmark: B·S^p in S^p units;
4. otherwise the analytic FLOP model at 40% of the accelerator's dense bf16 peak (only ratios matter to planning)
   plus an assumed per-micro-batch overhead (``CALL_OVERHEAD_S``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wanloom_trainer.adaptiveload.cost.cost_model import CostFit, CostModel, FlopCost, PowerCost
from wanloom_trainer.adaptiveload.cost.shape_bench import BenchPoint, bench_key, fit_points, load_points, save_points
from wanloom_trainer.config.variants import WanVariant
from wanloom_trainer.flops import get_accelerator

ASSUMED_MFU = 0.40  # sustained fraction of peak assumed by the analytic cost model (only ratios matter to planning)
_CPU_FLOPS = 1e11  # a nominal CPU rate for the analytic model's time unit on CPU jobs
# Seconds one micro-batch costs beyond its FLOPs, by device kind: on GPUs FSDP's per-block all-gathers and
# reduce-scatters and the Python dispatch of ~40 blocks; on TPUs one program dispatch and its host round trip; on a
# CPU a few ms of dispatch. Assumed, not measured: a shape benchmark or an accepted online refit replaces them.
CALL_OVERHEAD_S = {"gpu": 0.05, "tpu": 0.02, "cpu": 0.005}


@dataclass(frozen=True)
class ResolvedCost:
    model: CostModel
    description: str
    fit: CostFit | None = None


def analytic_cost(variant: WanVariant, accelerator_type: str | None) -> ResolvedCost:
    """Analytic FLOP model; seconds at ``ASSUMED_MFU`` of the accelerator's peak (a nominal rate on CPU)."""
    if accelerator_type is None:
        a = CALL_OVERHEAD_S["cpu"]
        return ResolvedCost(
            FlopCost(variant.name, _CPU_FLOPS, a=a),
            f"analytic FLOPs at a nominal 100 GFLOP/s (CPU) + {a * 1e3:g} ms per micro-batch",
        )
    acc = get_accelerator(accelerator_type)
    kind = "cpu" if acc.name == "cpu" else "tpu" if acc.name.startswith("tpu") else "gpu"
    rate, a = ASSUMED_MFU * acc.peak_bf16_flops, CALL_OVERHEAD_S[kind]
    # The CPU's entry is one core's fp32 rate (local runs train the tiny model in fp32), the others dense bf16.
    peak = (
        f"{acc.peak_bf16_flops / 1e12:,.0f} TFLOP/s bf16"
        if kind != "cpu"
        else f"{acc.peak_bf16_flops / 1e9:,.0f} GFLOP/s fp32"
    )
    return ResolvedCost(
        FlopCost(variant.name, rate, a=a),
        f"analytic FLOPs at {ASSUMED_MFU:.0%} of {acc.name} peak ({peak}) + {a * 1e3:g} ms per micro-batch",
    )


def resolve_cost_model(
    config: Any,
    bench: Path | None = None,
    sample_shapes: Any = None,
    measure: Callable[[Any, Any], list[BenchPoint]] | None = None,
) -> ResolvedCost:
    """The cost model of a run (``config``: ``config.TrainConfig``).

    Args:
        bench: shape-benchmark file; default ``spec.adaptiveLoad.benchFile``.
        sample_shapes: the dataset's shapes, for the grid of a new measurement.
        measure: ``measure(config, sample_shapes)`` times a missing entry's grid on this machine (the trainer side
            owns the backend step; ``wanloom plan --bench`` passes it).
    """
    al, variant = config.adaptive_load, config.model.wan
    path = bench or (Path(al.bench_file) if al.bench_file else None)
    if path is None:
        if al.cost_model == "power" and al.exponent is not None:
            return ResolvedCost(PowerCost(0.0, 1.0, al.exponent), f"power law S^{al.exponent:g} from the spec")
        return analytic_cost(variant, config.accelerator_type)
    key = bench_key(variant.name, config.accelerator_type or "cpu", parallel_label(config.parallel))
    points = load_points(path, key)
    if points is None:
        if measure is None:
            raise ValueError(f"{path} has no shape benchmark for {key}; run `wanloom plan --bench {path}` first")
        points = measure(config, sample_shapes)
        save_points(path, key, points)
    fit = fit_points(points, kind=al.cost_model)
    return ResolvedCost(fit.model, f"shape benchmark {path} [{key}], {len(points)} points", fit)


def parallel_label(parallel: Any) -> str:
    """The parallelism part of a bench key, e.g. ``d1f16c4t1`` (data, fsdp, context, tensor degrees)."""
    return f"d{parallel.data}f{parallel.fsdp}c{parallel.context}t{parallel.tensor}"
