import numpy as np
import pytest

from wanloom_trainer.adaptiveload.cost.cost_model import (
    FlopCost,
    PowerCost,
    TwoTermCost,
    cost_model_from_dict,
    effective_exponent,
    fit_cost_model,
    predict,
)
from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.flops import train_flops_per_sample


def grid(max_tokens=150_000):
    pts = [(b, s) for b in (1, 2, 4, 8) for s in (1_500, 3_600, 8_000, 18_000, 32_760, 75_600) if b * s <= max_tokens]
    return np.array([p[0] for p in pts]), np.array([p[1] for p in pts])


def noisy(model, b, s, noise=0.02, seed=0):
    rng = np.random.default_rng(seed)
    return predict(model, b, s) * (1 + noise * rng.standard_normal(len(b)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_power_fit_recovers_known_parameters(seed):
    true = PowerCost(a=0.4, b=2e-8, p=1.7)
    b, s = grid()
    fit = fit_cost_model(b, s, noisy(true, b, s, seed=seed), kind="power")
    got = fit.model
    assert got.p == pytest.approx(true.p, abs=0.05)
    assert got.a == pytest.approx(true.a, rel=0.25)
    # b and p trade off; compare the per-sample cost where it matters instead of b alone
    np.testing.assert_allclose(got.sample_cost(s), true.sample_cost(s), rtol=0.06)
    assert fit.quality["power"].r2 > 0.99


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_term_fit_recovers_known_parameters(seed):
    true = TwoTermCost(a=0.3, alpha=4e-5, beta=1.5e-9)
    b, s = grid()
    fit = fit_cost_model(b, s, noisy(true, b, s, seed=seed), kind="two-term")
    assert fit.model.alpha == pytest.approx(true.alpha, rel=0.1)
    assert fit.model.beta == pytest.approx(true.beta, rel=0.1)
    assert fit.model.a == pytest.approx(true.a, rel=0.3)


@pytest.mark.parametrize(
    ("true", "expected"),
    [(TwoTermCost(0.3, 4e-5, 1.5e-9), "two-term"), (PowerCost(0.4, 2e-8, 1.7), "power")],
    ids=["two-term-data", "power-data"],
)
def test_auto_picks_the_generating_family_by_held_out_error(true, expected):
    b, s = grid()
    fit = fit_cost_model(b, s, noisy(true, b, s, noise=0.01), kind="auto")
    assert fit.model.kind == expected
    q = fit.quality
    assert q[expected].heldout_rmse_rel == min(x.heldout_rmse_rel for x in q.values())
    assert "held-out" in fit.summary()


def test_fit_rejects_too_few_points_and_bad_kind():
    with pytest.raises(ValueError, match=">= 6 timings over >= 3"):
        fit_cost_model([1, 2, 1, 2], [10, 10, 20, 20], [1, 2, 3, 4])
    b, s = grid()
    with pytest.raises(ValueError, match="not one of auto"):
        fit_cost_model(b, s, np.ones(len(b)), kind="cubic")
    with pytest.raises(ValueError, match="positive"):
        fit_cost_model(b, s, -np.ones(len(b)))


def test_flop_cost_matches_flop_count():
    v = get_variant("wan2.2-t2v-a14b")
    model = FlopCost(v.name, flops_per_second=1e15, a=0.1)
    assert model.sample_cost(np.array([75_600]))[0] == pytest.approx(train_flops_per_sample(v, 75_600) / 1e15)
    assert predict(model, 2, 75_600) == pytest.approx(0.1 + 2 * train_flops_per_sample(v, 75_600) / 1e15)


def test_effective_exponent_drifts_between_regimes():
    model = FlopCost("wan2.2-t2v-a14b", 1e15)
    low = effective_exponent(model, np.array([500, 1_000, 2_000]))
    high = effective_exponent(model, np.array([100_000, 200_000, 400_000]))
    assert 0.9 < low < 1.15 < 1.6 < high < 2.0
    assert effective_exponent(PowerCost(0, 1, 1.3), np.array([1, 2])) == 1.3


@pytest.mark.parametrize(
    "model", [PowerCost(0.1, 2e-8, 1.7), TwoTermCost(0.1, 1e-5, 1e-9), FlopCost("tiny", 1e9, 0.01)]
)
def test_dict_roundtrip(model):
    assert cost_model_from_dict(model.to_dict()) == model


def test_unknown_kind_and_variant():
    with pytest.raises(ValueError, match="kind"):
        cost_model_from_dict({"kind": "cubic"})
    with pytest.raises(ValueError, match="unknown model variant"):
        FlopCost("wan9", 1e12)
