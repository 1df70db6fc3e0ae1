import numpy as np
import pytest

from wanloom_trainer.adaptiveload.assignment.lockstep import (
    Apportionment,
    lockstep_assign,
    row_fill,
    sorted_rows,
    sorted_rows_time,
)


def dhondt_reference(w, seats, lo, hi):
    q = lo.copy()
    for _ in range(seats - lo.sum()):
        ratio = np.where(q < hi, w / q, -np.inf)
        q[int(np.argmax(ratio))] += 1
    return q


@pytest.mark.parametrize("seed", range(15))
def test_apportionment_matches_seat_by_seat_dhondt(seed):
    rng = np.random.default_rng(seed)
    g = int(rng.integers(1, 6))
    n = rng.integers(1, 20, g)
    w = n * rng.choice([0.3, 1.0, 4.0, 9.0], g)
    lo = np.maximum(1, n // rng.integers(1, 5, g))
    app = Apportionment(w, lo, n)
    for seats in range(int(lo.sum()), int(n.sum()) + 1):
        got, ref = app.seats(seats), dhondt_reference(w, seats, lo.copy(), n)
        assert got.sum() == seats
        assert np.max(w / got) == pytest.approx(np.max(w / ref))


def test_fast_time_equals_built_layout():
    rng = np.random.default_rng(0)
    n = np.array([7, 30, 3, 12])
    cost = np.array([49.5, 0.3, 12.7, 3.6])
    for q in ([7, 1, 3, 3], [7, 15, 3, 12], [7, 30, 3, 6]):
        q = np.array(q)
        units = sorted_rows(n, cost, q, 4)
        assert sorted_rows_time(n, cost, q, 4, 0.3, 0.05) == pytest.approx(units.lockstep_time(cost, 4, 0.3, 0.05))
    del rng


def test_row_fill_respects_cap_and_consumes_everything():
    n, cost, cap = np.array([9, 40, 5]), np.array([10.0, 1.0, 4.0]), np.array([1, 16, 3])
    units = row_fill(n, cost, cap, 4)
    np.testing.assert_array_equal(np.bincount(units.group, weights=units.size, minlength=3), n)
    assert np.all(units.size <= cap[units.group])
    assert np.all(np.bincount(units.row) <= 4)


def step_items(seed, n=200):
    rng = np.random.default_rng(seed)
    cost = np.array([0.3, 0.8, 12.7, 34.6, 49.5])
    cap = np.array([96, 42, 4, 2, 2])
    bucket = rng.choice(5, n, p=[0.3, 0.2, 0.25, 0.1, 0.15])
    expert = (rng.random(n) < 0.2).astype(np.int64)
    return bucket, expert, cost, cap


@pytest.mark.parametrize("seed", range(4))
def test_assignment_invariants(seed):
    bucket, expert, cost, cap = step_items(seed)
    owner, slot = lockstep_assign(bucket, expert, cost, cap, 8, overhead=0.05)
    cells = owner * 1000 + slot
    for cell in np.unique(cells):
        members = cells == cell
        assert len(set(bucket[members])) == 1  # shape-homogeneous micro-batch
        assert members.sum() <= cap[bucket[members][0]]  # memory cap
    for k in np.unique(slot):
        assert len(set(expert[slot == k])) == 1  # one expert per slot on every rank
    assert slot[expert == 0].max() < slot[expert == 1].min()  # expert 0's slots first


def test_lockstep_time_close_to_lower_bound():
    bucket, expert, cost, cap = step_items(7, n=400)
    expert[:] = 1
    owner, slot = lockstep_assign(bucket, expert, cost, cap, 8, overhead=0.0)
    grid = np.zeros((8, slot.max() + 1))
    np.add.at(grid, (owner, slot), cost[bucket])
    bound = cost[bucket].sum() / 8
    assert grid.max(axis=0).sum() < 1.12 * bound
    totals = grid.sum(axis=1)
    assert totals.std() / totals.mean() < 0.05
