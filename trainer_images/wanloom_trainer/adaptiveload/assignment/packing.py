"""Sequence packing for the SPMD layout: rows of a slot alike in cost, two step programs for the whole run.

On TPU a micro-batch slot is one program on every device at once: a slot takes as long as its most expensive row, and
every distinct row shape is a program to compile. The bucket sampler other trainers run (one bucket per slot,
``adaptiveload.comparison.compare``) has identical rows but one program per bucket shape and a short last chunk per
bucket. Packing lays samples of any shapes end to end in a row (segments: docs/architecture.md, "Packed sequences"), so:

1. **Two row shapes** (``RowShapes``), fixed for the run and shared by both experts: *long* rows of
   ``memoryBudgetTokens`` tokens and *short* rows of a quarter of that, each with the same number of segment slots
   (capped by the AdaLN kernel's VMEM budget, ``max_segments``) and its own longest-segment bound.
2. **Full long rows.** Per expert, samples too long for a short row are packed first-fit decreasing into long rows;
   R·⌈rows / R⌉ long rows are opened, plus whole slots of R more while the short samples can fill them; short
   samples, largest first, fill the gaps best-fit. What is left (less than a slot of long rows) goes to short rows,
   balanced by tokens, so at most a fraction of a short slot is padding.
3. **Alike rows together.** Rows of each shape are sorted by predicted cost and cut into slots of R, so a slot's
   rows hold similar work (long clips with long clips) and finish together; within a slot rows go to ranks by LPT
   on the ranks' running totals (``lockstep.ranks_by_slot``).

Predicted costs: a row costs Σ over its samples of the cost model's per-sample cost (attention is block-diagonal,
so a sample costs what it costs alone, up to block rounding) plus its padding, a segment of its own.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from wanloom_trainer.adaptiveload.assignment.layout import Assignment, BucketFacts, PackedSlots, StepItems
from wanloom_trainer.adaptiveload.assignment.lockstep import ranks_by_slot

SHORT_ROW_DIVISOR = 4  # short rows hold memoryBudgetTokens / 4: the leftover of a window pads at most that per row


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _round_up(n: int, unit: int) -> int:
    return -(-int(n) // unit) * unit


@dataclass(frozen=True)
class RowShapes:
    """The packed programs of a run (module docstring, 1): long and short rows.

    Attributes:
        long_tokens, short_tokens: tokens per row (multiples of the sequence sharding).
        groups: segment slots per row, padding included (a power of two, at most ``max_segments``).
        long_segment, short_segment: bound on any segment's tokens in each (the attention kernel's grid).
        samples_per_row: most samples the planner puts in one row (0: as many as the segment slots allow); a
            planning layout choice that leaves the programs alone.
    """

    long_tokens: int
    short_tokens: int
    groups: int
    long_segment: int
    short_segment: int
    samples_per_row: int = 0

    @property
    def max_samples(self) -> int:
        """Samples per row: every row keeps a segment slot for its padding."""
        return min(self.groups - 1, self.samples_per_row) if self.samples_per_row else self.groups - 1

    def programs(self) -> tuple[tuple[int, int, int], ...]:
        """(row tokens, segment slots, longest segment) of each program."""
        return (
            (self.long_tokens, self.groups, self.long_segment),
            (self.short_tokens, self.groups, self.short_segment),
        )


def row_shapes(
    bucket_tokens: np.ndarray,
    memory_budget_tokens: int,
    sequence_multiple: int,
    max_segments: int,
    step_tokens_per_rank: float | None = None,
) -> RowShapes:
    """The two row shapes for samples of ``bucket_tokens`` (the buckets that hold samples).

    Args:
        bucket_tokens: tokens of every bucket a sample may come from.
        memory_budget_tokens: M_mem, tokens per long row (rounded up to ``sequence_multiple``).
        sequence_multiple: context × tensor: rows are sharded along the sequence.
        max_segments: most segment slots a row may have (``kernels.adaln_shapes.max_packed_segments``).
        step_tokens_per_rank: the tokens a step gives each rank on average: short rows hold at most a quarter more
            (in eighths of its power-of-two octave), so that a step smaller than a row is not mostly padding.
    """
    tokens = np.asarray(bucket_tokens, dtype=np.int64)
    if max_segments < 2:
        raise ValueError(f"max_segments must be >= 2 (a sample and its padding), got {max_segments}")
    long_tokens = _round_up(memory_budget_tokens, sequence_multiple)
    short = long_tokens // SHORT_ROW_DIVISOR
    if step_tokens_per_rank is not None:  # a quarter more than a step's tokens, in eighths of its octave
        want = int(np.ceil(1.25 * step_tokens_per_rank))
        short = min(short, _round_up(want, max(1, _next_pow2(want) // 8)))
    short_tokens = _round_up(max(1, short), sequence_multiple)
    fit = max(2, long_tokens // max(int(tokens.min()), 1) + 1)  # as many samples as fit, plus the padding slot
    groups = min(_next_pow2(fit), 1 << (int(max_segments).bit_length() - 1))
    fit_short = tokens[tokens <= short_tokens]
    return RowShapes(
        long_tokens=long_tokens,
        short_tokens=short_tokens,
        groups=groups,
        long_segment=min(long_tokens, _next_pow2(int(tokens.max()))),
        short_segment=min(short_tokens, _next_pow2(int(fit_short.max()) if len(fit_short) else 1)),
    )


class _Rows:
    """Rows under construction: free tokens and sample count of each."""

    def __init__(self, capacity: int, max_samples: int) -> None:
        self.capacity, self.max_samples = capacity, max_samples
        self.free = np.zeros(0, dtype=np.int64)
        self.count = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.free)

    def open(self, n: int) -> None:
        self.free = np.concatenate([self.free, np.full(n, self.capacity, dtype=np.int64)])
        self.count = np.concatenate([self.count, np.zeros(n, dtype=np.int64)])

    def best_fit(self, tokens: int, n: int) -> np.ndarray:
        """Place up to ``n`` samples of ``tokens`` in existing rows, tightest rows first; their rows [placed]."""
        room = np.minimum(self.free // tokens, self.max_samples - self.count)
        rows = np.flatnonzero(room > 0)
        rows = rows[np.argsort(self.free[rows], kind="stable")]
        take = np.minimum(room[rows], np.maximum(n - np.concatenate([[0], np.cumsum(room[rows])[:-1]]), 0))
        rows, take = rows[take > 0], take[take > 0]
        self.free[rows] -= take * tokens
        self.count[rows] += take
        return np.repeat(rows, take)

    def fill_new(self, tokens: int, n: int) -> np.ndarray:
        """Open rows for ``n`` samples of ``tokens``, each as full as it can be; their rows [n]."""
        per_row = max(1, min(self.capacity // tokens, self.max_samples))
        first = len(self)
        self.open(-(-n // per_row))
        rows = first + np.arange(n) // per_row
        np.subtract.at(self.free, rows, tokens)
        np.add.at(self.count, rows, 1)
        return rows


def _by_bucket(tokens: np.ndarray) -> list[np.ndarray]:
    """Positions grouped by token count, largest first (samples of one bucket are interchangeable)."""
    order = np.argsort(-tokens, kind="stable")
    bounds = np.flatnonzero(np.diff(tokens[order])) + 1
    return np.split(order, bounds) if len(order) else []


def _balanced_short_rows(tokens: np.ndarray, num_rows: int, capacity: int, max_samples: int) -> np.ndarray:
    """Row [n] of each sample over ``num_rows`` rows: largest first to the row with the fewest tokens that fits."""
    heap = [(0, 0, r) for r in range(num_rows)]  # (tokens used, samples, row)
    row_of = np.empty(len(tokens), dtype=np.int64)
    parked = []
    for i in np.argsort(-tokens, kind="stable").tolist():
        t = int(tokens[i])
        while heap and (heap[0][0] + t > capacity or heap[0][1] >= max_samples):
            row = heapq.heappop(heap)
            if row[1] < max_samples:  # full for this size; smaller samples may still fit (a full count never frees)
                parked.append(row)
        if not heap:
            raise ValueError(f"{len(tokens)} samples do not fit {num_rows} short rows of {capacity} tokens")
        used, count, r = heapq.heappop(heap)
        row_of[i] = r
        heapq.heappush(heap, (used + t, count + 1, r))
        for item in parked:
            heapq.heappush(heap, item)
        parked.clear()
    return row_of


def expert_rows(
    tokens: np.ndarray, num_ranks: int, shapes: RowShapes, min_slots: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(row [n], is_long [rows]) of one expert's samples (module docstring, 2); rows of each shape come in
    multiples of R, long rows first, and there are at least ``min_slots`` slots.

    Args:
        tokens: int [n] tokens of each sample.
        num_ranks: R.
        shapes: the run's row shapes.
        min_slots: slots to make at least (the planning window's steps need one each).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    if (tokens > shapes.long_tokens).any():
        raise ValueError(f"a sample of {int(tokens.max())} tokens exceeds the {shapes.long_tokens}-token row")
    row_of = np.full(len(tokens), -1, dtype=np.int64)
    long = _Rows(shapes.long_tokens, shapes.max_samples)
    groups = _by_bucket(tokens)
    big = [g for g in groups if tokens[g[0]] > shapes.short_tokens]
    small = [g for g in groups if tokens[g[0]] <= shapes.short_tokens]
    for g in big:  # first-fit decreasing: each size into the gaps the larger ones left, then new rows
        t = int(tokens[g[0]])
        placed = long.best_fit(t, len(g))
        row_of[g[: len(placed)]] = placed
        row_of[g[len(placed) :]] = long.fill_new(t, len(g) - len(placed))
    small_tokens = sum(int(tokens[g[0]]) * len(g) for g in small)
    gap = int(long.free.sum()) + (-len(long) % num_ranks) * shapes.long_tokens  # once rounded up to R rows
    extra_slots = max(0, (small_tokens - gap) // (num_ranks * shapes.long_tokens))
    long_slots = -(-len(long) // num_ranks)

    def short_slots(extra: int) -> int:
        return -(
            -max(0, small_tokens - gap - extra * num_ranks * shapes.long_tokens) // (num_ranks * shapes.short_tokens)
        )

    # The window's steps need a slot each: keep samples for short rows rather than whole long slots of them.
    while extra_slots and long_slots + extra_slots + short_slots(extra_slots) < min_slots:
        extra_slots -= 1
    long.open(_round_up(len(long), num_ranks) + extra_slots * num_ranks - len(long))
    left: list[int] = []
    for g in small:  # best fit into the long rows' gaps, largest first
        placed = long.best_fit(int(tokens[g[0]]), len(g))
        row_of[g[: len(placed)]] = placed
        left.extend(g[len(placed) :].tolist())
    rest = np.asarray(left, dtype=np.int64)
    long_slots = len(long) // num_ranks
    need = -(-int(tokens[rest].sum()) // (num_ranks * shapes.short_tokens)) if len(rest) else 0
    need = max(need, -(-len(rest) // (num_ranks * shapes.max_samples)), min_slots - long_slots)
    short_rows = 0
    while len(rest):  # a slot more when the sizes do not pack into the tokens' lower bound
        short_rows = num_ranks * need
        try:
            row_of[rest] = len(long) + _balanced_short_rows(
                tokens[rest], short_rows, shapes.short_tokens, shapes.max_samples
            )
            break
        except ValueError:
            need += 1
    short_rows = max(short_rows, num_ranks * max(0, min_slots - long_slots))
    is_long = np.concatenate([np.ones(len(long), dtype=bool), np.zeros(short_rows, dtype=bool)])
    return row_of, is_long


def packed_assignment(
    items: StepItems,
    num_ranks: int,
    facts: BucketFacts,
    *,
    shapes: RowShapes,
    pad_cost: Callable[[np.ndarray], np.ndarray],
    min_slots: tuple[int, int] = (1, 1),
) -> Assignment:
    """The samples packed into one row per rank per slot (module docstring).

    Args:
        items: the samples to plan (a step's, or a planning window's).
        num_ranks: R.
        facts: bucket tokens and per-sample costs.
        shapes: the run's row shapes (``row_shapes``).
        pad_cost: predicted cost of a padding segment of n tokens (the cost model's ``sample_cost``).
        min_slots: slots to make at least for each expert that has samples.
    """
    tokens = facts.tokens[items.bucket].astype(np.int64)
    cost = facts.cost[items.bucket]
    row_of = np.empty(len(tokens), dtype=np.int64)
    slot_of_row, slot_expert, slot_long, row_long = [], [], [], []
    rows_so_far = slots_so_far = 0
    for e in np.unique(items.expert).tolist():
        members = np.flatnonzero(items.expert == e)
        rows, is_long = expert_rows(tokens[members], num_ranks, shapes, min_slots[int(e)])
        row_of[members] = rows_so_far + rows
        used = np.bincount(rows, weights=tokens[members], minlength=len(is_long))
        load = np.bincount(rows, weights=cost[members], minlength=len(is_long))
        capacity = np.where(is_long, shapes.long_tokens, shapes.short_tokens)
        free = capacity - used.astype(np.int64)
        load = load + np.where(free > 0, np.asarray(pad_cost(np.maximum(free, 1)), dtype=np.float64), 0.0)
        slot = np.empty(len(is_long), dtype=np.int64)
        for kind in (True, False):  # alike rows together: each shape's rows by cost, cut into slots of R
            of_kind = np.flatnonzero(is_long == kind)
            ordered = of_kind[np.argsort(-load[of_kind], kind="stable")]
            first = slots_so_far + (0 if kind else int(is_long.sum()) // num_ranks)
            slot[ordered] = first + np.arange(len(ordered)) // num_ranks
            slot_long.extend([kind] * (len(ordered) // num_ranks))
        slot_of_row.append(slot)
        row_long.append(is_long)
        k = len(is_long) // num_ranks
        slot_expert.extend([int(e)] * k)
        rows_so_far += len(is_long)
        slots_so_far += k
    slot_of_row_all = np.concatenate(slot_of_row) if slot_of_row else np.zeros(0, dtype=np.int64)
    row_cost = np.bincount(row_of, weights=cost, minlength=rows_so_far)
    rank_of_row = ranks_by_slot(row_cost, slot_of_row_all, num_ranks, slots_so_far)
    owner, slot = rank_of_row[row_of], slot_of_row_all[row_of]
    geometry = _slot_geometry(
        tokens, owner, slot, num_ranks, slots_so_far, np.asarray(slot_long, dtype=bool), shapes, pad_cost
    )
    real = np.ones(len(tokens), dtype=bool)
    return Assignment(items, real, owner, slot, num_ranks, slots_so_far, np.asarray(slot_expert), packed=geometry)


def _slot_geometry(
    tokens: np.ndarray,
    owner: np.ndarray,
    slot: np.ndarray,
    num_ranks: int,
    num_slots: int,
    slot_long: np.ndarray,
    shapes: RowShapes,
    pad_cost: Callable[[np.ndarray], np.ndarray],
) -> PackedSlots:
    """Per slot: its shape's row tokens, segment slots and longest-segment bound; per cell: padding tokens and
    their cost (a padding segment of n tokens costs ``pad_cost(n)``)."""
    used = np.zeros((num_ranks, num_slots), dtype=np.int64)
    np.add.at(used, (owner, slot), tokens)
    row_tokens = np.where(slot_long, shapes.long_tokens, shapes.short_tokens).astype(np.int64)
    groups = np.full(num_slots, shapes.groups, dtype=np.int64)
    max_segment = np.where(slot_long, shapes.long_segment, shapes.short_segment).astype(np.int64)
    pad = row_tokens[None, :] - used
    pad_grid = np.where(pad > 0, np.asarray(pad_cost(np.maximum(pad, 1)), dtype=np.float64), 0.0)
    return PackedSlots(row_tokens, groups, max_segment, pad, pad_grid)
