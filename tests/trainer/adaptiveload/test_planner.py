import numpy as np
import pytest

from wanloom_trainer.adaptiveload.comparison.simulate import MixSpec, synthetic_index
from wanloom_trainer.adaptiveload.metrics import compute_load_cv, plan_cost_grid
from wanloom_trainer.adaptiveload.plan import StepPlan
from wanloom_trainer.adaptiveload.planner import PlanConfig, Planner, plan_step
from wanloom_trainer.adaptiveload.sizing.buckets import BucketTable
from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.routing import Router, TimestepSampler

from .conftest import A14B

M_MEM = 151_200
CASES = [
    (policy, layout, sync)
    for policy in ("balanced", "paper", "equal-tokens")
    for layout, sync in (("per-rank", "micro-batch"), ("per-rank", "step"), ("spmd", "micro-batch"))
]


def make(index, cost, router, policy, layout, sync="micro-batch", ranks=8, **kw):
    kw.setdefault("window_samples_per_rank", 32)  # windows of 4 steps: 256 of the index's 600 samples
    cfg = PlanConfig(ranks, policy, layout, global_batch=64, memory_budget_tokens=M_MEM, sync=sync, seed=11, **kw)
    return Planner(index, A14B, cfg, cost, router)


@pytest.mark.parametrize(("policy", "layout", "sync"), CASES, ids=["-".join(c) for c in CASES])
def test_plans_respect_the_contract(index, flop_cost, router, policy, layout, sync):
    planner = make(index, flop_cost, router, policy, layout, sync)
    ids = set(index.ids.tolist())
    window = []
    for step in range(4):
        plan = planner.plan(step)
        plan.validate()  # same micro-batch count, experts aligned per slot, spmd shapes/rows aligned
        assert plan.step == step and plan.layout == layout and plan.policy == policy
        mbs = [mb for r in plan.ranks for mb in r.micro_batches]
        real = [i for mb in mbs for i, w in zip(mb.sample_ids, mb.weights, strict=True) if w > 0]
        assert len(real) == len(set(real)) == plan.num_samples  # every sample once
        assert set(real) <= ids
        window.extend(real)
        for r in plan.ranks:
            for mb in r.micro_batches:
                assert mb.rows * mb.tokens <= M_MEM  # memory cap per micro-batch
                norm = 64 if policy == "balanced" else plan.num_samples  # balanced: 1/globalBatch per sample
                assert all(w in (0.0, 1 / norm) for w in mb.weights)
    if policy == "balanced":  # a window of W steps holds W·globalBatch samples, each once
        assert planner.window_steps == (1 if sync == "step" else 4)
        assert len(window) == len(set(window)) == 4 * 64


def test_plan_is_a_function_of_seed_and_step(index, flop_cost, router):
    a = make(index, flop_cost, router, "balanced", "per-rank")
    for step in range(6):
        a.plan(step)
    b = make(index, flop_cost, router, "balanced", "per-rank")
    assert a.plan(9).to_dict() == b.plan(9).to_dict()  # resumed at step 9 without replaying 0..8
    assert StepPlan.from_dict(a.plan(9).to_dict()) == b.plan(9)
    one_shot = plan_step(index, step=9, variant=A14B, config=a.config, cost_model=flop_cost, router=router)
    assert one_shot == b.plan(9)
    other = Planner(index, A14B, PlanConfig(8, global_batch=64, memory_budget_tokens=M_MEM, seed=12), flop_cost, router)
    assert other.plan(9) != b.plan(9)


def test_cost_grid_agrees_with_full_plan(index, flop_cost, router):
    planner = make(index, flop_cost, router, "balanced", "per-rank")
    np.testing.assert_allclose(planner.cost_grid(3), plan_cost_grid(planner.plan(3)))


