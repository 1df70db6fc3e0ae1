"""Balanced assignment for backends whose ranks synchronise in every micro-batch (FSDP).

With FSDP every transformer block of every micro-batch all-gathers its parameters (and reduce-scatters gradients
in backward), and a collective completes only when all ranks join it. Rank r cannot run micro-batch k+1 before
every rank has reached it, so the step takes ``Σ_k max_r t(r, k)`` — not ``max_r Σ_k t(r, k)``. Balancing per-rank
totals is then not enough: each *slot* k must be balanced on its own.

Per expert (slots are expert-aligned), the step's samples are cut into **units** (one unit = one micro-batch of
one bucket, ≤ cap_g rows) laid out in rows of R (one row = one slot). Two families of candidate layouts are scored
by the predicted lockstep time ``Σ_rows (max unit + a)`` (a = per-micro-batch overhead) and the best is kept,
preferring fewer units within 0.5% (smaller micro-batches only pay off when they buy real balance):

1. **D'Hondt, sorted rows.** For each slot count K, R·K units are apportioned to the groups by the D'Hondt rule,
   which minimises the largest unit cost max_g n_g·c_g/q_g subject to the memory cap (q_g ≥ ⌈n_g/cap_g⌉) and
   q_g ≤ n_g; units sorted by cost fill the rows (sorting minimises the sum of row maxima for fixed units).
2. **Row fill.** Row by row, the target is the heaviest remaining single sample; every unit takes as many
   samples of its group as fit under the target (at most cap_g), heaviest groups first — the paper's
   ``B = ⌊M_comp / S^p⌋`` with M_comp chosen per slot from the step's own samples.

Within a row the largest unit goes to the rank with the smallest running total (LPT), and a final swap pass
exchanges same-row units between ranks to even out per-rank totals without changing any row maximum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_PREFER_FEWER_SLOTS = 1.005
_MAX_EXTRA_SLOTS = 64


class Apportionment:
    """D'Hondt apportionment of seats (units) to groups with bounds lo ≤ q ≤ hi, for any number of seats.

    The next seat always goes to the group with the largest weight per seat held, which minimises
    max_g w_g/q_g for every seat count. Equivalently: seats beyond ``lo`` are the top priorities w_g/j over
    j = lo_g..hi_g−1, so one sort serves every seat count.
    """

    def __init__(self, weights: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        self.lo = lo.astype(np.int64)
        slack = (hi - lo).astype(np.int64)
        group = np.repeat(np.arange(len(weights)), slack)
        held = np.arange(len(group)) - np.repeat(np.cumsum(slack) - slack, slack) + self.lo[group]
        # Ties broken by group index then seat order, so the result is deterministic.
        self.order = group[np.lexsort((held, group, -weights[group] / held))]

    @property
    def max_seats(self) -> int:
        return int(self.lo.sum()) + len(self.order)

    def seats(self, total: int) -> np.ndarray:
        """q [G] for ``total`` seats, Σlo ≤ total ≤ Σhi."""
        extra = total - int(self.lo.sum())
        if extra < 0 or extra > len(self.order):
            raise ValueError(f"{total} seats is outside [{int(self.lo.sum())}, {self.max_seats}]")
        return self.lo + np.bincount(self.order[:extra], minlength=len(self.lo))


@dataclass(frozen=True)
class Units:
    """A candidate layout of one expert's samples: per unit [U] its group, size (samples) and row."""

    group: np.ndarray
    size: np.ndarray
    row: np.ndarray

    def cost(self, group_cost: np.ndarray) -> np.ndarray:
        return self.size * group_cost[self.group]

    def lockstep_time(self, group_cost: np.ndarray, num_ranks: int, dummy_cost: float, overhead: float) -> float:
        rows = int(self.row.max()) + 1
        row_max = np.full(rows, -np.inf)
        np.maximum.at(row_max, self.row, self.cost(group_cost))
        partial = np.bincount(self.row, minlength=rows) < num_ranks
        row_max = np.where(partial, np.maximum(row_max, dummy_cost), row_max)
        return float(row_max.sum() + rows * overhead)


