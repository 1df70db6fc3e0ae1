"""Plans computed ahead, off the training loop's thread.

Planning a step (``Planner.plan_local``) is a pure function of the step, so the plans of the next steps can be made
while the current one trains. ``PlansAhead`` runs the plan iterator in one daemon thread and keeps up to ``depth``
finished plans queued; the loop only waits when planning falls behind training (``waited_s`` adds that up).
Errors raised while planning surface in the loop at the step they belong to.
"""

from __future__ import annotations

import queue
import threading
import time
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
        self.waited_s = 0.0
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
        started = time.perf_counter()
        plan, error = self._queue.get()
        self.waited_s += time.perf_counter() - started
        if error is not None:
            raise error
        if plan is _DONE:
            self._queue.put((_DONE, None))  # later calls end too
            raise StopIteration
        return plan

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