def test_micro_batches_are_expert_and_shape_homogeneous(index, flop_cost, router):
    planner = make(index, flop_cost, router, "balanced", "per-rank")
    shape_of = dict(zip(index.ids.tolist(), map(tuple, index.latent_shapes.tolist()), strict=True))
    for mb in (mb for r in planner.plan(0).ranks for mb in r.micro_batches if not mb.is_dummy):
        assert {shape_of[i] for i in mb.sample_ids} == {mb.latent_shape}
        boundary = 875.0
        assert all((t >= boundary) == (mb.expert == 0) for t in mb.timesteps)


def test_configured_buckets_are_used(index, flop_cost, router):
    table = BucketTable.from_pixels(A14B, [(81, 480, 832), (33, 480, 832), (1, 480, 832)])
    planner = Planner(index, A14B, PlanConfig(4, global_batch=32, memory_budget_tokens=M_MEM), flop_cost, router, table)
    shapes = {mb.latent_shape for r in planner.plan(0).ranks for mb in r.micro_batches}
    assert shapes <= {tuple(s) for s in table.latent_shapes.tolist()}


@pytest.mark.parametrize(("policy", "layout"), [("balanced", "per-rank"), ("equal-tokens", "spmd")])
def test_sequence_split_samples_get_buckets_it_divides(index, flop_cost, router, policy, layout):
    """Micro-batches of whole samples split over 7 ranks: derived buckets are cut to a multiple of 7 tokens (the
    index's images and 9-frame clips are not), micro-batches use them, and configured buckets are never cut."""
    cfg = PlanConfig(4, policy, layout, global_batch=32, memory_budget_tokens=M_MEM, sequence_multiple=7)
    planner = Planner(index, A14B, cfg, flop_cost, router)
    assert (planner.buckets.tokens(A14B) % 7 == 0).all()
    shapes = {mb.latent_shape for r in planner.plan(0).ranks for mb in r.micro_batches}
    assert shapes <= {tuple(s) for s in planner.buckets.latent_shapes.tolist()}
    table = BucketTable.from_pixels(A14B, [(81, 480, 832), (1, 480, 832)])
    with pytest.raises(ValueError, match=r"spec\.adaptiveLoad\.buckets: .* which context x tensor = 7"):
        Planner(index, A14B, cfg, flop_cost, router, table)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="globalBatch"):
        PlanConfig(4, "balanced")
    with pytest.raises(ValueError, match=r"adaptiveLoad\.scheduler 'fast'"):
        PlanConfig(4, "fast", global_batch=4)
    with pytest.raises(ValueError, match="layout"):
        PlanConfig(4, layout="mesh", global_batch=4)
    with pytest.raises(ValueError, match="sync"):
        PlanConfig(4, sync="never", global_batch=4)


def test_memory_budget_too_small_is_reported(index, flop_cost, router):
    with pytest.raises(ValueError, match="memoryBudgetTokens=40000"):
        Planner(index, A14B, PlanConfig(4, global_batch=8, memory_budget_tokens=40_000), flop_cost, router)


# A distribution no other test or the benchmark uses: the TI2V-5B model (16x VAE, 24 fps, 121-frame window),
# image-heavy, longer clips, more 720p.
HELD_OUT = MixSpec(
    image_share=0.45,
    clip_720p_share=0.6,
    duration_mean_s=6.0,
    duration_log_sigma=0.8,
    fps=24,
    frame_buckets=(25, 49, 73, 97, 121),
    clip_aspects=(0.7, 0.2, 0.1),
)


@pytest.mark.parametrize("sync", ["micro-batch", "step"])
def test_balanced_beats_paper_beats_equal_tokens_on_held_out_mix(sync):
    from wanloom_trainer.adaptiveload.cost.cost_model import FlopCost

    ti2v = get_variant("wan2.2-ti2v-5b")
    index = synthetic_index(ti2v, 5_000, seed=4, mix=HELD_OUT)
    cost = FlopCost(ti2v.name, 4e14, a=0.02)
    router = Router(TimestepSampler(), None)
    s_max = int(max(ti2v.tokens(*s) for s in index.latent_shapes))
    cv = {}
    for policy in ("balanced", "paper", "equal-tokens"):
        cfg = PlanConfig(16, policy, "per-rank", global_batch=256, memory_budget_tokens=2 * s_max, sync=sync)
        planner = Planner(index, ti2v, cfg, cost, router)
        cv[policy] = float(np.mean([compute_load_cv(planner.cost_grid(s)) for s in range(12)]))
    assert cv["balanced"] < cv["paper"] < cv["equal-tokens"]
    assert cv["balanced"] < 0.05


