import numpy as np
import pytest

from wanloom_trainer.adaptiveload import metrics

GRID = np.array([[4.0, 1.0], [2.0, 1.0], [2.0, 3.0]])  # [R=3, K=2]


def test_cv_and_straggler():
    assert metrics.compute_load_cv(GRID) == pytest.approx(np.std([5, 3, 5]) / np.mean([5, 3, 5]))
    assert metrics.step_time_cv([2.0, 2.0, 2.0]) == 0.0
    assert metrics.straggler_overhead([1.0, 1.0, 2.0]) == pytest.approx(2 / (4 / 3) - 1)
    assert metrics.coefficient_of_variation([]) == 0.0


def test_step_times_under_both_sync_models():
    assert metrics.lockstep_time(GRID, overhead=0.5) == pytest.approx(4 + 3 + 2 * 0.5)
    assert metrics.slowest_rank_time(GRID, overhead=0.5) == pytest.approx(5 + 2 * 0.5)
    assert metrics.step_time(GRID, 0.0, "micro-batch") == 7.0
    assert metrics.step_time(GRID, 0.0, "step") == 5.0
    with pytest.raises(ValueError, match="sync"):
        metrics.step_time(GRID, 0.0, "never")


def test_idle_fraction():
    assert metrics.idle_fraction(GRID, 0.0, "step") == pytest.approx(1 - 13 / 15)
    assert metrics.idle_fraction(GRID, 0.0, "micro-batch") == pytest.approx(1 - 13 / 21)
    assert metrics.idle_fraction(np.ones((4, 3)), 0.1, "micro-batch") == pytest.approx(0.0)


def test_tokens_per_second():
    assert metrics.tokens_per_second(1000, 4.0) == 250.0
    with pytest.raises(ValueError, match="positive"):
        metrics.tokens_per_second(1, 0.0)
