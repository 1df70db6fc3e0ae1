import json

import pytest

from wanloom_trainer.adaptiveload.plan import MicroBatch, RankPlan, StepPlan


def mb(ids, shape=(1, 8, 8), expert=0, weights=None, n=4):
    w = weights if weights is not None else tuple(1 / n for _ in ids)
    return MicroBatch(tuple(ids), shape, expert, tuple(100.0 + i for i in ids), w, tokens=16, predicted_cost=len(ids))


def plan(layout="per-rank"):
    r0 = RankPlan((mb([0, 1]), mb([2], expert=1)), 3.0)
    r1 = RankPlan((MicroBatch((), (1, 8, 8), 0, (), (), 16, 1.0), mb([3], expert=1)), 2.0)
    return StepPlan(7, (r0, r1), num_samples=4, layout=layout, policy="balanced")


def test_json_roundtrip():
    p = plan()
    p.validate()
    again = StepPlan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p
    assert again.tokens == 4 * 16
    assert again.ranks[1].micro_batches[0].is_dummy and again.ranks[1].micro_batches[0].rows == 1
    assert [r.num_samples for r in again.ranks] == [3, 1]


def test_validate_catches_layout_violations():
    bad_count = StepPlan(0, (RankPlan((mb([0]),), 1.0), RankPlan((), 0.0)), 1)
    with pytest.raises(ValueError, match="different numbers of micro-batches"):
        bad_count.validate()
    mixed = StepPlan(0, (RankPlan((mb([0], n=2),), 1.0), RankPlan((mb([1], expert=1, n=2),), 1.0)), 2)
    with pytest.raises(ValueError, match="mixes experts"):
        mixed.validate()
    with pytest.raises(ValueError, match="num_samples 5"):
        StepPlan(0, plan().ranks, 5).validate()
    spmd = StepPlan(
        0, (RankPlan((mb([0, 1]),), 2.0), RankPlan((mb([2, 3, 3], weights=(0.25, 0.25, 0.0)),), 3.0)), 4, "spmd"
    )
    with pytest.raises(ValueError, match="differs in shape or rows"):
        spmd.validate()


def test_micro_batch_checks_lengths_and_timesteps():
    with pytest.raises(ValueError, match="2 sample_ids but 1 timesteps"):
        MicroBatch((1, 2), (1, 8, 8), 0, (5.0,), (0.5, 0.5)).validate()
    with pytest.raises(ValueError, match=r"\[0, 1000\)"):
        MicroBatch((1,), (1, 8, 8), 0, (1000.0,), (1.0,)).validate()
    with pytest.raises(ValueError, match="expert"):
        MicroBatch((1,), (1, 8, 8), 2, (1.0,), (1.0,)).validate()
