"""The online refit: fits on mixed-length work, the analytic yardstick, the verdicts, and the broadcast encoding."""

from __future__ import annotations

import numpy as np
import pytest

from wanloom_trainer.adaptiveload.cost.cost_model import FlopCost, PowerCost, Timings, TwoTermCost, fit_timings
from wanloom_trainer.adaptiveload.cost.refit import (
    MIN_MEASUREMENTS,
    OnlineRefit,
    decode_model,
    degenerate,
    encode_model,
    scale_free_error,
)

VARIANT = "wan2.2-t2v-a14b"
LENGTHS = np.array([1560, 4680, 9360, 18900, 32760])


def _work(seed: int, n: int) -> list[np.ndarray]:
    """Slots of 1-4 samples of mixed lengths, like packed rows or lockstep cells."""
    rng = np.random.default_rng(seed)
    return [rng.choice(LENGTHS, size=rng.integers(1, 5)) for _ in range(n)]


def _seconds(model, work: list[np.ndarray], noise: float = 0.0, seed: int = 1) -> np.ndarray:
    exact = np.array([model.overhead + model.sample_cost(w).sum() for w in work])
    return exact * np.random.default_rng(seed).lognormal(0.0, noise, len(work)) if noise else exact


def _refit(model, n: int = 200, noise: float = 0.0) -> OnlineRefit:
    refit = OnlineRefit(VARIANT)
    work = _work(0, n)
    refit.add(work, _seconds(model, work, noise))
    return refit


def test_mixed_length_work_recovers_the_two_term_model() -> None:
    true = TwoTermCost(a=0.05, alpha=2e-5, beta=3e-10)
    work = _work(0, 60)
    fit = fit_timings(Timings.of_work(work, _seconds(true, work)), kind="two-term")
    for name in ("a", "alpha", "beta"):
        assert getattr(fit.model, name) == pytest.approx(getattr(true, name), rel=1e-5)
    assert fit.quality["two-term"].heldout_rmse_rel < 1e-6


def test_micro_batch_points_and_their_work_lists_fit_alike() -> None:
    """(B, S, t) points are the special case of work lists holding B copies of S."""
    b, s = np.array([1, 2, 4, 1, 2, 4, 1, 2]), np.array([1560, 1560, 1560, 9360, 9360, 9360, 32760, 32760])
    t = _seconds(TwoTermCost(0.01, 1e-5, 2e-10), [np.full(n, x) for n, x in zip(b, s, strict=True)], noise=0.02)
    points = fit_timings(Timings.of_micro_batches(b, s, t), kind="power").model
    lists = fit_timings(Timings.of_work([[x] * n for n, x in zip(b, s, strict=True)], t), kind="power").model
    for name in ("a", "b", "p"):
        assert getattr(lists, name) == pytest.approx(getattr(points, name), rel=1e-6)


def test_a_fit_that_beats_the_analytic_model_is_accepted() -> None:
    # Attention far costlier per FLOP than the matmuls (an unfused kernel): FLOP counting mispredicts the ratio.
    true = TwoTermCost(a=0.05, alpha=2e-5, beta=3e-9)
    outcome = _refit(true, noise=0.03).refit(FlopCost(VARIANT, 1e15))
    assert outcome.verdict == "accepted", outcome.message
    assert outcome.heldout_error < 0.98 * outcome.analytic_heldout_error
    assert outcome.model.kind == "two-term" and outcome.model.beta == pytest.approx(true.beta, rel=0.1)
    assert "cost refit accepted: two-term fit of 200 slot timings" in outcome.message


def test_when_no_family_beats_the_analytic_model_its_refit_is_accepted_if_it_passes_the_checks() -> None:
    """Timings that follow the FLOP count exactly: no family beats it; planning moves to the analytic model with the
    measured overhead and rate, which beats the model in use (the nominal rate without an overhead)."""
    true = FlopCost(VARIANT, 4.2e14, a=0.2)
    outcome = _refit(true).refit(FlopCost(VARIANT, 1e15))
    assert outcome.verdict == "accepted"
    assert outcome.analytic_heldout_error < 1e-6 < outcome.heldout_error
    assert isinstance(outcome.model, FlopCost)
    assert outcome.model.flops_per_second == pytest.approx(true.flops_per_second, rel=1e-6)
    assert outcome.model.a == pytest.approx(true.a, rel=1e-6)
    assert "accepted the analytic FLOP model refitted" in outcome.message


