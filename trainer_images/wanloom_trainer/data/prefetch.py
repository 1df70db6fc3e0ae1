"""Loading the micro-batches of upcoming steps in the background, in plan order.

``PlanPrefetcher(dataset, plans, rank, depth)`` walks ``plans`` (``adaptiveload.StepPlan`` objects, step after
step), loads the micro-batches of the step being consumed, of the next step, and more up to ``depth`` beyond
the current step in worker threads, and hands them out in order::

    for step in prefetcher:                 # StepData, one per plan
        for mb in step:                     # LoadedMicroBatch, waits only if its load is still running
            loss += step_fn(mb.batch.latents, mb.batch.text_embeds, mb.timesteps, mb.weights, mb.expert)

A packed micro-batch (``MicroBatch.packed``) loads each sample at its own bucket shape: ``batch`` is then a tuple
of single-row batches, one per planned sample in row order (a dummy: one placeholder row).

Determinism: the loader adds no randomness; the rows are exactly the plan's, and plans are a pure function of
(seed, step). So the loader's checkpoint state is the next step to run plus the bad-sample count
(``state_dict``); on resume the trainer rebuilds its plan iterator from that step and the prefetcher checks that
the first plan it gets is that step.
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from wanloom_trainer.data.reader import LatentBatch, LatentDataset


def default_workers(cpus: int | None = None) -> int:
    """Loading threads: the training loop keeps one core; loading is CPU work (decode, checks, row building), so
    threads beyond the other cores only contend for them and the GIL. Two at most: remote reads overlap in the
    dataset's own reader pool."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(2, cpus - 1))


# Placeholder rows have no planned timestep; any valid t works because their loss weight is 0.
_PLACEHOLDER_T = 0.0


@dataclass(frozen=True)
class LoadedMicroBatch:
    """One of this rank's micro-batches with its rows loaded.

    Attributes:
        step: global step; index: position among this rank's micro-batches of the step.
        micro_batch: the plan's ``MicroBatch`` (sample_ids, latent_shape, expert, timesteps, weights).
        batch: the loaded rows (``LatentBatch``; row j stands for planned row ``batch.positions[j]``); packed: one
            single-row ``LatentBatch`` per planned sample, in row order.
        rows: what the prefetcher's ``prepare`` made of it in the loading thread (None without one).
    """

    step: int
    index: int
    micro_batch: Any
    batch: LatentBatch | tuple[LatentBatch, ...]
    rows: Any = None

    @property
    def packed(self) -> bool:
        return isinstance(self.batch, tuple)

    @property
    def expert(self) -> int:
        return int(self.micro_batch.expert)

    @property
    def timesteps(self) -> np.ndarray:
        """float32 [b]: the planned t of each loaded row (packed: of each segment)."""
        if self.packed:
            return np.asarray(self.micro_batch.timesteps or (_PLACEHOLDER_T,) * len(self.batch), dtype=np.float32)
        return self._per_row(self.micro_batch.timesteps, _PLACEHOLDER_T)

    @property
    def weights(self) -> np.ndarray:
        """float32 [b]: the planned loss weight of each row (packed: of each segment), 0 where the row is not valid
        (padding, bad sample)."""
        if self.packed:  # a dummy's placeholder segment has no planned weight
            valid = np.array([bool(seg.valid[0]) for seg in self.batch])
            planned = np.asarray(self.micro_batch.weights or (0.0,) * len(valid), dtype=np.float32)
            return np.where(valid, planned, 0.0).astype(np.float32)
        return np.where(self.batch.valid, self._per_row(self.micro_batch.weights, 0.0), 0.0).astype(np.float32)

    @property
    def skipped(self) -> int:
        """Planned samples of this micro-batch that could not be loaded (their rows carry weight 0 or are gone)."""
        planned = int(np.count_nonzero(np.asarray(self.micro_batch.weights) > 0))
        return planned - int(np.count_nonzero(self.weights > 0))

    def _per_row(self, planned: Any, fill: float) -> np.ndarray:
        values = np.asarray(planned, dtype=np.float32)
        pos = self.batch.positions
        out = np.full(len(pos), fill, dtype=np.float32)
        out[pos >= 0] = values[pos[pos >= 0]]
        return out


def _holds(ranks: Any, rank: int) -> bool:
    """A StepPlan lists every rank; a LocalPlan maps this process's ranks."""
    return rank in ranks if isinstance(ranks, Mapping) else 0 <= rank < len(ranks)


class StepData:
    """This rank's micro-batches of one step; iterate once, in order."""

    def __init__(self, owner: PlanPrefetcher, plan: Any) -> None:
        self._owner, self.plan = owner, plan
        self.step = int(plan.step)
        self.micro_batches = tuple(plan.ranks[owner.rank].micro_batches)

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __iter__(self) -> Iterator[LoadedMicroBatch]:
        for i in range(len(self.micro_batches)):
            yield self._owner._take(self.step, i)
        self._owner._finished(self.step)