def _even_sizes(totals: np.ndarray, parts: np.ndarray) -> np.ndarray:
    """Concatenated near-equal splits: ``totals[i]`` samples into ``parts[i]`` units (sizes differ by ≤ 1)."""
    totals, parts = np.asarray(totals, dtype=np.int64), np.asarray(parts, dtype=np.int64)
    base, rem = np.repeat(totals // parts, parts), np.repeat(totals % parts, parts)
    within = np.arange(int(parts.sum())) - np.repeat(np.cumsum(parts) - parts, parts)
    return base + (within < rem)


def sorted_rows(n: np.ndarray, cost: np.ndarray, q: np.ndarray, num_ranks: int) -> Units:
    """Group g split into q_g near-equal units; units sorted by cost (ties: group, then order) fill rows of R."""
    group = np.repeat(np.arange(len(n)), q)
    size = _even_sizes(n, q)
    order = np.lexsort((np.arange(len(group)), group, -size * cost[group]))
    row = np.empty(len(group), dtype=np.int64)
    row[order] = np.arange(len(group)) // num_ranks
    return Units(group, size, row)


def row_fill(n: np.ndarray, cost: np.ndarray, cap: np.ndarray, num_ranks: int) -> Units:
    """Row-by-row filling up to a per-row target (module docstring, candidate 2)."""
    left = n.astype(np.int64).tolist()
    cost_l, cap_l = cost.tolist(), cap.tolist()
    by_cost = np.argsort(-cost, kind="stable").tolist()
    records: list[tuple[int, int, int, int]] = []  # (group, units, samples, row)
    row = 0
    while any(left):
        live = [g for g in by_cost if left[g] > 0]
        target, positions = cost_l[live[0]], num_ranks
        for g in live:
            per_unit = min(max(int(target / cost_l[g] * (1 + 1e-9)), 1), cap_l[g])
            units = min(positions, -(-left[g] // per_unit))
            take = min(left[g], units * per_unit)
            records.append((g, units, take, row))
            left[g] -= take
            positions -= units
            if positions == 0:
                break
        row += 1
    g, units, take, rows = (np.array(col, dtype=np.int64) for col in zip(*records, strict=True))
    return Units(np.repeat(g, units), _even_sizes(take, units), np.repeat(rows, units))


def sorted_rows_time(
    n: np.ndarray, cost: np.ndarray, q: np.ndarray, num_ranks: int, dummy_cost: float, overhead: float
) -> float:
    """``sorted_rows(n, cost, q, R).lockstep_time(...)`` in O(G): a split has at most two distinct unit costs per
    group, so slot maxima are read off the cumulative counts of the distinct costs."""
    base, rem = n // q, n % q
    values = np.concatenate([(base + 1) * cost, base * cost])
    counts = np.concatenate([rem, q - rem])
    order = np.argsort(-values, kind="stable")
    values, cum = values[order], np.cumsum(counts[order])
    slots = -(-int(cum[-1]) // num_ranks)
    slot_max = values[np.searchsorted(cum, np.arange(slots) * num_ranks, side="right")]
    if int(cum[-1]) % num_ranks:
        slot_max[-1] = max(slot_max[-1], dummy_cost)
    return float(slot_max.sum() + slots * overhead)


def choose_units(
    n: np.ndarray,
    cost: np.ndarray,
    cap: np.ndarray,
    num_ranks: int,
    overhead: float,
    dummy_cost: float,
    min_slots: int = 1,
) -> Units:
    """The candidate layout (module docstring) with the lowest predicted lockstep time for one expert's groups, in
    at least ``min_slots`` slots where the samples allow (≤ ⌈Σn / R⌉)."""
    lo = -(-n // cap)
    seats = Apportionment(n * cost, lo, n)
    k_lo = max(1, -(-int(lo.sum()) // num_ranks), min(min_slots, -(-seats.max_seats // num_ranks)))
    k_hi = min(max(k_lo, -(-seats.max_seats // num_ranks)), k_lo + _MAX_EXTRA_SLOTS)
    splits = [seats.seats(min(k * num_ranks, seats.max_seats)) for k in range(k_lo, k_hi + 1)]
    scored = [
        (sorted_rows_time(n, cost, q, num_ranks, dummy_cost, overhead), int(q.sum()), i) for i, q in enumerate(splits)
    ]
    filled = row_fill(n, cost, cap, num_ranks)
    if int(filled.row.max()) + 1 >= k_lo:
        scored.append((filled.lockstep_time(cost, num_ranks, dummy_cost, overhead), len(filled.size), len(splits)))
    best = min(t for t, _, _ in scored)
    _, _, pick = min((s for s in scored if s[0] <= best * _PREFER_FEWER_SLOTS), key=lambda s: (s[1], s[0]))
    return filled if pick == len(splits) else sorted_rows(n, cost, splits[pick], num_ranks)


def lockstep_assign(
    bucket: np.ndarray,
    expert: np.ndarray,
    cost: np.ndarray,
    cap: np.ndarray,
    num_ranks: int,
    overhead: float,
    repair_iters: int = 256,
    min_slots: tuple[int, ...] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """(owner rank [n], slot [n]) for the step's samples; items sharing (owner, slot) form one micro-batch.

    Args:
        bucket, expert: int [n] per sample.
        cost, cap: per bucket [k]: per-sample cost and rows cap per micro-batch.
        num_ranks: R.
        overhead: per-micro-batch overhead a of the cost model.
        repair_iters: swaps of same-slot units between ranks to even out per-rank totals (slot maxima, and so the
            lockstep time, are unchanged by such swaps).
        min_slots: per expert, slots to make at least (a planning window needs one per step).
    """
    dummy_cost = float(cost.min())
    unit_of = np.empty(len(bucket), dtype=np.int64)
    unit_costs, unit_slots, first_unit, first_slot = [], [], 0, 0
    for e in np.flatnonzero(np.bincount(expert)):
        members = np.flatnonzero(expert == e)
        counts = np.bincount(bucket[members], minlength=len(cost))
        groups = np.flatnonzero(counts)
        # Grouped by bucket, original order within; small-int keys make the stable sort a linear radix sort.
        keys = bucket[members].astype(np.int16 if len(cost) < 2**15 else np.int64)
        members = members[np.argsort(keys, kind="stable")]
        n = counts[groups]
        least = min_slots[e] if e < len(min_slots) else 1
        units = choose_units(n, cost[groups], cap[groups], num_ranks, overhead, dummy_cost, least)
        # Each group's samples are consumed by that group's units in unit order.
        by_group = np.argsort(units.group, kind="stable")
        unit_of[members] = first_unit + np.repeat(by_group, units.size[by_group])
        unit_costs.append(units.cost(cost[groups]))
        unit_slots.append(first_slot + units.row)
        first_unit += len(units.size)
        first_slot += int(units.row.max()) + 1
    unit_cost, unit_slot = np.concatenate(unit_costs), np.concatenate(unit_slots)
    unit_rank = ranks_by_slot(unit_cost, unit_slot, num_ranks, first_slot)
    unit_rank = _swap_repair(unit_cost, unit_slot, unit_rank, num_ranks, first_slot, dummy_cost, repair_iters)
    return unit_rank[unit_of], unit_slot[unit_of]


def ranks_by_slot(unit_cost: np.ndarray, unit_slot: np.ndarray, num_ranks: int, num_slots: int) -> np.ndarray:
    """Within each slot, the largest unit goes to the rank with the smallest running total (LPT per slot)."""
    rank_of = np.empty(len(unit_cost), dtype=np.int64)
    loads = np.zeros(num_ranks)
    order = np.lexsort((-unit_cost, unit_slot))
    bounds = np.searchsorted(unit_slot[order], np.arange(num_slots + 1))
    for k in range(num_slots):
        row = order[bounds[k] : bounds[k + 1]]
        ranks = np.argsort(loads, kind="stable")[: len(row)]
        rank_of[row] = ranks
        loads[ranks] += unit_cost[row]
    return rank_of


def _swap_repair(
    unit_cost: np.ndarray,
    unit_slot: np.ndarray,
    unit_rank: np.ndarray,
    num_ranks: int,
    num_slots: int,
    dummy_cost: float,
    iters: int,
) -> np.ndarray:
    """Swap whole slot entries between the most- and a least-loaded rank while that lowers the larger total."""
    grid = np.full((num_ranks, num_slots), dummy_cost)
    unit_at = np.full((num_ranks, num_slots), -1, dtype=np.int64)
    grid[unit_rank, unit_slot] = unit_cost
    unit_at[unit_rank, unit_slot] = np.arange(len(unit_cost))
    totals = grid.sum(axis=1)
    for _ in range(iters if num_ranks > 1 else 0):
        hi = int(np.argmax(totals))
        partners = np.argsort(totals, kind="stable")[: min(8, num_ranks - 1)]
        delta = grid[hi][None, :] - grid[partners]  # [P, K]: what moving slot k's entry from hi to lo shifts
        gap = (totals[hi] - totals[partners])[:, None]
        new_max = np.where(
            (delta > 1e-12) & (delta < gap), np.maximum(totals[hi] - delta, totals[partners][:, None] + delta), np.inf
        )
        p, k = np.unravel_index(int(np.argmin(new_max)), new_max.shape)
        if not np.isfinite(new_max[p, k]) or new_max[p, k] >= totals[hi] - 1e-12:
            break
        lo = int(partners[p])
        d = delta[p, k]
        grid[[hi, lo], k], unit_at[[hi, lo], k] = grid[[lo, hi], k], unit_at[[lo, hi], k]
        totals[hi], totals[lo] = totals[hi] - d, totals[lo] + d
    placed = unit_at >= 0
    unit_rank = unit_rank.copy()
    unit_rank[unit_at[placed]] = np.nonzero(placed)[0]
    return unit_rank