@pytest.mark.parametrize("kind", ["noise", "constant"])
def test_timings_that_say_nothing_about_shapes_keep_the_model_in_use(kind) -> None:
    """Pure noise or constant slot times: every fit is all overhead; none may replace the model (the audit saw a
    refitted 1e30 FLOP/s with a 4.1 s overhead adopted from noise, and b ≈ 1e-20 accepted from constants)."""
    work = _work(0, 200)
    rng = np.random.default_rng(3)
    seconds = rng.uniform(0.05, 8.0, len(work)) if kind == "noise" else np.full(len(work), 4.0)
    refit = OnlineRefit(VARIANT)
    refit.add(work, seconds)
    outcome = refit.refit(FlopCost(VARIANT, 1e15, a=0.05))
    assert outcome.model is None and outcome.verdict in ("rejected", "kept"), outcome.message


def test_degenerate_models_are_named() -> None:
    timings = _refit(TwoTermCost(0.05, 2e-5, 3e-10), noise=0.03).timings()
    assert degenerate(TwoTermCost(0.05, 2e-5, 3e-10), timings) is None
    assert "ranks every shape alike" in degenerate(TwoTermCost(0.05, 1e-20, 0.0), timings)
    assert "overhead" in degenerate(TwoTermCost(100.0, 2e-5, 3e-10), timings)
    assert "non-finite" in degenerate(PowerCost(0.0, float("inf"), 1.0), timings)


def test_a_rejected_fit_keeps_the_model_in_use_when_the_analytic_refit_is_no_better() -> None:
    true = FlopCost(VARIANT, 4.2e14, a=0.2)
    outcome = _refit(true).refit(true)
    assert outcome.verdict == "rejected" and outcome.model is None


def test_a_fit_no_better_than_the_model_in_use_changes_nothing() -> None:
    true = TwoTermCost(a=0.05, alpha=2e-5, beta=3e-9)
    outcome = _refit(true, noise=0.03).refit(true)
    assert outcome.verdict == "kept" and outcome.model is None


def test_the_model_in_use_is_judged_up_to_scale() -> None:
    """Planning needs only ratios: a model in S^p units with the right shape has no error."""
    true = PowerCost(a=0.0, b=3e-9, p=1.7)
    timings = _refit(true).timings()
    assert scale_free_error(PowerCost(0.0, 1.0, 1.7), timings) < 1e-12
    assert scale_free_error(PowerCost(0.0, 1.0, 1.0), timings) > 0.1


def test_too_few_timings_wait() -> None:
    refit = OnlineRefit(VARIANT)
    work = _work(0, MIN_MEASUREMENTS - 1)
    refit.add(work, _seconds(TwoTermCost(0.05, 2e-5, 3e-10), work))
    outcome = refit.refit(FlopCost(VARIANT, 1e15))
    assert outcome.verdict is None and outcome.model is None and outcome.heldout_error is None
    assert f"waits for >= {MIN_MEASUREMENTS} slot timings" in outcome.message


def test_the_window_keeps_the_latest_timings_and_drops_non_finite_and_non_positive_ones() -> None:
    refit = OnlineRefit(VARIANT, window=4)
    refit.add([[1560], [4680], [9360]], [0.1, 0.0, 0.3])
    assert len(refit) == 2 and refit.dropped == 1
    refit.add([[1560], [4680], [9360]], [float("inf"), float("nan"), -1.0])
    assert len(refit) == 2 and refit.dropped == 4
    refit.add([[18900], [32760], [1560]], [0.4, 0.5, 0.6])
    assert refit.timings().seconds.tolist() == [0.3, 0.4, 0.5, 0.6]
    with pytest.raises(ValueError, match="2 slots planned but 1 timed"):
        refit.add([[1], [2]], [0.1])


@pytest.mark.parametrize(
    "model", [PowerCost(0.1, 2e-9, 1.6), TwoTermCost(0.05, 2e-5, 3e-10), FlopCost(VARIANT, 4.2e14, a=0.2)]
)
def test_models_cross_the_broadcast_unchanged(model) -> None:
    assert decode_model(encode_model(model), VARIANT) == model
    assert decode_model(encode_model(None), VARIANT) is None
