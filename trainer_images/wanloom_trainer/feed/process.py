"""The run's data pipeline — planning, loading, row building — in a process of its own.

A training step's Python (a tiny model on CPU, the eager dispatch of a GPU step) holds the GIL nearly all the
time. Planning and loading threads in the same process take turns with it, so their work lands on the training
thread's time (measured in docs/benchmarks.md, "Step overhead"). So the pipeline that used to run in
the trainer's threads — ``PlansAhead`` (the AdaptiveLoad planner with the run's cost schedule), one
``PlanPrefetcher`` per local rank and ``step_rows`` (noise, loss weights, packing) — runs in a spawned child. The
training process receives, per step, the plan and each local rank's micro-batches as rows ready to train on.

Messages (``multiprocessing`` queues):

- child → ``steps`` (one step ahead): ``("step", plan, rows per rank, dataset state)``, ``("error", exception)``
  or ``("end",)``;
- child → ``events``: ``("skip", args, kwargs)`` and ``("outage", seconds)`` for the parent's metrics, and the
  child's log records (``logging.LogRecord``), handled by the parent's loggers;
- parent → ``control``: ``("decide", step, cost model as dict or None)`` after each step of a run that refits its
  cost model online (``CostSchedule.decide``), and ``("stop",)``.

The child ignores SIGINT and SIGTERM: the training process decides when loading stops (after its checkpoint), or
its death does (a SIGKILL sends no stop; the child sees the parent gone within ``_POLL_S``). A
stop the training process is asked for while it waits for a step (``stop_requested``) ends the iteration: a
step that never comes (planning that cannot finish, storage that hangs) cannot keep a run from stopping.
"""

from __future__ import annotations

import itertools
import logging
import logging.handlers
import multiprocessing
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from wanloom_trainer.config.train_config import TrainConfig

log = logging.getLogger(__name__)

PLAN_DEPTH = 2  # plans made ahead of the prefetchers (PlansAhead)
STEPS_AHEAD = 2  # steps the child can have ready before the loop takes them: one queued, one waiting for room
_POLL_S = 0.1  # how often a blocked queue operation looks for a stop or a dead peer
_STOP_TIMEOUT_S = 30.0  # how long close() waits for the child to finish its loads before killing it


@dataclass(frozen=True)
class PreparedMicroBatch:
    """One rank's micro-batch as the step reads it: its expert, the planned samples that could not be loaded, and
    its rows (``RankRows`` or ``PackedRows``)."""

    expert: int
    skipped: int
    rows: Any


@dataclass(frozen=True)
class PreparedStep:
    """One rank's share of a step: the plan (the same for every local rank) and its micro-batches in order."""

    plan: Any
    micro_batches: tuple[PreparedMicroBatch, ...]

    def __iter__(self) -> Iterator[PreparedMicroBatch]:
        return iter(self.micro_batches)


@dataclass(frozen=True)
class Pipeline:
    """What the child plans and loads: the run's configuration, this process's data-parallel ranks, the first step,
    the planner's layout (``run.LAYOUTS``), the cost schedule's lag (None: no online refits), the refits decided
    before ``start`` (``[from_step, model.to_dict()]``, from the checkpoint) and the loader's checkpointed state
    (``DataProcess.state_dict`` of the interrupted run, or {})."""

    config: TrainConfig
    ranks: list[int]
    start: int
    layout: str
    lag: int | None
    changes: list[Any]
    data_state: dict[str, Any]


