"""Sequence packing for the SPMD layout: every device gets one row of the same length and nearly the same cost.

On TPU a micro-batch slot is one program on every device at once, so a slot takes as long as its most expensive
row, and a device with nothing to do still runs the slot's shape. Grouping samples by bucket (one shape per slot)
pads every group that does not hold a multiple of R samples; with many buckets and a fixed global batch most of
the compute is padding. Packing lays samples of any shapes end to end in one row per device (segments:
docs/architecture.md, "Packed sequences"), so a slot's rows differ only in content.

Per expert (slots are expert-homogeneous):

1. **Dual constraint.** A row holds at most ``M_mem`` tokens (memory, ``memoryBudgetTokens``) and at most
   ``M_comp`` of compute in the paper's units, Σ S_i^p (``computeBudget``; a sample alone always fits). The
   expert gets K = max(⌈Σ S / (R·M_mem)⌉, ⌈Σ S^p / (R·M_comp)⌉) slots, i.e. R·K rows, more when first-fit fails.
2. **Balance.** Samples in decreasing cost go to the feasible row with the least predicted cost (LPT with
   capacities; identical samples of a bucket are water-filled in rounds, which places them exactly as one-by-one
   LPT would). Images and short clips, cheapest, come last and fill the gaps the long clips leave.
3. **Few programs.** Rows are sorted by tokens and cut into slots of R, so a slot's rows are alike in length; the
   slot's row length is its longest row rounded up to a multiple of 1/``ROW_CLASSES`` of its power-of-two octave
   (at most 8 lengths per octave, at most 12.5% padding from rounding) and of the sequence sharding, its segment
   slots a power of two, its longest-segment bound a power of two. Within a slot, rows go to ranks by LPT on the
   ranks' running totals.

Predicted costs: a row costs Σ over its samples of the cost model's per-sample cost (attention is block-diagonal,
so a sample costs what it costs alone, up to block rounding) plus its padding, a segment of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from wanloom_trainer.adaptiveload.layout import Assignment, BucketFacts, PackedSlots, StepItems
from wanloom_trainer.adaptiveload.lockstep import ranks_by_slot

ROW_CLASSES = 8


def _next_pow2(n: np.ndarray) -> np.ndarray:
    return 1 << np.ceil(np.log2(np.maximum(n, 1))).astype(np.int64)


def _round_up(n: np.ndarray, unit: int) -> np.ndarray:
    return -(-np.asarray(n, dtype=np.int64) // unit) * unit


def fill_rows(
    tokens: np.ndarray, cost: np.ndarray, comp: np.ndarray, num_ranks: int, m_mem: int, m_comp: float
) -> np.ndarray:
    """Row index int64 [n] of each sample (rows come in multiples of R), by LPT under the two capacities.

    Args:
        tokens, cost, comp: per sample: tokens S, predicted cost, compute in the paper's units S^p.
        num_ranks: R.
        m_mem, m_comp: per-row capacities.
    """
    n = len(tokens)
    slots = max(1, int(-(-tokens.sum() // (num_ranks * m_mem))), int(np.ceil(comp.sum() / (num_ranks * m_comp))))
    load = np.zeros(num_ranks * slots)
    free_t = np.full(len(load), m_mem, dtype=np.int64)
    free_c = np.full(len(load), float(m_comp))
    used = np.zeros(len(load), dtype=np.int64)
    row = np.empty(n, dtype=np.int64)
    # Groups of identical samples (one bucket), most expensive first.
    keys = np.lexsort((tokens, cost))[::-1]
    bounds = np.flatnonzero((np.diff(cost[keys]) != 0) | (np.diff(tokens[keys]) != 0)) + 1
    for group in np.split(keys, bounds):
        c, t, p = float(cost[group[0]]), int(tokens[group[0]]), float(comp[group[0]])
        left = list(group)
        while left:
            fits = (free_t >= t) & ((free_c >= p * (1 - 1e-9)) | (used == 0))
            if not fits.any():  # nothing feasible: one more slot of R empty rows
                extra = num_ranks
                load, used = np.concatenate([load, np.zeros(extra)]), np.concatenate([used, np.zeros(extra, np.int64)])
                free_t = np.concatenate([free_t, np.full(extra, m_mem, np.int64)])
                free_c = np.concatenate([free_c, np.full(extra, float(m_comp))])
                continue
            candidates = np.flatnonzero(fits)
            candidates = candidates[np.argsort(load[candidates], kind="stable")]
            # Every row still below (lowest load + c) is where LPT would put the next items, one each.
            take = candidates[load[candidates] < load[candidates[0]] + c - 1e-12][: len(left)]
            if len(take) == 0:
                take = candidates[:1]
            row[left[: len(take)]] = take
            left = left[len(take) :]
            load[take] += c
            free_t[take] -= t
            free_c[take] -= p
            used[take] += 1
    return row


def packed_assignment(
    items: StepItems,
    num_ranks: int,
    facts: BucketFacts,
    *,
    memory_budget_tokens: int,
    compute_budget: float,
    exponent: float,
    pad_cost: Callable[[np.ndarray], np.ndarray],
    sequence_multiple: int = 1,
) -> Assignment:
    """The step's samples packed into one row per rank per slot (module docstring).

    Args:
        items: the step's samples.
        num_ranks: R.
        facts: bucket tokens and per-sample costs.
        memory_budget_tokens, compute_budget, exponent: M_mem, M_comp and p of the dual constraint.
        pad_cost: predicted cost of a padding segment of n tokens (the cost model's ``sample_cost``).
        sequence_multiple: row lengths are multiples of this (the sequence sharding: context × tensor).
    """
    tokens = facts.tokens[items.bucket].astype(np.int64)
    cost = facts.cost[items.bucket]
    row_of = np.empty(len(tokens), dtype=np.int64)  # global row of each sample
    row_slot: list[np.ndarray] = []
    slot_expert: list[int] = []
    rows_so_far = slots_so_far = 0
    for e in np.unique(items.expert).tolist():
        members = np.flatnonzero(items.expert == e)
        comp = tokens[members].astype(np.float64) ** exponent
        rows = fill_rows(tokens[members], cost[members], comp, num_ranks, memory_budget_tokens, compute_budget)
        num_rows = -(-(int(rows.max()) + 1) // num_ranks) * num_ranks
        used = np.bincount(rows, weights=tokens[members], minlength=num_rows)
        slot_of_row = np.empty(num_rows, dtype=np.int64)
        slot_of_row[np.argsort(-used, kind="stable")] = np.arange(num_rows) // num_ranks  # alike lengths together
        row_of[members] = rows_so_far + rows
        row_slot.append(slots_so_far + slot_of_row)
        slot_expert.extend([int(e)] * (num_rows // num_ranks))
        rows_so_far += num_rows
        slots_so_far += num_rows // num_ranks
    slot_of_row = np.concatenate(row_slot)
    row_cost = np.bincount(row_of, weights=cost, minlength=rows_so_far)
    rank_of_row = ranks_by_slot(row_cost, slot_of_row, num_ranks, slots_so_far)
    owner, slot = rank_of_row[row_of], slot_of_row[row_of]
    geometry = _slot_geometry(
        tokens, row_of, rank_of_row, slot_of_row, num_ranks, slots_so_far, memory_budget_tokens, sequence_multiple,
        pad_cost,
    )  # fmt: skip
    real = np.ones(len(tokens), dtype=bool)
    return Assignment(items, real, owner, slot, num_ranks, slots_so_far, np.asarray(slot_expert), packed=geometry)


def _slot_geometry(
    tokens: np.ndarray,
    row_of: np.ndarray,
    rank_of_row: np.ndarray,
    slot_of_row: np.ndarray,
    num_ranks: int,
    num_slots: int,
    memory_budget_tokens: int,
    sequence_multiple: int,
    pad_cost: Callable[[np.ndarray], np.ndarray],
) -> PackedSlots:
    """Per slot: row length (one of ``ROW_CLASSES``), segment slots, longest-segment bound; per cell: padding
    tokens and their cost (a padding segment of n tokens costs ``pad_cost(n)``)."""
    used = np.zeros((num_ranks, num_slots), dtype=np.int64)
    count = np.zeros((num_ranks, num_slots), dtype=np.int64)
    longest = np.zeros(num_slots, dtype=np.int64)
    np.add.at(used, (rank_of_row[row_of], slot_of_row[row_of]), tokens)
    np.add.at(count, (rank_of_row[row_of], slot_of_row[row_of]), 1)
    np.maximum.at(longest, slot_of_row[row_of], tokens)
    need = np.maximum(used.max(axis=0), 1)
    granule = _next_pow2(-(-need // ROW_CLASSES))
    row_tokens = _round_up(need + (-need) % granule, sequence_multiple)  # up to a multiple of its granule
    row_tokens = np.minimum(row_tokens, _round_up(memory_budget_tokens, sequence_multiple))  # never past the budget
    groups = _next_pow2(count.max(axis=0) + 1)
    max_segment = np.minimum(_next_pow2(longest), row_tokens)
    pad = row_tokens[None, :] - used
    pad_grid = np.where(pad > 0, np.asarray(pad_cost(np.maximum(pad, 1)), dtype=np.float64), 0.0)
    return PackedSlots(row_tokens, groups, max_segment, pad, pad_grid)
