"""From a step's samples assigned to (rank, slot) to micro-batches, in one of the two layouts of ``plan.py``.

Planning works on flat arrays (``Assignment``: one row per sample plus padding rows, each with a rank and a slot);
``materialise`` turns those into ``RankPlan`` objects — for every rank (the full ``StepPlan``) or only for the
calling rank, which is all a trainer process needs. A micro-batch never holds more than ``cap[b] = ⌊M_mem / S_b⌋``
rows. Slots are numbered globally; every slot holds one expert on all ranks (expert 0's slots first).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from wanloom_trainer.adaptiveload.plan import MicroBatch, PackedRow, RankPlan


@dataclass(frozen=True)
class StepItems:
    """The step's samples: ids int64 [n], bucket int64 [n], expert int64 [n], timesteps float32 [n]."""

    ids: np.ndarray
    bucket: np.ndarray
    expert: np.ndarray
    timesteps: np.ndarray

    def take(self, rows: np.ndarray) -> StepItems:
        return StepItems(self.ids[rows], self.bucket[rows], self.expert[rows], self.timesteps[rows])


@dataclass(frozen=True)
class BucketFacts:
    """Per bucket [k]: latent shapes [k, 3], tokens, rows cap per micro-batch, per-sample cost; call overhead."""

    shapes: np.ndarray
    tokens: np.ndarray
    cap: np.ndarray
    cost: np.ndarray
    overhead: float

    @property
    def dummy_bucket(self) -> int:
        """The cheapest bucket: what a dummy micro-batch runs."""
        return int(np.argmin(self.cost))


@dataclass(frozen=True)
class PackedSlots:
    """Geometry of packed slots (``adaptiveload.assignment.packing``).

    Attributes:
        row_tokens, groups, max_segment_tokens: int [K] per slot (identical on every rank: one program).
        pad_tokens: int [R, K] padding tokens of each (rank, slot) row.
        pad_cost: float [R, K] predicted cost of that padding.
    """

    row_tokens: np.ndarray
    groups: np.ndarray
    max_segment_tokens: np.ndarray
    pad_tokens: np.ndarray
    pad_cost: np.ndarray


@dataclass(frozen=True)
class Assignment:
    """A planned step as arrays over rows (real samples first, then zero-weight padding rows).

    Attributes:
        rows: the rows' ids, buckets, experts and timesteps [m].
        real: bool [m], False for padding rows.
        owner, slot: int [m], the rank and micro-batch slot of each row.
        num_ranks, num_slots: the grid size; (rank, slot) cells without rows are dummies.
        slot_expert: int [num_slots], the expert of each slot.
        packed: the packed geometry (one row per (rank, slot), samples of any shapes), or None.
        weight_norm: a real row's loss weight is 1 / ``weight_norm`` (``token_weights``: its tokens / ``weight_norm``);
            0 means the step's own sample count (the bucket-chunk policies, whose steps vary in size).
        token_weights: weight per token rather than per sample (the "tokens" step budget).
    """

    rows: StepItems
    real: np.ndarray
    owner: np.ndarray
    slot: np.ndarray
    num_ranks: int
    num_slots: int
    slot_expert: np.ndarray
    packed: PackedSlots | None = None
    weight_norm: float = 0.0
    token_weights: bool = False

    def row_weights(self, facts: BucketFacts) -> np.ndarray:
        """The loss weight float64 [m] of every row (padding rows 0): what the step's gradient gives each sample."""
        norm = self.weight_norm or max(self.num_samples, 1)
        per_row = facts.tokens[self.rows.bucket].astype(np.float64) if self.token_weights else 1.0
        return np.where(self.real, per_row / norm, 0.0)

    @property
    def num_samples(self) -> int:
        return int(self.real.sum())

    def padding_cost(self, facts: BucketFacts) -> float:
        """Predicted compute spent on padding: zero-weight rows, dummy micro-batches, padding tokens."""
        if self.packed is not None:
            return float(self.packed.pad_cost.sum())
        grid = cost_grid(self, facts)
        return float(grid.sum() - facts.cost[self.rows.bucket[self.real]].sum())