class DataProcess:
    """Start ``pipeline`` in a child; iterate the steps (a tuple of ``PreparedStep``, one per local rank);
    ``decide`` forwards cost-model decisions; ``state_dict`` is the loader's checkpoint state. ``on_skip`` and
    ``on_outage`` are the parent's metrics hooks for skipped samples and storage outages."""

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        on_skip: Callable[..., Any],
        on_outage: Callable[[float], Any],
        stop_requested: Callable[[], bool] = lambda: False,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds framework threads
        self._steps: Any = ctx.Queue(maxsize=1)
        self._events: Any = ctx.Queue()
        self._control: Any = ctx.Queue()
        self._on_skip, self._on_outage = on_skip, on_outage
        self._state: dict[str, Any] = {"next_step": pipeline.start, "dataset": pipeline.data_state.get("dataset", {})}
        self._ended = False
        self._stop_requested = stop_requested
        self.interrupted = False  # the iteration ended because a stop was requested while waiting for a step
        self.wait_s = 0.0  # how long the step last handed out was waited for
        args = (pipeline, logging.getLogger().getEffectiveLevel(), self._steps, self._events, self._control)
        self._process = ctx.Process(target=_serve, args=args, name="wanloom-data", daemon=True)
        self._process.start()
        # The child holds its own copies of the write ends now. Closing ours makes a child that dies mid-message
        # an end of file here; with ours open, reading its half-written step would wait forever.
        for q in (self._steps, self._events):
            q._writer.close()

    def __iter__(self) -> Iterator[tuple[PreparedStep, ...]]:
        while not self._ended:
            started = time.perf_counter()
            message = self._receive()
            self.wait_s = time.perf_counter() - started
            self._drain_events()
            if message[0] in ("end", "interrupted"):
                self._ended = True
                self.interrupted = message[0] == "interrupted"
                return
            if message[0] == "error":
                self._ended = True
                raise message[1]
            _, plan, per_rank, dataset_state = message
            self._state = {"next_step": int(plan.step) + 1, "dataset": dataset_state}
            yield tuple(PreparedStep(plan, tuple(mbs)) for mbs in per_rank)

    def _receive(self) -> tuple[Any, ...]:
        while True:
            try:
                return self._steps.get(timeout=_POLL_S)
            except queue.Empty:
                self._drain_events()
                if self._stop_requested():
                    return ("interrupted",)
                if self._process.is_alive():
                    continue
            except (EOFError, OSError):  # it died, perhaps in the middle of a message
                self._process.join(_STOP_TIMEOUT_S)
            self._ended = True
            raise RuntimeError(
                f"the data process (planning and loading) exited with code {self._process.exitcode} "
                "without a word; see its log above"
            )

    def _discard_steps(self) -> None:
        while True:
            try:
                self._steps.get_nowait()
            except (queue.Empty, EOFError, OSError):
                return

    def _drain_events(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except (queue.Empty, EOFError, OSError):  # none waiting, or the child has exited
                return
            if isinstance(event, logging.LogRecord):
                logging.getLogger(event.name).handle(event)
            elif event[0] == "skip":
                self._on_skip(*event[1], **event[2])
            else:
                self._on_outage(event[1])

    def decide(self, step: int, model: Any | None) -> None:
        """The loop's cost-model decision after ``step`` (``CostSchedule.decide``), for the child's planner."""
        self._control.put(("decide", step, None if model is None else model.to_dict()))

    def state_dict(self) -> dict[str, Any]:
        """The loader's position: the step after the last one handed out, and the dataset's skip counts."""
        return dict(self._state)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the child once its running loads finish (killed after ``timeout_s``, default ``_STOP_TIMEOUT_S``),
        keeping its events."""
        timeout_s = _STOP_TIMEOUT_S if timeout_s is None else timeout_s
        self._control.put(("stop",))
        deadline = time.monotonic() + timeout_s
        while self._process.is_alive() and time.monotonic() < deadline:
            self._drain_events()
            self._discard_steps()  # a child that finished first flushes its last steps before it can exit
            self._process.join(_POLL_S)
        if self._process.is_alive():
            log.warning("the data process did not stop within %.0f s; killing it", timeout_s)
            self._process.kill()
            self._process.join()
        self._drain_events()
        for q in (self._steps, self._events, self._control):
            q.close()
            q.cancel_join_thread()


# -- the child ---------------------------------------------------------------------------------------------------


def _serve(pipeline: Pipeline, log_level: int, steps: Any, events: Any, control: Any) -> None:
    from wanloom_trainer.adaptiveload.cost.cost_model import cost_model_from_dict
    from wanloom_trainer.data import PlanPrefetcher, open_dataset
    from wanloom_trainer.feed.inputs import make_planner, step_rows
    from wanloom_trainer.feed.plan_ahead import CostSchedule, PlansAhead

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(events)]
    root.setLevel(log_level)
    stop = threading.Event()
    closers: list[Callable[[], Any]] = []
    config, ranks, start = pipeline.config, pipeline.ranks, pipeline.start
    try:
        dataset = open_dataset(
            config.data.uri,
            config.data.index,
            max_bad_samples=config.data.max_bad_samples,
            on_skip=lambda *args, **kwargs: events.put(("skip", args, kwargs)),
            storage_outage_s=config.data.storage_outage_seconds,
            on_outage=lambda seconds: events.put(("outage", seconds)),
        )
        closers.append(dataset.close)
        planner = make_planner(config, dataset.sample_shapes(), layout=pipeline.layout)
        restored = [(int(first), cost_model_from_dict(doc)) for first, doc in pipeline.changes]
        schedule = CostSchedule(
            planner.cost_model, start=start, lag=pipeline.lag, changes=restored, window=planner.window_steps
        )
        closers.append(schedule.close)
        listener = threading.Thread(target=_listen, args=(control, schedule, stop), name="wanloom-data-control")
        listener.start()
        plans = PlansAhead(_plans(planner, schedule, start, config.steps, ranks), depth=PLAN_DEPTH)
        closers.append(plans.close)
        copies = itertools.tee(plans, len(ranks)) if len(ranks) > 1 else (plans,)
        prepare = step_rows(config, dataset.empty_prompt() if config.caption_dropout > 0 else None)
        prefetchers = [PlanPrefetcher(dataset, p, r, config.data.prefetch, prepare=prepare)
                       for p, r in zip(copies, ranks, strict=True)]  # fmt: skip
        closers.extend(p.close for p in prefetchers)
        for prefetcher in prefetchers:
            prefetcher.load_state_dict({"next_step": start, "dataset": pipeline.data_state.get("dataset", {})})
        for step_data in zip(*prefetchers, strict=True):
            per_rank = [[PreparedMicroBatch(mb.expert, mb.skipped, mb.rows) for mb in sd] for sd in step_data]
            if not _put(steps, ("step", step_data[0].plan, per_rank, dataset.state_dict()), stop):
                return
        _put(steps, ("end",), stop)
    except BaseException as exc:  # the parent raises it at the step it belongs to
        exc.add_note(f"(raised in the data process:\n{''.join(traceback.format_exception(exc)).rstrip()})")
        _put(steps, ("error", _portable(exc)), stop)
    finally:
        if stop.is_set():  # the parent stopped reading: a step still buffered must not keep this process alive
            steps.cancel_join_thread()
        stop.set()
        for close in reversed(closers):
            close()


def _plans(planner: Any, schedule: Any, start: int, steps: int, ranks: list[int]) -> Iterator[Any]:
    """The local ranks' plans from ``start`` on, each with the cost model the schedule names for its step."""
    for step in range(start, steps):
        model = schedule.model_at(step)
        if model is not planner.cost_model:
            planner = planner.with_cost_model(model)
        yield planner.plan_local(step, ranks)


def _listen(control: Any, schedule: Any, stop: threading.Event) -> None:
    from wanloom_trainer.adaptiveload.cost.cost_model import cost_model_from_dict

    parent = multiprocessing.parent_process()
    while not stop.is_set():
        try:
            message = control.get(timeout=_POLL_S)
        except queue.Empty:
            if parent is None or parent.is_alive():
                continue
            message = ("stop",)  # the parent was killed (SIGKILL, the OOM killer): no stop will come
        if message[0] == "stop":
            stop.set()
            schedule.close()  # a planner waiting for decisions that will not come
            return
        _, step, doc = message
        schedule.decide(step, None if doc is None else cost_model_from_dict(doc))


def _put(q: Any, item: tuple[Any, ...], stop: threading.Event) -> bool:
    """Put ``item``, waiting for room unless the parent has asked to stop (False then)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (its type and message reach the parent), else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
