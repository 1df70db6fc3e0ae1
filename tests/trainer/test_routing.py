"""Joint timestep routing, statistically: over 10,000 draws per configuration and mode, the fraction of samples per
expert and the distribution of t match the configured sampler, and each expert sees exactly its own band.

The reference distribution is sampled independently of ``TimestepSampler`` (numpy normals through a sigmoid, then
the shift), so a wrong inverse CDF in routing cannot hide behind itself. The expert that gets no samples in a step
keeping its parameters and optimizer state is tested with the JAX backend (tests/trainer/train/test_backend_jax.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from wanloom_trainer.routing import HIGH_NOISE, LOW_NOISE, Router, TimestepSampler, loss_weights

DRAWS = 10_000
BOUNDARY = 0.875
P_VALUE = 1e-3  # fixed seeds: deterministic, and a 1-in-1000 false alarm would not be reproducible anyway

SAMPLERS = {
    "uniform": TimestepSampler("uniform"),
    "uniform-shift3": TimestepSampler("uniform", shift=3.0),
    "logit-normal": TimestepSampler("logit-normal"),
    "logit-normal-shifted": TimestepSampler("logit-normal", shift=2.0, logit_mean=0.3, logit_std=1.2),
}


def reference_timesteps(sampler: TimestepSampler, n: int, seed: int = 12345) -> np.ndarray:
    """t straight from the definition: σ = shift(G), G ~ U(0,1) or sigmoid(N(mean, std))."""
    rng = np.random.default_rng(seed)
    if sampler.kind == "uniform":
        base = rng.random(n)
    else:
        base = 1.0 / (1.0 + np.exp(-(sampler.logit_mean + sampler.logit_std * rng.standard_normal(n))))
    s = sampler.shift
    return 1000.0 * s * base / (1.0 + (s - 1.0) * base)


def high_share(sampler: TimestepSampler) -> float:
    return float(np.mean(reference_timesteps(sampler, 400_000, seed=7) >= BOUNDARY * 1000))


def draws(router: Router, steps: int, per_step: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    ts, es = [], []
    for step in range(steps):
        d = router.draw(seed, step, per_step)
        ts.append(d.timesteps)
        es.append(d.experts)
    return np.concatenate(ts), np.concatenate(es)


@pytest.mark.parametrize("mode", ["per-sample", "per-batch"])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_timestep_distribution_matches_the_configured_one(name: str, mode: str) -> None:
    sampler = SAMPLERS[name]
    t, _ = draws(Router(sampler, BOUNDARY, mode), DRAWS, 1)
    assert t.dtype == np.float32
    assert ((t >= 0) & (t < 1000)).all()
    result = stats.ks_2samp(t, reference_timesteps(sampler, 200_000))
    assert result.pvalue > P_VALUE, f"{name}/{mode}: KS {result.statistic:.4f}, p={result.pvalue:.2e}"


@pytest.mark.parametrize("mode", ["per-sample", "per-batch"])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_expert_fraction_matches_the_mass_above_the_boundary(name: str, mode: str) -> None:
    sampler = SAMPLERS[name]
    router = Router(sampler, BOUNDARY, mode)
    _, experts = draws(router, DRAWS, 1)
    p = high_share(sampler)
    observed = float(np.mean(experts == HIGH_NOISE))
    sigma = np.sqrt(p * (1 - p) / DRAWS)
    assert abs(observed - p) < 4.5 * sigma + 1e-3, f"{name}/{mode}: high share {observed:.4f}, expected {p:.4f}"
    assert router.high_noise_share == pytest.approx(p, abs=3e-3)


@pytest.mark.parametrize("mode", ["per-sample", "per-batch"])
@pytest.mark.parametrize("name", ["uniform", "logit-normal-shifted"])
def test_each_expert_sees_exactly_its_band_with_the_restricted_distribution(name: str, mode: str) -> None:
    sampler = SAMPLERS[name]
    t, experts = draws(Router(sampler, BOUNDARY, mode), DRAWS // 8, 8)
    boundary = BOUNDARY * 1000
    assert (t[experts == HIGH_NOISE] >= boundary).all()
    assert (t[experts == LOW_NOISE] < boundary).all()
    assert set(np.unique(experts)) == {HIGH_NOISE, LOW_NOISE}
    ref = reference_timesteps(sampler, 400_000)
    for expert, band in ((HIGH_NOISE, ref >= boundary), (LOW_NOISE, ref < boundary)):
        mine = t[experts == expert]
        if len(mine) < 50:
            continue
        result = stats.ks_2samp(mine, ref[band])
        assert result.pvalue > P_VALUE, f"{name}/{mode} expert {expert}: KS p={result.pvalue:.2e}"


def test_per_batch_mode_gives_each_step_one_expert_and_per_sample_mixes_them() -> None:
    sampler = SAMPLERS["uniform"]
    per_batch = [Router(sampler, BOUNDARY, "per-batch").draw(0, s, 16).experts for s in range(300)]
    assert all(len(set(e.tolist())) == 1 for e in per_batch)
    per_sample = [Router(sampler, BOUNDARY, "per-sample").draw(0, s, 16).experts for s in range(300)]
    assert sum(len(set(e.tolist())) == 2 for e in per_sample) > 100


def test_draws_are_a_pure_function_of_seed_and_step() -> None:
    router = Router(SAMPLERS["logit-normal"], BOUNDARY, "per-sample")
    a, b = router.draw(5, 17, 32), router.draw(5, 17, 32)
    np.testing.assert_array_equal(a.timesteps, b.timesteps)
    assert not np.array_equal(a.timesteps, router.draw(5, 18, 32).timesteps)


@pytest.mark.parametrize("scheme", ["none", "bell"])
def test_loss_weights_are_normalised_over_the_grid_and_finite_at_batch_one(scheme: str) -> None:
    grid = np.arange(1000, dtype=np.float32) + 0.5
    assert float(np.mean(loss_weights(grid, scheme))) == pytest.approx(1.0, abs=1e-4)
    single = loss_weights(np.array([999.5], np.float32), scheme)
    assert single.shape == (1,) and np.isfinite(single).all() and single[0] > 0


@pytest.mark.parametrize("mode", ["per-sample", "per-batch"])
@pytest.mark.parametrize("only", [HIGH_NOISE, LOW_NOISE])
def test_routing_to_one_expert_draws_the_configured_distribution_within_its_band(only: int, mode: str) -> None:
    """LoRA on one expert: every sample goes to it, its timesteps distributed as the configured ones in its band."""
    sampler = SAMPLERS["logit-normal-shifted"]
    router = Router(sampler, BOUNDARY, mode, only=only)
    t, experts = draws(router, DRAWS // 8, 8)
    assert (experts == only).all()
    assert router.high_noise_share == (1.0 if only == HIGH_NOISE else 0.0)
    ref = reference_timesteps(sampler, 400_000)
    band = ref >= BOUNDARY * 1000 if only == HIGH_NOISE else ref < BOUNDARY * 1000
    assert (t >= BOUNDARY * 1000).all() if only == HIGH_NOISE else (t < BOUNDARY * 1000).all()
    result = stats.ks_2samp(t, ref[band])
    assert result.pvalue > P_VALUE, f"only {only}/{mode}: KS p={result.pvalue:.2e}"
    with pytest.raises(ValueError, match="needs two experts"):
        Router(sampler, None, mode, only=only)
