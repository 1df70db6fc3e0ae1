"""Learning-rate schedule per expert (shared by both backends)."""

from __future__ import annotations

import math

import pytest

from wanloom_api.trainingjob import OptimizerSpec
from wanloom_trainer.config.train_config import RoutingConfig
from wanloom_trainer.train.schedule import base_learning_rate, expert_lr_scales, learning_rates

OPT = OptimizerSpec.model_validate({"learningRate": 1e-3, "schedule": "cosine", "warmupSteps": 10})
ROUTING = RoutingConfig(0.875, "per-sample", "uniform", 0.0, 1.0, 1.0, "none")


def test_warmup_starts_above_zero_and_reaches_the_peak() -> None:
    assert base_learning_rate(OPT, 0, 100) == pytest.approx(1e-4)
    assert base_learning_rate(OPT, 9, 100) == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("schedule", "step", "expected"),
    [
        ("constant", 99, 1e-3),
        ("cosine", 10, 1e-3),
        ("cosine", 55, 0.5e-3),
        ("cosine", 99, 1e-3 * 0.5 * (1 + math.cos(math.pi * 89 / 90))),
        ("linear", 55, 0.5e-3),
        ("linear", 99, 1e-3 / 90),
    ],
)
def test_decay_shapes(schedule: str, step: int, expected: float) -> None:
    opt = OPT.model_copy(update={"schedule": schedule})
    assert base_learning_rate(opt, step, 100) == pytest.approx(expected)
    assert base_learning_rate(opt, step, 100) > 0


def test_per_expert_scaling_uses_the_expected_share() -> None:
    assert expert_lr_scales(OPT, ROUTING, 2) == (1.0, 1.0)
    scaled = expert_lr_scales(OPT.model_copy(update={"per_expert_lr_scaling": True}), ROUTING, 2)
    assert scaled == pytest.approx((0.125, 0.875))  # uniform t, boundary 875: 12.5% of samples are high-noise
    assert learning_rates(OPT, scaled, 50, 100)[0] == pytest.approx(0.125 * base_learning_rate(OPT, 50, 100))
    assert expert_lr_scales(OPT.model_copy(update={"per_expert_lr_scaling": True}), ROUTING, 1) == (1.0,)
