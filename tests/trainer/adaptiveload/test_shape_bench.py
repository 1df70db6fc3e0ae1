import json

import numpy as np
import pytest

from wanloom_trainer.adaptiveload.cost.cost_model import TwoTermCost, predict
from wanloom_trainer.adaptiveload.cost.shape_bench import (
    bench_key,
    fit_points,
    load_points,
    run_shape_bench,
    save_points,
    shape_grid,
)
from wanloom_trainer.config.variants import get_variant

TINY = get_variant("tiny")
TRUE = TwoTermCost(a=0.01, alpha=2e-5, beta=3e-8)


class FakeDevice:
    """A step function and a clock: each step advances time by the true cost, plus a slow first call per shape."""

    def __init__(self):
        self.now, self.seen, self.calls = 0.0, set(), []

    def clock(self):
        return self.now

    def step(self, batch, shape):
        self.calls.append((batch, shape))
        cost = float(predict(TRUE, batch, TINY.tokens(*shape)))
        self.now += cost * (1 if (batch, shape) in self.seen else 50)  # warm-up (compilation) is slow
        self.seen.add((batch, shape))


def test_grid_respects_memory_and_spreads_shapes():
    shapes = [(1, 16, 16), (5, 16, 16), (9, 22, 40), (21, 22, 40), (21, 8, 8), (1, 8, 8)]
    grid = shape_grid(TINY, shapes, memory_budget_tokens=9_240, max_shapes=4, max_batches=3)
    assert all(b * TINY.tokens(*s) <= 9_240 for b, s in grid)
    tokens = sorted({TINY.tokens(*s) for _, s in grid})
    assert tokens[0] == 16 and tokens[-1] == 4_620 and len(tokens) == 4
    assert max(sum(1 for _, s in grid if s == shape) for _, shape in grid) <= 3


def test_benchmark_warms_up_and_takes_the_median():
    device = FakeDevice()
    grid = [(1, (1, 16, 16)), (2, (21, 22, 40))]
    points = run_shape_bench(device.step, grid, TINY, warmup=1, repeats=3, clock=device.clock)
    assert len(device.calls) == 2 * (1 + 3)
    for p, (b, s) in zip(points, grid, strict=True):
        assert p.seconds == pytest.approx(float(predict(TRUE, b, TINY.tokens(*s))))  # warm-up not timed
        assert len(p.runs) == 3 and p.tokens == TINY.tokens(*s)


def test_store_roundtrip_keeps_other_keys_and_fit_recovers_model(tmp_path):
    device = FakeDevice()
    shapes = [(1, 16, 16), (5, 16, 16), (9, 22, 40), (13, 22, 40), (21, 22, 40)]
    points = run_shape_bench(device.step, shape_grid(TINY, shapes, 9_240), TINY, repeats=1, clock=device.clock)
    path = tmp_path / "bench.json"
    save_points(path, bench_key("tiny", "cpu", "d1f1c1t1"), points)
    save_points(path, bench_key("tiny", "h200", "d1f8c1t1"), points[:3])
    assert load_points(path, "tiny|cpu|d1f1c1t1") == points
    assert len(load_points(path, "tiny|h200|d1f8c1t1")) == 3
    assert load_points(path, "tiny|tpu7x|x") is None
    assert load_points(tmp_path / "absent.json", "tiny|cpu|d1f1c1t1") is None
    fit = fit_points(load_points(path, "tiny|cpu|d1f1c1t1"), kind="two-term")
    s = np.array([16, 1_000, 4_620])
    np.testing.assert_allclose(fit.model.sample_cost(s), TRUE.sample_cost(s), rtol=1e-3)


def test_bad_files_and_keys(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 9, "entries": {}}))
    with pytest.raises(ValueError, match="not a version-1 shape benchmark"):
        load_points(bad, "a|b|c")
    bad.write_text("{")
    with pytest.raises(ValueError, match="cannot read shape benchmark"):
        load_points(bad, "a|b|c")
    with pytest.raises(ValueError, match="accelerator"):
        bench_key("tiny", "", "dp1")
