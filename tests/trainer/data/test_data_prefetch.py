"""The loader follows the step plan: prefetch ahead, exact rows, and resume mid-epoch without a trace."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from wanloom_trainer.adaptiveload.cost.cost_model import PowerCost
from wanloom_trainer.adaptiveload.plan import MicroBatch, RankPlan, StepPlan
from wanloom_trainer.adaptiveload.planner import PlanConfig, Planner
from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.data.prefetch import PlanPrefetcher, default_workers
from wanloom_trainer.data.reader import open_dataset
from wanloom_trainer.data.skips import TooManyBadSamples
from wanloom_trainer.data.synthetic import write_synthetic
from wanloom_trainer.routing import Router, TimestepSampler

TINY = get_variant("tiny")


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    # 20 samples, global batch 6: an epoch ends inside step 3, so steps 0..9 cross three epochs.
    write_synthetic(str(tmp_path / "ds"), TINY, 20, seed=5, samples_per_shard=7)
    return tmp_path / "ds"


def _planner(shapes, layout: str = "per-rank") -> Planner:  # type: ignore[no-untyped-def]
    router = Router(TimestepSampler("uniform"), boundary_ratio=0.875)
    config = PlanConfig(num_ranks=2, layout=layout, global_batch=6, memory_budget_tokens=96, seed=11)
    return Planner(shapes, TINY, config, PowerCost(a=0.01, b=1.0, p=1.5), router)


def _record(step) -> list[tuple]:  # type: ignore[no-untyped-def]
    out = []
    for mb in step:
        batches = mb.batch if mb.packed else (mb.batch,)
        digest = hashlib.sha1(b"".join(b.latents.tobytes() + b.text_embeds.tobytes() for b in batches)).hexdigest()
        ids = [i for b in batches for i in b.sample_ids.tolist()]
        out.append((mb.step, mb.index, ids, digest, mb.timesteps.tolist(), mb.weights.tolist()))
    return out


def _run(root: Path, rank: int, start: int, stop: int, state: dict | None = None, layout: str = "per-rank"):  # type: ignore[no-untyped-def]
    with open_dataset(str(root), max_bad_samples=50) as ds:
        planner = _planner(ds.sample_shapes(), layout)
        with PlanPrefetcher(ds, (planner.plan(s) for s in range(start, stop)), rank=rank, depth=3) as pf:
            if state is not None:
                pf.load_state_dict(state)
            records = [_record(step) for step in pf]
            return records, pf.state_dict()


@pytest.mark.parametrize("layout", ["per-rank", "spmd"])
def test_resume_mid_epoch_sees_exactly_what_an_uninterrupted_run_sees(dataset: Path, layout: str) -> None:
    for rank in (0, 1):
        full, _ = _run(dataset, rank, 0, 10, layout=layout)
        first, state = _run(dataset, rank, 0, 4, layout=layout)
        assert state["next_step"] == 4
        rest, end = _run(dataset, rank, 4, 10, state=state, layout=layout)
        assert first + rest == full
        assert end["next_step"] == 10
        assert any(row for step in full for (_, _, row, *_) in step)  # the rank got real rows


def test_rows_follow_the_plan(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=0) as ds:
        planner = _planner(ds.sample_shapes())
        plan = planner.plan(2)
        with PlanPrefetcher(ds, [plan], rank=1, depth=2) as pf:
            steps = list(pf)
            assert len(steps) == 1 and steps[0].step == 2
            loaded = list(steps[0])
        for got, mb in zip(loaded, plan.ranks[1].micro_batches, strict=True):
            assert got.micro_batch is mb and got.expert == mb.expert
            assert got.batch.latents.shape[2:] == tuple(mb.latent_shape)
            if not mb.sample_ids:  # a dummy micro-batch: one placeholder row that weighs nothing
                assert got.batch.sample_ids.tolist() == [-1] and got.weights.tolist() == [0.0]
                continue
            assert got.batch.sample_ids.tolist() == list(mb.sample_ids)
            np.testing.assert_array_equal(got.timesteps, np.asarray(mb.timesteps, np.float32))
            np.testing.assert_array_equal(got.weights, np.asarray(mb.weights, np.float32))


def test_packed_micro_batches_load_each_sample_at_its_own_shape(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=0) as ds:
        planner = _planner(ds.sample_shapes(), "spmd")
        # The first step of the planning window whose rank-0 rows hold samples of several shapes.
        plan = next(
            p for p in map(planner.plan, range(planner.window_steps))
            if len({s for mb in p.ranks[0].micro_batches if mb.packed for s in mb.packed.sample_shapes}) > 1
        )  # fmt: skip
        with PlanPrefetcher(ds, [plan], rank=0, depth=2) as pf:
            loaded = list(next(iter(pf)))
    for got, mb in zip(loaded, plan.ranks[0].micro_batches, strict=True):
        assert got.packed and mb.packed is not None
        if mb.is_dummy:  # one placeholder segment, weight 0
            assert len(got.batch) == 1 and got.weights.tolist() == [0.0]
            continue
        assert [b.latents.shape[2:] for b in got.batch] == list(mb.packed.sample_shapes)
        assert [int(b.sample_ids[0]) for b in got.batch] == list(mb.sample_ids)
        np.testing.assert_array_equal(got.timesteps, np.asarray(mb.timesteps, np.float32))
        np.testing.assert_array_equal(got.weights, np.asarray(mb.weights, np.float32))
    assert len({tuple(b.latents.shape[2:]) for got in loaded for b in got.batch}) > 1  # mixed shapes in one plan


def _mb(ids: tuple[int, ...], shape: tuple[int, int, int], t: float = 100.0) -> MicroBatch:
    n = len(ids)
    return MicroBatch(ids, shape, 0, tuple(t + i for i in range(n)), tuple([0.25] * n))


def _plan(step: int, *mbs: MicroBatch) -> StepPlan:
    return StepPlan(step, (RankPlan(tuple(mbs), 0.0),), sum(len(m.sample_ids) for m in mbs))


def test_prefetch_runs_ahead_across_steps_and_handles_dummies(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=0) as ds:
        shape = tuple(int(v) for v in ds.latent_shapes[0])
        plans = [_plan(s, _mb((0,), shape), _mb((), shape)) for s in range(4)]
        with PlanPrefetcher(ds, plans, rank=0, depth=3) as pf:
            it = iter(pf)
            step0 = next(it)
            first = next(iter(step0))
            # the rest of step 0 (the loop takes a step's micro-batches together) and three beyond it
            assert [(s, i) for s, i, _ in pf._queue] == [(0, 1), (1, 0), (1, 1), (2, 0)]
            next(it)  # step 1 handed out: still three beyond it
            assert [(s, i) for s, i, _ in pf._queue] == [(0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0)]
            assert first.batch.valid.all()
            rest = [mb for step in it for mb in step]
        dummies = [mb for mb in rest if mb.micro_batch.is_dummy]
        assert dummies and all(not d.batch.valid.any() and d.weights.tolist() == [0.0] for d in dummies)


def test_prefetch_loads_the_whole_next_step_beyond_a_small_depth(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=0) as ds:
        shape = tuple(int(v) for v in ds.latent_shapes[0])
        plans = [_plan(s, *[_mb((s,), shape)] * 3) for s in range(3)]
        with PlanPrefetcher(ds, plans, rank=0, depth=1) as pf:
            it = iter(pf)
            step0 = next(it)
            assert [(s, i) for s, i, _ in pf._queue] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
            assert [mb.batch.sample_ids.tolist() for mb in step0] == [[0]] * 3
            step1 = next(it)
            assert [(s, i) for s, i, _ in pf._queue] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
            assert [mb.batch.sample_ids.tolist() for mb in step1] == [[1]] * 3


def test_depth_zero_loads_on_demand(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=0) as ds:
        shape = tuple(int(v) for v in ds.latent_shapes[0])
        with PlanPrefetcher(ds, [_plan(0, _mb((0,), shape))], rank=0, depth=0) as pf:
            (step,) = list(pf)
            assert not pf._queue
            assert [mb.batch.sample_ids.tolist() for mb in step] == [[0]]


def test_bad_rows_get_zero_weight_and_keep_their_timesteps(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=5, bad_policy="drop") as ds:
        shape = tuple(int(v) for v in ds.latent_shapes[0])
        ids = tuple(np.flatnonzero((ds.latent_shapes == ds.latent_shapes[0]).all(axis=1))[:3].tolist())
        (dataset / ds.index.shards[ds.index.shard[ids[1]]]).unlink()  # ids[1]'s shard is gone
        with PlanPrefetcher(ds, [_plan(0, _mb(ids, shape))], rank=0) as pf:
            (mb,) = [mb for step in pf for mb in step]
    kept = [j for j, i in enumerate(ids) if ds.index.shard[i] != ds.index.shard[ids[1]]]
    assert mb.batch.positions.tolist() == kept
    assert mb.timesteps.tolist() == [100.0 + j for j in kept] and mb.weights.tolist() == [0.25] * len(kept)


def test_too_many_bad_samples_surface_in_the_training_loop(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=0) as ds:
        shape = tuple(int(v) for v in ds.latent_shapes[0])
        (dataset / ds.index.shards[ds.index.shard[0]]).unlink()
        with PlanPrefetcher(ds, [_plan(0, _mb((0,), shape))], rank=0) as pf, pytest.raises(TooManyBadSamples):
            for step in pf:
                list(step)


def test_resume_from_the_wrong_step_is_refused(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=0) as ds:
        shape = tuple(int(v) for v in ds.latent_shapes[0])
        with PlanPrefetcher(ds, [_plan(3, _mb((0,), shape))], rank=0) as pf:
            pf.load_state_dict({"next_step": 5, "dataset": {}})
            with pytest.raises(ValueError, match="plans start at step 3 but the loader state resumes at step 5"):
                list(pf)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="prefetch"):
        PlanPrefetcher(None, [], rank=0, depth=-1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank"):
        PlanPrefetcher(None, [], rank=-1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 1), (3, 2), (64, 2)])
def test_loading_threads_leave_the_training_loop_a_core(cpus: int, workers: int) -> None:
    assert default_workers(cpus) == workers
