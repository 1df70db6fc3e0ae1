"""Unequal per-rank batches with the plan's weights give the gradient of the global mean over samples.

Model: linear regression on per-token features; sample i has tokens(i) rows X_i [S_i, d] and targets y_i [S_i];
its loss is its own mean squared error ℓ_i(w) = mean_j (X_i w − y_i)_j², ∇ℓ_i = 2/S_i · X_iᵀ(X_i w − y_i).
Reference (one process): ∇ (1/N) Σ_i ℓ_i. Distributed: rank r back-propagates Σ_mb Σ_rows weight·ℓ_id and the
gradients are summed over ranks.
"""

import numpy as np
import pytest

from wanloom_trainer.adaptiveload.planner import PlanConfig, Planner

from .conftest import A14B

D = 5
W = np.random.default_rng(42).standard_normal(D)


def sample_data(sample_id, tokens):
    rng = np.random.default_rng(sample_id)
    rows = max(2, tokens // 1000)  # a few rows per sample, more for longer samples
    return rng.standard_normal((rows, D)), rng.standard_normal(rows)


def grad(sample_id, tokens):
    x, y = sample_data(sample_id, tokens)
    return 2.0 / len(y) * x.T @ (x @ W - y)


def rank_gradient(rank_plan):
    g = np.zeros(D)
    for mb in rank_plan.micro_batches:
        for sid, w in zip(mb.sample_ids, mb.weights, strict=True):  # dummies have no rows at all
            g += w * grad(sid, mb.tokens)
    return g


def reference_gradient(plan):
    real = [
        (sid, mb.tokens)
        for r in plan.ranks
        for mb in r.micro_batches
        for sid, w in zip(mb.sample_ids, mb.weights, strict=True)
        if w > 0
    ]
    return np.mean([grad(sid, tok) for sid, tok in real], axis=0), len(real)


@pytest.mark.parametrize(
    ("policy", "layout"),
    [
        ("balanced", "per-rank"),
        ("paper", "per-rank"),
        ("equal-tokens", "per-rank"),
        ("balanced", "spmd"),
        ("paper", "spmd"),
    ],
)
def test_summed_weighted_gradients_equal_global_mean(index, flop_cost, router, policy, layout):
    planner = Planner(
        index, A14B, PlanConfig(6, policy, layout, global_batch=40, memory_budget_tokens=151_200), flop_cost, router
    )
    for step in range(3):
        plan = planner.plan(step)
        ref, n = reference_gradient(plan)
        assert n == plan.num_samples
        got = sum(rank_gradient(r) for r in plan.ranks)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_per_rank_mean_then_mean_is_wrong_for_unequal_batches(index, flop_cost, router):
    config = PlanConfig(6, "balanced", global_batch=40, memory_budget_tokens=151_200, window_samples_per_rank=1)
    planner = Planner(index, A14B, config, flop_cost, router)
    plan = planner.plan(0)
    counts = [r.num_samples for r in plan.ranks]
    assert len(set(counts)) > 1  # the balanced plan really gives ranks different batch sizes
    naive = np.mean([rank_gradient(r) * plan.num_samples / r.num_samples for r in plan.ranks], axis=0)
    ref, _ = reference_gradient(plan)
    assert not np.allclose(naive, ref, rtol=1e-3)
    # and averaging (instead of summing) over ranks is off by exactly R
    np.testing.assert_allclose(np.mean([rank_gradient(r) for r in plan.ranks], axis=0) * len(plan.ranks), ref)


def test_padding_rows_carry_zero_weight(index, flop_cost, router):
    config = PlanConfig(6, "equal-tokens", "spmd", global_batch=40, memory_budget_tokens=151_200)
    planner = Planner(index, A14B, config, flop_cost, router)
    for step in range(64):  # a bucket's last chunk of the epoch is short: its missing rows are padding
        mbs = [mb for r in planner.plan(step).ranks for mb in r.micro_batches]
        rows = [(sid, w) for mb in mbs for sid, w in zip(mb.sample_ids, mb.weights, strict=True)]
        padding = [sid for sid, w in rows if w == 0.0]
        if padding:
            break
    assert padding
    real = {sid for sid, w in rows if w > 0}
    assert set(padding) <= real  # duplicates of real samples of the same micro-batch shape
