"""Unequal per-rank batches with the plan's weights give the gradient of the rule the step budget names.

Model: linear regression on per-token features; sample i has tokens(i) rows X_i [S_i, d] and targets y_i [S_i];
its loss is its own mean squared error ℓ_i(w) = mean_j (X_i w − y_i)_j², ∇ℓ_i = 2/S_i · X_iᵀ(X_i w − y_i).
Reference (one process): ∇ (1/N) Σ_i ℓ_i for the bucket-chunk policies (N: the step's samples); ∇ (1/G) Σ_i ℓ_i for
"balanced" with step budget "samples" (G: globalBatch, whatever the step holds); ∇ Σ_i S_i·ℓ_i / (G·S̄) with
"tokens" (S̄: the dataset's mean tokens per sample). Distributed: rank r back-propagates Σ_mb Σ_rows weight·ℓ_id
and the gradients are summed over ranks.
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


def real_samples(plan):
    """(sample id, its tokens) of every real row; a packed micro-batch's rows have tokens of their own."""
    out = []
    for r in plan.ranks:
        for mb in r.micro_batches:
            tokens = mb.packed.sample_tokens if mb.packed is not None else [mb.tokens] * len(mb.sample_ids)
            out.extend((sid, t) for sid, t, w in zip(mb.sample_ids, tokens, mb.weights, strict=True) if w > 0)
    return out


def reference_gradient(plan):
    real = real_samples(plan)
    return np.mean([grad(sid, tok) for sid, tok in real], axis=0), len(real)


def rank_gradient_packed(rank_plan):
    g = np.zeros(D)
    for mb in rank_plan.micro_batches:
        tokens = mb.packed.sample_tokens if mb.packed is not None else [mb.tokens] * len(mb.sample_ids)
        for sid, t, w in zip(mb.sample_ids, tokens, mb.weights, strict=True):
            g += w * grad(sid, t)
    return g


@pytest.mark.parametrize(("policy", "layout"), [("paper", "per-rank"), ("equal-tokens", "per-rank"), ("paper", "spmd")])
def test_bucket_chunk_steps_give_the_gradient_of_the_step_mean(index, flop_cost, router, policy, layout):
    planner = Planner(
        index, A14B, PlanConfig(6, policy, layout, global_batch=40, memory_budget_tokens=151_200), flop_cost, router
    )
    for step in range(3):
        plan = planner.plan(step)
        ref, n = reference_gradient(plan)
        assert n == plan.num_samples
        got = sum(rank_gradient(r) for r in plan.ranks)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["per-rank", "spmd"])
@pytest.mark.parametrize("budget", ["samples", "tokens"])
def test_balanced_weights_do_not_depend_on_the_step_a_sample_lands_in(index, flop_cost, router, layout, budget):
    """Windows of several steps whose sample counts differ: every sample weighs 1/G (or its tokens / (G·S̄))."""
    config = PlanConfig(
        6, "balanced", layout, global_batch=40, memory_budget_tokens=151_200, window_samples_per_rank=40,
        step_budget=budget,
    )  # fmt: skip
    planner = Planner(index, A14B, config, flop_cost, router)
    assert planner.window_steps > 1
    mean_tokens = planner.facts.tokens[planner.bucket_of].mean()
    for step in range(planner.window_steps):
        plan = planner.plan(step)
        real = real_samples(plan)
        if budget == "samples":
            ref = sum(grad(sid, t) for sid, t in real) / 40
        else:
            ref = sum(t * grad(sid, t) for sid, t in real) / (40 * mean_tokens)
        got = sum(rank_gradient_packed(r) for r in plan.ranks)
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
