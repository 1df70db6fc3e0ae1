"""Per-step load-balance metrics (pure functions; exporting them is the metrics module's job).

Predicted metrics take the cost grid [R, K] of a plan (``Planner.cost_grid`` or ``plan_cost_grid``): the compute
of micro-batch slot k on rank r, dummies and padding included. Measured metrics take per-rank step times [R].

Step time under the two synchronisation models (``PlanConfig.sync``), with a = per-micro-batch overhead:

- lockstep (FSDP: collectives in every micro-batch): ``Σ_k max_r (a + c[r, k])``
- per step (one gradient sync at the end): ``max_r Σ_k (a + c[r, k])`` — "the slowest rank".
"""

from __future__ import annotations

import numpy as np

from wanloom_trainer.adaptiveload.plan import StepPlan


def coefficient_of_variation(values: np.ndarray) -> float:
    """Population std / mean (0 for an all-zero or single-element input)."""
    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean()) if v.size else 0.0
    return float(v.std() / mean) if mean > 0 else 0.0


def compute_load_cv(cost_grid: np.ndarray) -> float:
    """CV across ranks of the predicted per-rank compute (sum over slots)."""
    return coefficient_of_variation(np.asarray(cost_grid).sum(axis=1))


def step_time_cv(rank_step_times: np.ndarray) -> float:
    """CV across ranks of measured per-rank step times (busy time before the final synchronisation)."""
    return coefficient_of_variation(rank_step_times)


def straggler_overhead(rank_step_times: np.ndarray) -> float:
    """max / mean − 1 of per-rank times: how much longer the step takes than a perfectly balanced one."""
    t = np.asarray(rank_step_times, dtype=np.float64)
    return float(t.max() / t.mean() - 1.0) if t.size and t.mean() > 0 else 0.0


def tokens_per_second(tokens: float, step_seconds: float) -> float:
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be positive, got {step_seconds}")
    return float(tokens) / step_seconds


def lockstep_time(cost_grid: np.ndarray, overhead: float = 0.0) -> float:
    """Σ over slots of the slowest rank's micro-batch (+ a per slot)."""
    grid = np.asarray(cost_grid, dtype=np.float64)
    return float(grid.max(axis=0).sum() + overhead * grid.shape[1]) if grid.size else 0.0


def slowest_rank_time(cost_grid: np.ndarray, overhead: float = 0.0) -> float:
    """max over ranks of the rank's total (+ a per micro-batch)."""
    grid = np.asarray(cost_grid, dtype=np.float64)
    return float(grid.sum(axis=1).max() + overhead * grid.shape[1]) if grid.size else 0.0


def step_time(cost_grid: np.ndarray, overhead: float, sync: str) -> float:
    if sync == "micro-batch":
        return lockstep_time(cost_grid, overhead)
    if sync == "step":
        return slowest_rank_time(cost_grid, overhead)
    raise ValueError(f"sync {sync!r} is not one of 'micro-batch', 'step'")


def idle_fraction(cost_grid: np.ndarray, overhead: float, sync: str) -> float:
    """Share of rank-time spent waiting: 1 − Σ_r busy_r / (R · step time)."""
    grid = np.asarray(cost_grid, dtype=np.float64)
    busy = grid.sum() + overhead * grid.size
    total = grid.shape[0] * step_time(grid, overhead, sync)
    return float(1.0 - busy / total) if total > 0 else 0.0


def plan_cost_grid(plan: StepPlan) -> np.ndarray:
    """[R, K] predicted compute of every micro-batch of a materialised plan."""
    return np.array([[mb.predicted_cost for mb in r.micro_batches] for r in plan.ranks], dtype=np.float64)
