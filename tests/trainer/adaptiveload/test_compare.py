"""The comparison with the bucket sampler: one sample stream for every policy, each sampler as the trainers that use
it run it, and the GPU targets on a mix the planner was not tuned on."""

import numpy as np
import pytest

from wanloom_trainer.adaptiveload.comparison.compare import (
    BASELINE,
    STEADY,
    balanced,
    compare,
    sampler,
    sampler_batch_sizes,
)
from wanloom_trainer.adaptiveload.comparison.simulate import MixSpec, synthetic_index
from wanloom_trainer.adaptiveload.cost.cost_model import FlopCost
from wanloom_trainer.adaptiveload.planner import PlanConfig, Planner

from .conftest import A14B

HELD_OUT = MixSpec(image_share=0.45, clip_720p_share=0.6, duration_mean_s=5.0, duration_log_sigma=0.8)


def _planner(index, cost, router, layout, ranks=16, per_rank=16, memory=151_200, **kw):
    config = PlanConfig(ranks, "balanced", layout, global_batch=per_rank * ranks, memory_budget_tokens=memory, **kw)
    return Planner(index, A14B, config, cost, router)


@pytest.fixture(scope="module")
def held_out():
    return synthetic_index(A14B, 20_000, seed=7, mix=HELD_OUT)


@pytest.mark.parametrize("layout", ["per-rank", "spmd"])
def test_every_policy_consumes_the_same_stream(held_out, flop_cost, router, layout):
    planner = _planner(held_out, flop_cost, router, layout, memory=151_200 if layout == "per-rank" else 75_600)
    steps = 2 * planner.window_steps
    _, bucket, expert = balanced(planner, steps)
    assert len(bucket) == steps * 256  # the balanced planner's samples: globalBatch per step over its windows
    tokens = int(planner.facts.tokens[bucket].sum())
    results = compare(planner, steps, steady=True)
    assert results["balanced"].tokens == tokens
    # The global per-bucket sampler in its steady state: every sample, no idle, no padding, only call overheads.
    steady = results.pop(STEADY)
    assert steady == sampler(planner, BASELINE, bucket, expert, steady_state=True)
    assert steady.tokens == tokens and steady.padding_fraction == 0.0 and steady.idle_fraction == 0.0
    assert results["balanced"].useful_time == pytest.approx(steady.useful_time, rel=1e-9)
    assert steady.useful_time < steady.time < 1.01 * steady.useful_time  # its ceiling: the call overheads
    assert steady.time < results["balanced"].time  # a plan with idle ranks does not reach it
    if layout == "spmd":  # one program over all devices: every sample runs, short chunks padded
        assert results[BASELINE].tokens == results["paper"].tokens == tokens
        assert steady.time < results[BASELINE].time  # the padded chunks cost time, the pro-rata ones do not
    else:  # per-rank draws: only the stream's tail, where a rank finds its expert's queues empty, is left out
        assert 0.9 * tokens < results[BASELINE].tokens <= tokens
    assert results[BASELINE].to_json(results[BASELINE])["throughput_vs_baseline"] == 1.0


def test_the_sampler_fills_micro_batches_from_one_bucket(held_out, flop_cost, router):
    planner = _planner(held_out, flop_cost, router, "per-rank")
    tokens = np.minimum(planner.facts.tokens, 151_200)
    np.testing.assert_array_equal(sampler_batch_sizes(planner, BASELINE), np.maximum(1, 151_200 // tokens))
    assert (sampler_batch_sizes(planner, "paper") <= sampler_batch_sizes(planner, BASELINE)).all()
    with pytest.raises(ValueError, match="not a sampler policy"):
        sampler_batch_sizes(planner, "balanced")


def test_ratios_do_not_depend_on_the_cost_models_rate(held_out, router):
    slow = compare(_planner(held_out, FlopCost(A14B.name, 4e14, a=0.05), router, "per-rank"), 16)
    fast = compare(_planner(held_out, FlopCost(A14B.name, 8e14, a=0.025), router, "per-rank"), 16)
    for policy in slow:
        assert fast[policy].time == pytest.approx(slow[policy].time / 2, rel=1e-9)


@pytest.mark.parametrize("per_rank", [4, 16])
def test_balanced_lockstep_beats_the_bucket_sampler_on_a_held_out_mix(held_out, flop_cost, router, per_rank):
    """The issue's GPU targets: ≥ 1.27× the bucket sampler at load CV ≤ 3%, and never below 1.0×."""
    planner = _planner(held_out, flop_cost, router, "per-rank", per_rank=per_rank)
    results = compare(planner, 1024 // per_rank)
    balanced, baseline = results["balanced"], results[BASELINE]
    assert balanced.tokens_per_second >= 1.27 * baseline.tokens_per_second
    assert balanced.load_cv <= 0.03 < baseline.load_cv


def test_compare_needs_the_balanced_planner(held_out, flop_cost, router):
    config = PlanConfig(16, "paper", global_batch=256, memory_budget_tokens=151_200)
    with pytest.raises(ValueError, match="needs the balanced planner"):
        compare(Planner(held_out, A14B, config, flop_cost, router), 4)