class PlanPrefetcher:
    """Background loading of one rank's planned micro-batches.

    Args:
        dataset: the opened dataset.
        plans: StepPlan or LocalPlan objects in step order (e.g. ``planner.plan_local(s, ranks) for s in …``).
        rank: this process's data-parallel rank (index into ``plan.ranks``).
        depth: micro-batches kept loading beyond the step being consumed (``spec.data.prefetch``), and never less
            than the whole next step: the loop takes a step's micro-batches together, so one still unsubmitted
            when its step begins is waited for; 0 loads each when it is asked for.
        workers: threads loading micro-batches (default ``default_workers()``; each load fans out over the
            dataset's own reader threads when storage is remote).
        prepare: run on each loaded micro-batch in its loading thread (the trainer builds its rows there: noise,
            loss weights, packing), so the training loop only picks them up; the result is ``.rows``.
    """

    def __init__(
        self,
        dataset: LatentDataset,
        plans: Iterable[Any],
        rank: int,
        depth: int = 4,
        workers: int | None = None,
        prepare: Callable[[LoadedMicroBatch], Any] | None = None,
    ):
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if depth < 0:
            raise ValueError(f"data.prefetch must be >= 0, got {depth}")
        self.dataset, self.rank, self.depth, self._prepare = dataset, rank, depth, prepare
        self._plans = iter(plans)
        self._ready_plans: deque[Any] = deque()  # plans pulled for prefetching but not yet handed out
        self._work = self._work_items()
        self._unsubmitted: deque[tuple[int, int, Any]] = deque()  # pulled from the plans, not loading yet
        self._queue: deque[tuple[int, int, Future[LoadedMicroBatch]]] = deque()  # loading or loaded, in plan order
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, workers or default_workers()), thread_name_prefix="wanloom-prefetch"
        )
        self._next_step: int | None = None
        self._expect_step: int | None = None
        self._consuming: int | None = None  # the step last handed out

    def _work_items(self) -> Iterator[tuple[int, int, Any]]:
        for plan in self._plans:
            if self._expect_step is not None and plan.step != self._expect_step:
                raise ValueError(
                    f"the plans start at step {plan.step} but the loader state resumes at step {self._expect_step}; "
                    "build the plan iterator from the checkpoint's step"
                )
            self._expect_step = None
            if not _holds(plan.ranks, self.rank):
                raise ValueError(f"rank {self.rank} is not in step {plan.step}'s plan")
            self._ready_plans.append(plan)
            for i, mb in enumerate(plan.ranks[self.rank].micro_batches):
                yield int(plan.step), i, mb

    def _pull(self) -> bool:
        """Advance the plans by one micro-batch without loading it (to learn what comes next)."""
        item = next(self._work, None)
        if item is not None:
            self._unsubmitted.append(item)
        return item is not None

    def _submit_one(self) -> bool:
        if not self._unsubmitted and not self._pull():
            return False
        step, i, mb = self._unsubmitted.popleft()
        self._queue.append((step, i, self._pool.submit(self._load, step, i, mb)))
        return True

    def _load(self, step: int, i: int, mb: Any) -> LoadedMicroBatch:
        loaded = LoadedMicroBatch(step, i, mb, self._read(mb))
        return loaded if self._prepare is None else dataclasses.replace(loaded, rows=self._prepare(loaded))

    def _read(self, mb: Any) -> LatentBatch | tuple[LatentBatch, ...]:
        if not mb.sample_ids:
            placeholder = self.dataset.placeholder(tuple(mb.latent_shape))
            return (placeholder,) if mb.packed is not None else placeholder
        if mb.packed is not None:
            return tuple(self.dataset.load_each(mb.sample_ids, mb.packed.sample_shapes))
        return self.dataset.load(mb.sample_ids, tuple(mb.latent_shape))

    def _top_up(self) -> None:
        """Submit the rest of the step being consumed, all of the next one, and more up to ``depth`` beyond."""
        if self.depth == 0 or self._consuming is None:
            return
        ahead = sum(1 for step, _, _ in self._queue if step > self._consuming)
        while self._unsubmitted or self._pull():
            step = self._unsubmitted[0][0]
            if step > self._consuming + 1 and ahead >= self.depth:
                return
            ahead += step > self._consuming
            self._submit_one()

    def _take(self, step: int, i: int) -> LoadedMicroBatch:
        """The loaded micro-batch (step, i); micro-batches of steps the caller abandoned are discarded."""
        while True:
            if not self._queue and not self._submit_one():
                raise RuntimeError(f"the plans ran out before step {step} micro-batch {i}")
            got_step, got_i, future = self._queue.popleft()
            if (got_step, got_i) == (step, i):
                break
            if (got_step, got_i) > (step, i):
                raise RuntimeError(f"prefetch order broken: wanted step {step} micro-batch {i}, got {got_step}/{got_i}")
            future.cancel()
        self._top_up()
        return future.result()

    def _finished(self, step: int) -> None:
        self._next_step = step + 1

    def __iter__(self) -> Iterator[StepData]:
        while True:
            while not self._ready_plans and self._pull():
                pass
            if not self._ready_plans:
                return
            plan = self._ready_plans.popleft()
            self._consuming = int(plan.step)
            self._top_up()
            yield StepData(self, plan)

    def state_dict(self) -> dict[str, Any]:
        """Position to resume from: the step after the last fully consumed one, plus the dataset's skip count."""
        return {"next_step": self._next_step, "dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before iterating; the plans passed in must then start at ``state['next_step']``."""
        if self._queue or self._ready_plans or self._unsubmitted:
            raise RuntimeError("load_state_dict must be called before the prefetcher starts loading")
        self._next_step = self._expect_step = state.get("next_step")
        self.dataset.load_state_dict(state.get("dataset", {}))

    def close(self) -> None:
        for _, _, future in self._queue:
            future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> PlanPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
