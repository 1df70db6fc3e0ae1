"""Where a run's cost model comes from: a stored shape benchmark, a new measurement, or the analytic FLOP model.

``resolve_cost_model(config)`` (``config``: ``config.TrainConfig``) is shared by the trainer and ``wanloom plan``:

1. a shape benchmark for the job's ``variant|accelerator|parallelism`` key in ``--bench`` or
   ``spec.adaptiveLoad.benchFile``, fitted with ``spec.adaptiveLoad.costModel`` (auto: by held-out error);
2. with ``measure=True`` (``wanloom plan --bench``) a missing entry is first measured on this machine, which must
   have the job's kind of device (tiny/CPU jobs locally; a GPU job on a GPU host);
3. ``costModel: power`` with ``exponent`` and no benchmark: B·S^p in S^p units;
4. otherwise the analytic FLOP model at 40% of the accelerator's dense bf16 peak (only ratios matter to planning).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wanloom_trainer.adaptiveload.cost_model import CostFit, CostModel, FlopCost, PowerCost
from wanloom_trainer.adaptiveload.shape_bench import (
    BenchPoint,
    bench_key,
    fit_points,
    load_points,
    run_shape_bench,
    save_points,
    shape_grid,
)
from wanloom_trainer.config.variants import WanVariant
from wanloom_trainer.flops import get_accelerator

ASSUMED_MFU = 0.40  # sustained fraction of peak assumed by the analytic cost model (only ratios matter to planning)
_CPU_FLOPS = 1e11  # a nominal CPU rate for the analytic model's time unit on CPU jobs


@dataclass(frozen=True)
class ResolvedCost:
    model: CostModel
    description: str
    fit: CostFit | None = None


def analytic_cost(variant: WanVariant, accelerator_type: str | None) -> ResolvedCost:
    """Analytic FLOP model; seconds at ``ASSUMED_MFU`` of the accelerator's peak (a nominal rate on CPU)."""
    if accelerator_type is None:
        return ResolvedCost(FlopCost(variant.name, _CPU_FLOPS), "analytic FLOPs at a nominal 100 GFLOP/s (CPU)")
    acc = get_accelerator(accelerator_type)
    rate = ASSUMED_MFU * acc.peak_bf16_flops
    return ResolvedCost(
        FlopCost(variant.name, rate),
        f"analytic FLOPs at {ASSUMED_MFU:.0%} of {acc.name} peak ({acc.peak_bf16_flops / 1e12:,.0f} TFLOP/s bf16)",
    )


def resolve_cost_model(
    config: Any,
    bench: Path | None = None,
    sample_shapes: Any = None,
    measure: bool = False,
) -> ResolvedCost:
    """The cost model of a run (``config``: ``config.TrainConfig``).

    Args:
        bench: shape-benchmark file; default ``spec.adaptiveLoad.benchFile``.
        sample_shapes: the dataset's shapes, for the grid of a new measurement.
        measure: measure a missing entry on this machine (``wanloom plan --bench``).
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
        if not measure:
            raise ValueError(f"{path} has no shape benchmark for {key}; run `wanloom plan --bench {path}` first")
        points = _measure(config, sample_shapes)
        save_points(path, key, points)
    fit = fit_points(points, kind=al.cost_model)
    return ResolvedCost(fit.model, f"shape benchmark {path} [{key}], {len(points)} points", fit)


def parallel_label(parallel: Any) -> str:
    """The parallelism part of a bench key, e.g. ``d1f16c4t1`` (data, fsdp, context, tensor degrees)."""
    return f"d{parallel.data}f{parallel.fsdp}c{parallel.context}t{parallel.tensor}"


def _measure(config: Any, sample_shapes: Any) -> list[BenchPoint]:
    """Time the job's own training step (its backend, mesh and kernels) on this machine's device of the job's kind."""
    from wanloom_trainer.adaptiveload.buckets import derive_buckets
    from wanloom_trainer.train.bench_step import BackendStep

    if not _on_job_devices(config):
        raise ValueError(
            f"the shape benchmark must run on the job's {config.accelerator_type or config.accelerator} devices; "
            "run `wanloom plan --bench FILE` where they are (e.g. in a trainer pod), or drop --bench to plan "
            "with the analytic FLOP model"
        )
    variant = config.model.wan
    shapes = derive_buckets(sample_shapes.latent_shapes).latent_shapes.tolist()
    grid = shape_grid(variant, shapes, config.adaptive_load.memory_budget_tokens)
    return run_shape_bench(BackendStep(config), grid, variant, warmup=1, repeats=3)


def _on_job_devices(config: Any) -> bool:
    if config.accelerator == "cpu":
        return True
    if config.backend == "torch":
        import torch

        return config.accelerator == "gpu" and torch.cuda.is_available()
    import jax

    return jax.default_backend() == config.accelerator