def slots_by_group(
    items: StepItems, owner: np.ndarray, num_ranks: int, facts: BucketFacts, caps: np.ndarray | None = None
) -> np.ndarray:
    """Slot [n] when ranks synchronise once per step: on each rank one micro-batch per (expert, bucket), split
    evenly where it exceeds the cap (``caps`` per bucket, default the memory cap), heavier buckets first; expert
    1's slots start after expert 0's."""
    caps = facts.cap if caps is None else caps
    k = len(facts.tokens)
    keys = (owner * 2 + items.expert) * k + (k - 1 - items.bucket)
    order = np.argsort(keys, kind="stable")
    bounds = np.flatnonzero(np.diff(keys[order])) + 1
    starts, ends = np.concatenate([[0], bounds]), np.concatenate([bounds, [len(order)]])
    local = np.empty(len(keys), dtype=np.int64)
    used = np.zeros((num_ranks, 2), dtype=np.int64)
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        first = order[s]
        r, x, cap = int(owner[first]), int(items.expert[first]), int(caps[items.bucket[first]])
        chunks = -(-(e - s) // cap)
        sizes = np.full(chunks, (e - s) // chunks) + (np.arange(chunks) < (e - s) % chunks)
        local[order[s:e]] = used[r, x] + np.repeat(np.arange(chunks), sizes)
        used[r, x] += chunks
    expert0_slots = int(used[:, 0].max())
    return np.where(items.expert == 0, local, local + expert0_slots)


def per_rank_assignment(items: StepItems, owner: np.ndarray, slot: np.ndarray, num_ranks: int) -> Assignment:
    """Wrap a (rank, slot) per sample; no padding rows (empty cells become dummies)."""
    num_slots = int(slot.max()) + 1 if len(slot) else 0
    slot_expert = np.zeros(num_slots, dtype=np.int64)
    slot_expert[slot] = items.expert
    real = np.ones(len(owner), dtype=bool)
    return Assignment(items, real, owner, slot, num_ranks, num_slots, slot_expert)


def spmd_assignment(items: StepItems, num_ranks: int, facts: BucketFacts, caps: np.ndarray | None = None) -> Assignment:
    """Slots shared by all ranks: per (expert, bucket) group of m samples, s = ⌈m / (R·cap)⌉ slots of
    w = ⌈m / (R·s)⌉ rows per rank. Samples are dealt round-robin over ranks so padding spreads evenly; padding rows
    repeat the group's first sample. ``caps``: rows per micro-batch per bucket (default the memory cap)."""
    caps = facts.cap if caps is None else caps
    k = len(facts.tokens)
    keys = items.expert * k + (k - 1 - items.bucket)
    order = np.argsort(keys, kind="stable")
    bounds = np.flatnonzero(np.diff(keys[order])) + 1
    owner, slot = np.empty(len(order), dtype=np.int64), np.empty(len(order), dtype=np.int64)
    pad_src, pad_owner, pad_slot, slot_expert, first = [], [], [], [], 0
    for group in np.split(order, bounds):
        m, cap = len(group), int(caps[items.bucket[group[0]]])
        slots = -(-m // (num_ranks * cap))
        width = -(-m // (num_ranks * slots))
        i = np.arange(m)
        owner[group], slot[group] = i % num_ranks, first + (i // num_ranks) // width
        filled = np.bincount((slot[group] - first) * num_ranks + owner[group], minlength=slots * num_ranks)
        missing = width - filled
        cells = np.repeat(np.arange(slots * num_ranks), missing)
        pad_src.append(np.full(len(cells), group[0]))
        pad_owner.append(cells % num_ranks)
        pad_slot.append(first + cells // num_ranks)
        slot_expert.extend([int(items.expert[group[0]])] * slots)
        first += slots
    pad = np.concatenate(pad_src).astype(np.int64)
    rows = items.take(np.concatenate([np.arange(len(order)), pad]))
    real = np.concatenate([np.ones(len(order), dtype=bool), np.zeros(len(pad), dtype=bool)])
    return Assignment(
        rows,
        real,
        np.concatenate([owner, *pad_owner]),
        np.concatenate([slot, *pad_slot]),
        num_ranks,
        first,
        np.asarray(slot_expert, dtype=np.int64),
    )


def cost_grid(assignment: Assignment, facts: BucketFacts) -> np.ndarray:
    """Predicted compute float [R, K] of every (rank, slot) cell, dummies included (no per-call overhead)."""
    grid = np.zeros((assignment.num_ranks, assignment.num_slots))
    np.add.at(grid, (assignment.owner, assignment.slot), facts.cost[assignment.rows.bucket])
    if assignment.packed is not None:  # empty rows are all padding
        return grid + assignment.packed.pad_cost
    empty = np.ones_like(grid, dtype=bool)
    empty[assignment.owner, assignment.slot] = False
    grid[empty] = facts.cost[facts.dummy_bucket]
    return grid


def critical_work(assignment: Assignment, facts: BucketFacts, grid: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """Per slot, the token counts of the samples in its predicted-heaviest (rank, slot) cell (``grid``: the
    ``cost_grid``), padding rows and padding tokens included: the work that bounds the slot's time."""
    heaviest = grid.argmax(axis=0) if grid.size else np.zeros(0, dtype=np.int64)
    cells = assignment.owner * max(assignment.num_slots, 1) + assignment.slot
    wanted = heaviest * max(assignment.num_slots, 1) + np.arange(assignment.num_slots)
    pick = np.flatnonzero(np.isin(cells, wanted))
    tokens = facts.tokens[assignment.rows.bucket[pick]]
    work: list[list[int]] = [[] for _ in range(assignment.num_slots)]
    for k, t in zip(assignment.slot[pick].tolist(), tokens.tolist(), strict=True):
        work[k].append(t)
    for k, r in enumerate(heaviest.tolist()):
        if assignment.packed is not None and assignment.packed.pad_tokens[r, k] > 0:
            work[k].append(int(assignment.packed.pad_tokens[r, k]))
        elif not work[k]:  # a dummy micro-batch
            work[k].append(int(facts.tokens[facts.dummy_bucket]))
    return tuple(tuple(w) for w in work)


def materialise(assignment: Assignment, facts: BucketFacts, ranks: Iterable[int] | None = None) -> list[RankPlan]:
    """RankPlans of ``ranks`` (all by default), micro-batches in slot order, real rows before padding rows."""
    wanted = list(range(assignment.num_ranks)) if ranks is None else [int(r) for r in ranks]
    select = np.isin(assignment.owner, wanted) if ranks is not None else np.ones(len(assignment.owner), bool)
    idx = np.flatnonzero(select)
    idx = idx[np.lexsort((~assignment.real[idx], assignment.slot[idx], assignment.owner[idx]))]
    rows = _RowLists(assignment, idx, facts)
    keys = assignment.owner[idx] * max(assignment.num_slots, 1) + assignment.slot[idx]
    # One run of rows per (rank, slot) cell that holds any; a rank may hold none (all its cells are dummies).
    bounds = np.flatnonzero(np.diff(keys)) + 1
    starts = np.concatenate([[0], bounds]).tolist() if len(idx) else []
    ends = np.concatenate([bounds, [len(idx)]]).tolist() if len(idx) else []
    position = {r: i for i, r in enumerate(wanted)}
    packed = assignment.packed
    if packed is None:
        dummies = [_dummy(e, facts) for e in (0, 1)]
        grid = [[dummies[e] for e in assignment.slot_expert.tolist()] for _ in wanted]
    else:
        grid = [
            [_dummy(int(e), facts, _geometry(packed, k), float(packed.pad_cost[r, k]))
             for k, e in enumerate(assignment.slot_expert.tolist())]
            for r in wanted
        ]  # fmt: skip
    for s, e in zip(starts, ends, strict=True):
        r, k = divmod(int(keys[s]), max(assignment.num_slots, 1))
        if packed is None:
            grid[position[r]][k] = rows.micro_batch(s, e)
        else:
            grid[position[r]][k] = rows.packed_micro_batch(s, e, _geometry(packed, k), float(packed.pad_cost[r, k]))
    return [RankPlan(tuple(mbs), sum(mb.predicted_cost for mb in mbs) + facts.overhead * len(mbs)) for mbs in grid]


def _geometry(packed: PackedSlots, slot: int) -> PackedRow:
    return PackedRow(int(packed.row_tokens[slot]), int(packed.groups[slot]), int(packed.max_segment_tokens[slot]))


class _RowLists:
    """Python lists of the rows in plan order, so that micro-batches are cheap list slices."""

    def __init__(self, assignment: Assignment, order: np.ndarray, facts: BucketFacts) -> None:
        rows = assignment.rows
        self.ids = rows.ids[order].tolist()
        self.timesteps = rows.timesteps[order].astype(np.float32).tolist()
        self.weights = assignment.row_weights(facts)[order].tolist()
        self.bucket = rows.bucket[order].tolist()
        self.expert = rows.expert[order].tolist()
        self.shapes = [tuple(s) for s in facts.shapes.tolist()]
        self.tokens, self.cost = facts.tokens.tolist(), facts.cost.tolist()

    def micro_batch(self, start: int, end: int) -> MicroBatch:
        b = self.bucket[start]
        return MicroBatch(
            sample_ids=tuple(self.ids[start:end]),
            latent_shape=self.shapes[b],
            expert=self.expert[start],
            timesteps=tuple(self.timesteps[start:end]),
            weights=tuple(self.weights[start:end]),
            tokens=self.tokens[b],
            predicted_cost=(end - start) * self.cost[b],
        )

    def packed_micro_batch(self, start: int, end: int, row: PackedRow, pad_cost: float) -> MicroBatch:
        """One packed row: samples of any buckets in plan order, the largest shape as the nominal one."""
        buckets = self.bucket[start:end]
        row = PackedRow(
            row.row_tokens,
            row.groups,
            row.max_segment_tokens,
            sample_shapes=tuple(self.shapes[b] for b in buckets),
            sample_tokens=tuple(self.tokens[b] for b in buckets),
        )
        largest = max(buckets, key=lambda b: self.tokens[b])
        return MicroBatch(
            sample_ids=tuple(self.ids[start:end]),
            latent_shape=self.shapes[largest],
            expert=self.expert[start],
            timesteps=tuple(self.timesteps[start:end]),
            weights=tuple(self.weights[start:end]),
            tokens=sum(row.sample_tokens),
            predicted_cost=sum(self.cost[b] for b in buckets) + pad_cost,
            packed=row,
        )


def _dummy(expert: int, facts: BucketFacts, packed: PackedRow | None = None, pad_cost: float = 0.0) -> MicroBatch:
    """A micro-batch with no sample: one zero-weight row of the cheapest bucket (packed: in an all-padding row)."""
    b = facts.dummy_bucket
    shape = tuple(facts.shapes[b].tolist())
    cost = float(facts.cost[b]) if packed is None else pad_cost
    return MicroBatch((), shape, expert, (), (), tokens=int(facts.tokens[b]), predicted_cost=cost, packed=packed)


def select_slots(assignment: Assignment, slots: np.ndarray) -> Assignment:
    """The sub-assignment of ``slots`` (global slot numbers), renumbered 0.. with expert 0's slots first."""
    slots = np.asarray(slots, dtype=np.int64)
    slots = slots[np.argsort(assignment.slot_expert[slots], kind="stable")]
    renumber = np.full(assignment.num_slots, -1, dtype=np.int64)
    renumber[slots] = np.arange(len(slots))
    keep = np.flatnonzero(renumber[assignment.slot] >= 0)
    p = assignment.packed
    packed = None if p is None else PackedSlots(
        p.row_tokens[slots], p.groups[slots], p.max_segment_tokens[slots], p.pad_tokens[:, slots], p.pad_cost[:, slots]
    )  # fmt: skip
    return Assignment(
        assignment.rows.take(keep),
        assignment.real[keep],
        assignment.owner[keep],
        renumber[assignment.slot[keep]],
        assignment.num_ranks,
        len(slots),
        assignment.slot_expert[slots],
        packed,
        assignment.weight_norm,
        assignment.token_weights,
    )


def slot_features(assignment: Assignment, facts: BucketFacts) -> np.ndarray:
    """Per slot [K, 4]: real samples, images (one latent frame), tokens and expert-1 samples it holds."""
    a, k = assignment, assignment.num_slots
    slot, bucket = a.slot[a.real], a.rows.bucket[a.real]
    image = (facts.shapes[bucket, 0] == 1).astype(np.float64)
    expert1 = (a.rows.expert[a.real] == 1).astype(np.float64)
    return np.stack(
        [
            np.bincount(slot, minlength=k).astype(np.float64),
            np.bincount(slot, weights=image, minlength=k),
            np.bincount(slot, weights=facts.tokens[bucket].astype(np.float64), minlength=k),
            np.bincount(slot, weights=expert1, minlength=k),
        ],
        axis=1,
    )


def deal_steps(
    assignment: Assignment, steps: int, facts: BucketFacts, rng: np.random.Generator, *, bound: str = "samples"
) -> list[Assignment]:
    """A window's slots dealt to ``steps`` steps that each hold the window's mix, in a seeded stratified order.

    Every step gets about 1/``steps`` of the window's samples (``bound`` "samples") or tokens ("tokens"): slots,
    largest first (ties in a seeded order), each to the step with room under that bound whose samples, images,
    tokens and expert-1 samples so far are smallest relative to their shares (the smallest Σ fill·slot / share², a
    vector LPT), so a step is a small copy of its window rather than a run of one shape; moves and swaps between the
    fullest and the emptiest step then even out what the greedy left over (``_even_out``). The steps are then put in
    a seeded order stratified by image share and tokens per sample (``stratified_order``): every third of the window
    sees the window's mix, and no part of it is a curriculum. Needs ``num_slots`` ≥ ``steps``."""
    if assignment.num_slots < steps:
        raise ValueError(f"a window of {assignment.num_slots} slots cannot make {steps} steps")
    features = slot_features(assignment, facts)
    share = np.maximum(features.sum(axis=0) / steps, 1e-12)
    scale = 1.0 / share**2
    size = features[:, 0] if bound == "samples" else features[:, 2]
    room = share[0] if bound == "samples" else share[2]
    shuffled = rng.permutation(assignment.num_slots)
    order = shuffled[np.argsort(-size[shuffled], kind="stable")]
    fill = np.zeros((steps, features.shape[1]))
    held = np.zeros(steps)
    parts: list[list[int]] = [[] for _ in range(steps)]
    # Both experts in every step where each has a slot per step: its W largest slots first, one to each step.
    first: list[int] = []
    for expert in (0, 1):
        mine = order[assignment.slot_expert[order] == expert]
        if len(mine) >= steps:
            first.extend(mine[:steps].tolist())
            for j, k in enumerate(mine[:steps].tolist()):
                parts[j].append(k)
                fill[j] += features[k]
                held[j] += size[k]
    order = order[~np.isin(order, first)]
    for k in order.tolist():
        fits = np.flatnonzero(held + size[k] <= room * (1 + 1e-9))
        j = int(fits[np.argmin((fill[fits] * features[k] * scale).sum(axis=1))]) if len(fits) else int(np.argmin(held))
        parts[j].append(k)
        fill[j] += features[k]
        held[j] += size[k]
    _even_out(parts, size, held, room)
    fill = np.stack([features[np.asarray(part, dtype=np.int64)].sum(axis=0) for part in parts])
    return [
        select_slots(assignment, np.sort(np.asarray(parts[j], dtype=np.int64)))
        for j in stratified_order(fill[:, :3], rng)
    ]


def _even_out(parts: list[list[int]], size: np.ndarray, held: np.ndarray, room: float, rounds: int = 256) -> None:
    """Moves and swaps of slots between the fullest and the emptiest step while they bring both nearer ``room``
    (the greedy deal can leave a step one small slot over and another under)."""
    for _ in range(rounds):
        over, under = int(np.argmax(held)), int(np.argmin(held))
        excess, lack = held[over] - room, room - held[under]
        if excess <= 1e-9 or lack <= 1e-9:
            return
        best, move = excess + lack - 1e-9, None
        for k in parts[over]:
            for back in [None, *parts[under]]:  # move k, or swap it with a smaller slot
                shift = size[k] - (0.0 if back is None else size[back])
                cost = abs(excess - shift) + abs(lack - shift)
                if shift > 0 and cost < best:
                    best, move = cost, (k, back, shift)
        if move is None:
            return
        k, back, shift = move
        parts[over].remove(k)
        parts[under].append(k)
        if back is not None:
            parts[under].remove(back)
            parts[over].append(back)
        held[over] -= shift
        held[under] += shift


def stratified_order(contents: np.ndarray, rng: np.random.Generator) -> list[int]:
    """A seeded shuffle of steps (``contents`` [W, 3]: samples, images, tokens of each) in which every third gets the
    window's mix: steps ranked by image share and tokens per sample are taken three at a time, one to each third in
    a random order (thirds sized as ``np.array_split``); swaps between thirds then shrink the largest relative gap
    between a third's image share or tokens per sample and the window's (steps differ most when they hold few,
    large slots), and each third is shuffled."""
    n = len(contents)
    samples = np.maximum(contents[:, 0], 1.0)
    image_share, tokens_per_sample = contents[:, 1] / samples, contents[:, 2] / samples
    sizes = [len(part) for part in np.array_split(np.arange(n), 3)]
    third_of = np.empty(n, dtype=np.int64)
    filled = [0, 0, 0]
    light = np.argsort(np.argsort(image_share, kind="stable"))
    both = light + np.argsort(np.argsort(-tokens_per_sample, kind="stable"))
    ranked = np.argsort(both, kind="stable").tolist()
    for start in range(0, n, 3):
        open_thirds = [t for t in range(3) if filled[t] < sizes[t]]
        for step, third in zip(ranked[start : start + 3], rng.permutation(open_thirds).tolist(), strict=False):
            third_of[step] = third
            filled[third] += 1
    window = contents.sum(axis=0)
    target = np.maximum(window[1:] / max(window[0], 1.0), 1e-12)  # the window's image share, tokens per sample

    def gap(assign: np.ndarray) -> float:
        sums = np.zeros((3, 3))
        np.add.at(sums, assign, contents)
        sums = sums[sums[:, 0] > 0]
        return float(np.abs(sums[:, 1:] / sums[:, :1] / target - 1)[:, target > 1e-12].max(initial=0.0))

    best = gap(third_of)
    for _ in range(n):  # first-improvement swaps
        improved = False
        for i, j in zip(*np.nonzero(third_of[:, None] < third_of[None, :]), strict=True):
            trial = third_of.copy()
            trial[i], trial[j] = third_of[j], third_of[i]
            g = gap(trial)
            if g < best - 1e-12:
                third_of, best, improved = trial, g, True
                break
        if not improved:
            break
    return [int(step) for t in range(3) for step in rng.permutation(np.flatnonzero(third_of == t))]