def test_balanced_cv_per_step(index, flop_cost, router):
    planner = make(index, flop_cost, router, "balanced", "per-rank", sync="step")
    assert max(compute_load_cv(planner.cost_grid(s)) for s in range(5)) < 0.05


@pytest.mark.parametrize("layout", ["per-rank", "spmd"])
def test_local_plan_is_the_full_plan_seen_from_some_ranks(index, flop_cost, router, layout):
    planner = make(index, flop_cost, router, "balanced", layout)
    full = planner.plan(5)
    local = planner.plan_local(5, [1, 6])
    assert local.ranks == {1: full.ranks[1], 6: full.ranks[6]}
    assert (local.step, local.num_samples, local.tokens) == (full.step, full.num_samples, full.tokens)
    assert local.expert_samples == full.expert_samples and local.token_counts == full.token_counts
    np.testing.assert_allclose(local.rank_costs, full.rank_costs)
    with pytest.raises(ValueError, match=r"ranks \[8\] are outside \[0, 8\)"):
        planner.plan_local(5, [8])


@pytest.mark.parametrize(("policy", "layout"), [("balanced", "per-rank"), ("balanced", "spmd"), ("paper", "spmd")])
def test_slot_work_is_the_heaviest_cell_of_each_slot(index, flop_cost, router, policy, layout):
    """What a slot's measured time is fitted against: the predicted-heaviest micro-batch's samples (padding rows,
    padding tokens and dummies included), whose cost is the slot's largest predicted cost."""
    planner = make(index, flop_cost, router, policy, layout)
    full = planner.plan(3)
    local = planner.plan_local(3, [0])
    assert len(local.slot_work) == len(full.ranks[0].micro_batches)
    for k, work in enumerate(local.slot_work):
        heaviest = max(r.micro_batches[k].predicted_cost for r in full.ranks)
        assert float(np.sum(flop_cost.sample_cost(np.array(work)))) == pytest.approx(heaviest, rel=1e-9)
        assert all(t > 0 for t in work)


def test_a_new_cost_model_keeps_samples_and_changes_the_balance(index, flop_cost, router):
    """An online refit swaps the cost model: the same samples, routed alike, are planned with the new costs."""
    from wanloom_trainer.adaptiveload.cost.cost_model import TwoTermCost

    planner = make(index, flop_cost, router, "balanced", "per-rank")
    linear = planner.with_cost_model(TwoTermCost(a=0.0, alpha=1.0, beta=0.0))
    before, after = planner.plan(4), linear.plan(4)
    ids = lambda plans: sorted(i for p in plans for r in p.ranks for mb in r.micro_batches for i in mb.sample_ids)
    window = range(4, 8)  # the second window: its samples, whatever steps the costs deal them to
    assert ids(planner.plan(s) for s in window) == ids(linear.plan(s) for s in window)
    assert before.to_dict() != after.to_dict()  # token-linear costs balance long clips differently
    assert planner.plan(4).to_dict() == before.to_dict()  # the original planner is untouched
    assert linear.cost_model.kind == "two-term" and planner.cost_model is flop_cost


def test_a_cost_model_with_invalid_costs_is_refused(index, router):
    from wanloom_trainer.adaptiveload.cost.cost_model import PowerCost

    with pytest.raises(ValueError, match=r"predicts an invalid cost for bucket .* refit it"):
        make(index, PowerCost(a=0.0, b=float("nan"), p=1.5), router, "balanced", "per-rank")
    with pytest.raises(ValueError, match="per-call overhead"):
        make(index, PowerCost(a=-1.0, b=1.0, p=1.5), router, "balanced", "per-rank")
