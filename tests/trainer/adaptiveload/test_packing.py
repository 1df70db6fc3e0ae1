"""SPMD packing: one row per rank per slot under the dual constraint, balanced, with few compiled shapes."""

import numpy as np
import pytest

from wanloom_trainer.adaptiveload.layout import cost_grid
from wanloom_trainer.adaptiveload.packing import ROW_CLASSES, fill_rows
from wanloom_trainer.adaptiveload.planner import PlanConfig, Planner
from wanloom_trainer.adaptiveload.simulate import MixSpec, simulate, synthetic_index

from .conftest import A14B

M_MEM = 75_600


def _lpt_one_by_one(tokens, cost, comp, num_ranks, m_mem, m_comp):
    """The reference: each sample, most expensive first, to the least-loaded row where it fits (lowest index on
    ties); a new slot of R rows when none fits."""
    rows = max(1, -(-int(tokens.sum()) // (num_ranks * m_mem)), int(np.ceil(comp.sum() / (num_ranks * m_comp))))
    load, free_t, free_c, used = (
        [0.0] * (num_ranks * rows),
        [m_mem] * (num_ranks * rows),
        [m_comp] * (num_ranks * rows),
        [0] * (num_ranks * rows),
    )
    out = np.empty(len(tokens), dtype=np.int64)
    for i in np.lexsort((tokens, cost))[::-1]:
        while True:
            fits = [
                j
                for j in range(len(load))
                if free_t[j] >= tokens[i] and (free_c[j] >= comp[i] * (1 - 1e-9) or used[j] == 0)
            ]
            if fits:
                break
            load += [0.0] * num_ranks
            free_t += [m_mem] * num_ranks
            free_c += [m_comp] * num_ranks
            used += [0] * num_ranks
        j = min(fits, key=lambda r: (load[r], fits.index(r)))
        out[i], load[j], free_t[j], free_c[j], used[j] = (
            j,
            load[j] + cost[i],
            free_t[j] - tokens[i],
            free_c[j] - comp[i],
            used[j] + 1,
        )
    return out, np.array(load)


@pytest.mark.parametrize("seed", range(4))
def test_rounds_of_water_filling_place_samples_as_one_by_one_lpt_would(seed: int) -> None:
    rng = np.random.default_rng(seed)
    kinds = np.array([[75_600, 9.0], [32_760, 3.2], [18_000, 1.6], [3_600, 0.3], [1_560, 0.12]])
    pick = rng.choice(len(kinds), 60, p=[0.15, 0.25, 0.1, 0.25, 0.25])
    tokens, cost = kinds[pick, 0].astype(np.int64), kinds[pick, 1]
    comp = tokens.astype(np.float64) ** 1.4
    got = fill_rows(tokens, cost, comp, 4, M_MEM, float(comp.max() * 1.5))
    want, _ = _lpt_one_by_one(tokens, cost, comp, 4, M_MEM, float(comp.max() * 1.5))
    rows = max(int(got.max()), int(want.max())) + 1

    def summary(placed: np.ndarray) -> list[tuple[float, ...]]:
        """(load, tokens, samples) of every row, sorted."""
        columns = (np.round(np.bincount(placed, weights=w, minlength=rows), 6).tolist() for w in (cost, tokens, None))
        return sorted(zip(*columns, strict=True))

    # Identical samples are interchangeable, so the rows must match as a multiset.
    assert summary(got) == summary(want)


def _planner(index, cost, router, policy, ranks=16, **kw):
    config = PlanConfig(
        ranks, policy, "spmd", global_batch=16 * ranks, memory_budget_tokens=M_MEM, seed=3, sequence_multiple=4,
        same_samples=True, **kw,
    )  # fmt: skip
    return Planner(index, A14B, config, cost, router)


def test_packed_plans_keep_the_contract(index, flop_cost, router):
    planner = _planner(index, flop_cost, router, "balanced", ranks=6)
    for step in range(3):
        plan = planner.plan(step)
        plan.validate()  # one geometry per slot on every rank: one SPMD program
        samples = [i for r in plan.ranks for mb in r.micro_batches for i in mb.sample_ids]
        assert len(samples) == len(set(samples)) == plan.num_samples == 96  # every sample once, no padding rows
        lengths = set()
        for r in plan.ranks:
            for mb in r.micro_batches:
                row = mb.packed
                assert row is not None and sum(row.sample_tokens) <= row.row_tokens <= M_MEM
                assert row.row_tokens % 4 == 0 and len(mb.sample_ids) + 1 <= row.groups  # padding has a slot
                assert all(t <= row.max_segment_tokens for t in row.sample_tokens)
                lengths.add(row.row_tokens)
        assert len(lengths) <= ROW_CLASSES  # few compiled programs


def test_packing_beats_equal_tokens_spmd_on_a_held_out_mix(flop_cost, router):
    """The issue's targets, on a mix the planner was not tuned on (more images, shorter clips, more 720p):
    padding ≤ 10% of compute and ≥ 1.15x the throughput of equal-token SPMD given the same samples."""
    mix = MixSpec(image_share=0.45, clip_720p_share=0.6, duration_mean_s=5.0, duration_log_sigma=0.8)
    index = synthetic_index(A14B, 20_000, seed=7, mix=mix)
    packed = _planner(index, flop_cost, router, "balanced")
    equal = _planner(index, flop_cost, router, "equal-tokens")
    a = packed.assign(0)
    assert a.padding_cost(packed.facts) / cost_grid(a, packed.facts).sum() <= 0.10
    assert simulate(packed, 4).tokens_per_second >= 1.15 * simulate(equal, 4).tokens_per_second
