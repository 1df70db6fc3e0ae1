"""Plans computed ahead, in a thread of the data process (``data_process.py``).

Planning a step (``Planner.plan_local``) is a pure function of the step, so the plans of the next steps can be made
while the current one trains. ``PlansAhead`` runs the plan iterator in one daemon thread and keeps up to ``depth``
finished plans queued; the loaders only wait when planning falls behind them.
Errors raised while planning surface in the loop at the step they belong to. ``CostSchedule`` names the cost model
each step is planned with when the run refits it online.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

_DONE = object()


class PlansAhead(Iterator[Any]):
    """Iterate ``plans`` with a background thread ``depth`` items ahead; ``close`` stops it."""

    def __init__(self, plans: Iterable[Any], depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._queue: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(iter(plans),), name="wanloom-plan", daemon=True)
        self._thread.start()

    def _fill(self, plans: Iterator[Any]) -> None:
        try:
            for plan in plans:
                if not self._put((plan, None)):
                    return
            self._put((_DONE, None))
        except BaseException as exc:
            self._put((_DONE, exc))

    def _put(self, item: tuple[Any, BaseException | None]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> Any:
        plan, error = self._queue.get()
        if error is not None:
            raise error
        if plan is _DONE:
            self._queue.put((_DONE, None))  # later calls end too
            raise StopIteration
        return plan

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class CostSchedule:
    """Which cost model plans each step: the run's initial model, then each accepted online refit from the step it
    was decided for on (``adaptiveload.cost.refit``).

    The loop decides after step j (the same decision on every process: process 0's, broadcast) and a change takes
    effect at step j + ``lag``. The planning thread asks for step s only once every decision that could apply to it
    has been made, i.e. once step s − lag is done; with ``lag`` beyond the planning and prefetch depth it never
    waits. ``changes`` (from_step, model) come from a checkpoint, so a resumed run plans its next steps with the
    model the interrupted run had chosen for them. Without refits (``lag`` None) nothing ever waits.

    The planner plans ``window`` steps at once (``Planner.window_steps``): a step is planned with the model in force
    at its window's first step, so a change takes effect at the first window boundary from its step on and a window
    is never split between two models (its samples are dealt to its steps by the plan).
    """

    def __init__(
        self,
        initial: Any,
        *,
        start: int,
        lag: int | None,
        changes: Iterable[tuple[int, Any]] = (),
        window: int = 1,
    ) -> None:
        if lag is not None and lag < 1:
            raise ValueError(f"lag must be >= 1, got {lag}")
        self.lag, self.window = lag, window
        self._changes = [(0, initial), *sorted(changes, key=lambda c: c[0])]
        self._done = start - 1  # last step whose decision is known
        self._cond = threading.Condition()

    def model_at(self, step: int) -> Any:
        """The model that plans ``step``; waits (planning thread) until the decisions for it are made."""
        with self._cond:
            if self.lag is not None:
                self._cond.wait_for(lambda: self._done >= step - self.lag)
            planned_at = step - step % self.window
            return next(model for first, model in reversed(self._changes) if first <= planned_at)

    def decide(self, step: int, model: Any | None) -> None:
        """Step ``step`` is done; ``model`` (or None: no change) plans from step + lag on."""
        with self._cond:
            if model is not None:
                if self.lag is None:
                    raise ValueError("this run does not refit its cost model: no lag to apply a change after")
                self._changes.append((step + self.lag, model))
            self._done = max(self._done, step)
            self._cond.notify_all()

    def close(self) -> None:
        """Release a planning thread waiting for decisions that will not come (the loop has ended)."""
        with self._cond:
            self._done = float("inf")  # type: ignore[assignment]
            self._cond.notify_all()

    def changes(self) -> list[tuple[int, Any]]:
        """The refits decided so far, (from_step, model), for the checkpoint."""
        with self._cond:
            return list(self._changes[1:])
