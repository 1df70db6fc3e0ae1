"""The training driver, backend-agnostic: the same phases run the JAX and the PyTorch trainer.

    1. backend      framework, devices, process group (``jax.distributed`` / ``torch.distributed``)
    2. data         generate the synthetic dataset if asked (process 0), open the dataset and its shape index
    3. plans        the AdaptiveLoad planner: step s's plan is a pure function of (seed, s) and its cost model
    4. state        restore the latest checkpoint, or initialise both experts and their optimizers
    5. loop         plan → prefetched micro-batches → backend step → metrics/log/progress → cost refit →
                    checkpoint cadence
    6. finish       final checkpoint, loss-curve plot

Everything random (data order, timesteps, experts, noise) is keyed by (seed, step), so a checkpoint needs only the
parameters, the optimizer states, the next step, the loader's skip count and the cost refits decided so far: a
resumed run replays exactly what the uninterrupted run would have done.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wanloom_trainer.adaptiveload.cost.refit import OnlineRefit, decode_model, encode_model
from wanloom_trainer.backends.interface import Backend, StepInputs
from wanloom_trainer.config.train_config import TrainConfig
from wanloom_trainer.data.storage import RetryPolicy, open_storage
from wanloom_trainer.evaluation.validation import Validator
from wanloom_trainer.feed.inputs import make_planner, renormalised, step_slots
from wanloom_trainer.feed.plan_ahead import CostSchedule
from wanloom_trainer.feed.process import PLAN_DEPTH, STEPS_AHEAD, DataProcess, Pipeline
from wanloom_trainer.metrics.records import StepLog
from wanloom_trainer.train.loss_log import plot_losses, read_events, read_log, read_validation
from wanloom_trainer.train.reporting import Reporter, start_exporter, step_log
from wanloom_trainer.train.saves import Saves
from wanloom_trainer.train.schedule import Segment, expert_lr_scales, learning_rates, resumed_segment

if TYPE_CHECKING:
    from wanloom_trainer.adaptiveload.plan import LocalPlan
    from wanloom_trainer.adaptiveload.planner import Planner
    from wanloom_trainer.backends.interface import StepOutputs
    from wanloom_trainer.data.reader import LatentDataset

log = logging.getLogger(__name__)
LAYOUTS = {"jax": "spmd", "torch": "per-rank"}  # JAX runs one SPMD program; torch ranks run their own shapes
REPORT_REFIT_EVERY = 50  # steps between report-only refits (spec.adaptiveLoad.refitEverySteps 0)
StepHook = Callable[[StepLog], None]


@dataclass
class RunResult:
    start_step: int
    next_step: int
    records: list[StepLog] = field(default_factory=list)  # steps run by this call (process 0 only)
    checkpoints: list[int] = field(default_factory=list)  # committed, in order
    plot: Path | None = None
    stopped_by: str | None = None  # the signal that ended the run early (after a committed checkpoint)
    validations: list[Any] = field(default_factory=list)  # validation.ValidationResult, in order
    exported: Any = None  # export.layouts.Exported of spec.export, once written (process 0)


class StopRequest:
    """SIGTERM (preemption, maintenance, ``kubectl delete``) and a first Ctrl-C (SIGINT) ask the loop to checkpoint
    and stop after the current step; the handler only sets a flag, the loop does the work on the main thread. A
    second Ctrl-C stops at once, without a checkpoint (``KeyboardInterrupt``)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: str | None = None

    def __call__(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT:
            if self.signal is not None:
                raise KeyboardInterrupt
            log.warning("Ctrl-C: checkpointing and stopping after this step (Ctrl-C again stops at once, unsaved)")
        self.signal = self.signal or signal.Signals(signum).name

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield self
            return
        previous = {s: signal.signal(s, self) for s in self.SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def predicted_busy(plan: LocalPlan) -> float:
    """The cost model's busy time of this process's ranks (``LocalPlan``): per slot its heaviest local micro-batch
    (the ranks of one process run together), plus the per-call overhead of every slot."""
    ranks = list(plan.ranks.values())
    slots = zip(*(r.micro_batches for r in ranks), strict=True)
    compute = sum(max(mb.predicted_cost for mb in slot) for slot in slots)
    return compute + ranks[0].predicted_cost - sum(mb.predicted_cost for mb in ranks[0].micro_batches)


def make_backend(config: TrainConfig) -> Backend:
    if config.backend == "torch":
        from wanloom_trainer.backends.torch.backend import TorchBackend

        return TorchBackend(config.backend_config)
    from wanloom_trainer.backends.jax.backend import JaxBackend

    return JaxBackend(config.backend_config)


def run(
    config: TrainConfig, *, backend: Backend | None = None, progress: bool = True, on_step: StepHook | None = None
) -> RunResult:
    """Train ``config`` to ``config.steps`` (resuming from the latest checkpoint); ``on_step`` sees every step."""
    backend = backend if backend is not None else make_backend(config)  # 1. backend
    with ExitStack() as stack:
        stack.enter_context(_closing(backend.close, "the backend", on_error=False))
        metrics = start_exporter(config, backend.process_index)  # first: the loader reports skipped samples
        stack.enter_context(_closing(metrics.close, "the metrics exporter"))
        metrics.record_expected_shares(config.routing.expected_shares())
        dataset = open_data(config, backend)  # 2. data
        stack.enter_context(_closing(dataset.close, "the dataset"))
        planner = make_planner(config, dataset.sample_shapes(), layout=LAYOUTS[backend.name])  # 3. plans
        state, start, meta = initial_state(config, backend)  # 4. state
        if meta:  # resumed: the checkpoint gauges describe the checkpoint until the run saves its own
            metrics.record_restored_checkpoint(start, meta.get("saved_at"))
        reporter = Reporter(
            config, metrics=metrics, process_index=backend.process_index, start_step=start, progress=progress
        )
        stack.enter_context(_closing(reporter.close, "the reporter"))
        result = RunResult(start_step=start, next_step=start)
        stop = stack.enter_context(StopRequest().installed())
        loop = _Loop(config, backend, planner, reporter, result, on_step, stop)
        if (evaluation := config.evaluation_config) is not None:
            loop.validator = Validator(evaluation, backend, dataset, loop.ranks)
        state = loop.run(state, start, meta)  # 5. loop
        finish(config, backend, result, reporter)  # 6. finish
    return result


@contextlib.contextmanager
def _closing(close: Callable[[], object], what: str, *, on_error: bool = True) -> Iterator[None]:
    """``close()`` on the way out. When the run is failing, the error on its way out is what the user must see: a
    close that fails then is logged, not raised in its place; and with ``on_error=False`` it is not called at all
    (the backend's close waits for the checkpoint in flight, which a failed run — storage gone, a peer gone —
    may never finish; the process exits right after)."""
    try:
        yield
    except BaseException:
        if on_error:
            try:
                close()
            except Exception as exc:
                log.warning("closing %s after the run failed also failed: %s", what, exc)
        else:
            log.warning("the run failed: not waiting for %s to close", what)
        raise
    close()


def open_data(config: TrainConfig, backend: Backend) -> LatentDataset:
    """Process 0 generates the synthetic dataset if asked; every process then opens it (the planner reads its
    shapes here; the data process opens its own to load)."""
    from wanloom_trainer.data import ensure_synthetic, open_dataset

    if backend.process_index == 0:
        ensure_synthetic(config.data, config.model.wan, progress=False)
    backend.gather_floats(0.0)  # a barrier: nobody opens the index before process 0 has written it
    return open_dataset(
        config.data.uri,
        config.data.index,
        max_bad_samples=config.data.max_bad_samples,
        storage_outage_s=config.data.storage_outage_seconds,
    )


def export_final(config: TrainConfig) -> Any:
    """Write the last checkpoint in the layout ``spec.export`` asks for; an error fails the run (the TrainingJob
    only succeeds with its model written)."""
    from wanloom_trainer.export.layouts import export_from

    spec = config.export
    exported = export_from(
        config.checkpoint.uri, config.model.wan, step=config.steps, ema=spec.ema, fmt=spec.format, out=spec.uri,
        name=config.job_name, dtype=spec.dtype, lora=config.lora, merge=spec.merge, weights=config.model.weights,
    )  # fmt: skip
    log.info("exported the %s weights of step %d (%s, %s) to %s", "EMA" if spec.ema else "trained", exported.step,
             spec.format, spec.dtype, spec.uri)  # fmt: skip
    return exported


def initial_state(config: TrainConfig, backend: Backend) -> tuple[Any, int, dict[str, Any]]:
    """(state, first step to run, checkpoint record): the latest checkpoint if any, else a fresh state."""
    restored = backend.restore()
    if restored is None:
        return backend.init_state(), 0, {}
    meta = dict(restored.meta)
    for key, want in (("seed", config.seed), ("variant", config.model.variant)):
        if key in meta and meta[key] != want:
            raise ValueError(
                f"checkpoint at step {restored.next_step} in {config.checkpoint.uri} was written with {key}="
                f"{meta[key]!r}, but the TrainingJob has {want!r}; use a new spec.training.checkpoint.uri"
            )
    log.info("resuming from the checkpoint of step %d", restored.next_step)
    return restored.state, restored.next_step, meta


class _Loop:
    """Phase 5, one method per concern."""

    def __init__(
        self,
        config: TrainConfig,
        backend: Backend,
        planner: Planner,
        reporter: Reporter,
        result: RunResult,
        on_step: StepHook | None,
        stop: StopRequest | None = None,
    ) -> None:
        self.config, self.backend, self.planner = config, backend, planner
        self.reporter, self.result, self.on_step = reporter, result, on_step
        self.stop = stop or StopRequest()
        uri = config.checkpoint.uri
        probe = (lambda: open_storage(uri, RetryPolicy(attempts=3)).exists(".wanloom-probe")) if uri else None
        self.saves = Saves(
            backend, str(uri), config.data.storage_outage_seconds, self._committed,
            on_outage=reporter.metrics.record_storage_outage, probe=probe,
        )  # fmt: skip
        self.ranks = list(backend.local_ranks(config.parallel.batch_ranks))
        self.lr_scales = expert_lr_scales(config.optimizer, config.routing, config.model.num_experts)
        self.data: DataProcess | None = None
        al = config.adaptive_load
        self.refit = OnlineRefit(config.model.wan.name, al.cost_model)
        self.refit_every = al.refit_every_steps or REPORT_REFIT_EVERY
        # A change decided after step j plans step j + lag on: beyond every plan already made or prefetched,
        # and every step the data process has ready.
        self.refit_lag = PLAN_DEPTH + config.data.prefetch + 2 + STEPS_AHEAD if al.refit_every_steps else None
        self.schedule = CostSchedule(planner.cost_model, start=0, lag=None)
        self.lr_segment = Segment(config.steps)
        self._said_refit_waits = False
        self._last_step_end: float | None = None
        self.validator: Validator | None = None

    def run(self, state: Any, start: int, meta: dict[str, Any]) -> Any:
        from wanloom_trainer.adaptiveload.cost.cost_model import cost_model_from_dict

        self.lr_segment = self._lr_segment(meta, start)
        changes = meta.get("cost_models", [])
        restored = [(int(first), cost_model_from_dict(doc)) for first, doc in changes]
        self.schedule = CostSchedule(
            self.planner.cost_model, start=start, lag=self.refit_lag, changes=restored, window=self.planner.window_steps
        )
        # Planning, loading and row building run in a process of their own (feed/process.py).
        metrics = self.reporter.metrics
        pipeline = Pipeline(self.config, self.ranks, start, LAYOUTS[self.backend.name], self.refit_lag, changes,
                            meta.get("data", {}))  # fmt: skip
        self.data = DataProcess(
            pipeline, on_skip=metrics.record_skipped, on_outage=metrics.record_storage_outage,
            stop_requested=lambda: self.stop.signal is not None,
        )  # fmt: skip
        try:
            for step_data in self.data:
                state = self.step(state, step_data)
                if self._stop_requested():
                    self._stop(state)
                    break
            if self.data.interrupted:
                self._stop_waiting(state)
        finally:
            self.schedule.close()
            # A stop while waiting does not wait long for loads that may never finish.
            self.data.close(timeout_s=5.0 if self.data.interrupted else None)
        if self.result.stopped_by is None:  # a stop settled its own saves
            self._settle_saves(state)
        return state

    def _lr_segment(self, meta: dict[str, Any], start: int) -> Segment:
        """The learning-rate schedule from ``start`` on: the checkpoint's, re-laid when the run's length changed."""
        saved = Segment.from_dict(meta["lr_schedule"]) if "lr_schedule" in meta else None
        segment = resumed_segment(self.config.optimizer, saved, start, self.config.steps)
        if saved is not None and saved.total_steps != self.config.steps and self.backend.process_index == 0:
            rate = learning_rates(self.config.optimizer, (1.0,), start, self.config.steps, segment)[0]
            log.warning(
                "the run's length changed from %d to %d steps at step %d: the learning rate continues from %.3g "
                "and its %s decay is re-laid over steps %d..%d (docs/trainingjob.md, spec.training.steps)",
                saved.total_steps, self.config.steps, start, rate, self.config.optimizer.schedule, start,
                self.config.steps - 1,
            )  # fmt: skip
        return segment

    def _stop_requested(self) -> bool:
        """Every process stops at the same step: a SIGTERM seen by any process stops them all."""
        requested = self.stop.signal is not None
        if self.backend.process_count > 1:
            requested = max(self.backend.gather_floats(1.0 if requested else 0.0)) > 0
        return requested

    def _stop(self, state: Any) -> None:
        next_step = self.result.next_step
        pending = [self.saves.pending.next_step] if self.saves.pending is not None else []
        saved = [self.result.start_step, *self.result.checkpoints, *pending]  # the start: restored or fresh
        if self.config.checkpoint.uri is not None and next_step not in saved:
            self.save(state, next_step)
        self._settle_saves(state)
        self.result.stopped_by = self.stop.signal or "a peer's SIGTERM"
        log.warning("stopped by %s before step %d; last committed checkpoint: %s", self.result.stopped_by, next_step,
                    self.result.checkpoints[-1] if self.result.checkpoints else "none")  # fmt: skip

    def _stop_waiting(self, state: Any) -> None:
        """Stopped while waiting for the next step's data. One process alone is at a step boundary and checkpoints;
        of several, the others may be inside a step's collectives, so none saves (they stop on their own signal)."""
        if self.backend.process_count == 1:
            self._stop(state)
            return
        self.saves.settle(wait=True, agree=False)  # no collective: the others may be inside a step's
        self.result.stopped_by = self.stop.signal
        log.warning("stopped by %s while waiting for the data of step %d: no new checkpoint (last committed: %s)",
                    self.stop.signal, self.result.next_step,
                    self.result.checkpoints[-1] if self.result.checkpoints else "none")  # fmt: skip

    def _committed(self, next_step: int, seconds: float) -> None:
        self.reporter.checkpoint(next_step, seconds)
        self.result.checkpoints.append(next_step)

    def _settle_saves(self, state: Any) -> None:
        """Wait for the save in flight; a save storage lost is made again from ``state`` until one commits (or the
        outage outlasts spec.data.storageOutageSeconds)."""
        self.saves.settle(wait=True)
        while self.saves.resave:
            self.save(state, self.result.next_step)
            self.saves.settle(wait=True)

    def step(self, state: Any, step_data: tuple[Any, ...]) -> Any:
        cfg = self.config
        data_wait = self.data.wait_s if self.data is not None else 0.0  # receiving the step from the data process
        started = time.perf_counter() - data_wait  # the step began when the loop asked for its data
        plan = step_data[0].plan
        slots, skipped = step_slots(step_data, self.ranks, num_experts=cfg.model.num_experts)
        planned = plan.expert_samples[: cfg.model.num_experts]
        valid = self._valid_samples(planned, skipped)
        self.result.next_step = plan.step + 1
        if sum(valid) == 0:  # every sample of the step was skipped: no update, no loss, no throughput to report
            log.warning("step %d: all %d planned samples were skipped; the experts are not updated", plan.step,
                        plan.num_samples)  # fmt: skip
            self._last_step_end = time.perf_counter()
            return self._checkpoint(state, plan.step + 1)
        inputs = StepInputs(
            step=plan.step,
            slots=renormalised(slots, plan.num_samples / sum(valid)),
            num_samples=sum(valid),
            expert_samples=valid,
            learning_rates=learning_rates(cfg.optimizer, self.lr_scales, plan.step, cfg.steps, self.lr_segment),
        )
        state, out = self.backend.train_step(state, inputs)
        # A step's time runs from the previous step's end (the first: from its own start), so the reporting,
        # checkpoint bookkeeping and hand-over between steps count: tokens/s and MFU are not optimistic.
        now = time.perf_counter()
        wall, self._last_step_end = now - (self._last_step_end or started), now
        # [wall, busy, predicted busy, compiling] of every process: one collective.
        every = self.backend.gather_rows([wall, out.busy_seconds, predicted_busy(plan), out.compile_seconds])
        record = step_log(
            plan, out, config=cfg, step_time_s=float(every[:, 0].max()), data_wait_s=data_wait,
            num_devices=self.backend.num_devices, num_samples=sum(valid), compile_s=float(every[:, 3].max()),
        )  # fmt: skip
        if sum(valid) < plan.num_samples:
            record.extra["skipped_samples"] = plan.num_samples - sum(valid)
        self.reporter.step(record, plan, every, self.backend.num_devices)
        self._refit(plan, out)
        if self.backend.process_index == 0:
            self.result.records.append(record)
        if self.on_step is not None:
            self.on_step(record)
        state = self._checkpoint(state, plan.step + 1)
        self._validate(state, plan.step + 1)
        return state

    def _validate(self, state: Any, steps_done: int) -> None:
        """Score the held-out samples when due; the next step's time starts after it (reported apart)."""
        if self.validator is None or not self.validator.due(steps_done):
            return
        result = self.validator.run(state, steps_done)
        self.reporter.validation(result)
        self.result.validations.append(result)
        self._last_step_end = time.perf_counter()

    def _refit(self, plan: LocalPlan, out: StepOutputs) -> None:
        """Add the step's slot timings; every ``refit_every`` steps refit (process 0), report, and — with
        spec.adaptiveLoad.refitEverySteps — plan with an accepted fit on every process from step + lag."""
        compiled = out.slot_compiled or (False,) * len(out.slot_seconds)
        primary = self.backend.process_index == 0  # it alone fits; the others take its decision
        if primary and len(plan.slot_work) == len(out.slot_seconds):  # all samples skipped: no slots ran
            timed = [(w, t) for w, t, c in zip(plan.slot_work, out.slot_seconds, compiled, strict=True) if not c]
            self.refit.add([w for w, _ in timed], [t for _, t in timed])
        model = None
        if (plan.step + 1) % self.refit_every == 0:
            outcome = None
            if primary:
                outcome = self.refit.refit(self.schedule.model_at(plan.step))
                # Waiting for enough timings is said once, not at every refit (a job may never have 3 lengths).
                if outcome.verdict is not None or not self._said_refit_waits:
                    level = log.warning if outcome.verdict == "rejected" else log.info
                    level("step %d: %s", plan.step, outcome.message)
                    self._said_refit_waits |= outcome.verdict is None
                errors = {"in_use": outcome.in_use_error, "refit": outcome.heldout_error,
                          "analytic": outcome.analytic_heldout_error}  # fmt: skip
                self.reporter.metrics.record_cost_model(errors, outcome.verdict)
            if self.refit_lag is not None:  # every process takes process 0's decision
                encoded = self.backend.broadcast_floats(encode_model(outcome and outcome.model))
                model = decode_model(encoded, self.config.model.wan.name)
        if self.refit_lag is not None:
            self.schedule.decide(plan.step, model)
            if self.data is not None:
                self.data.decide(plan.step, model)

    def _checkpoint(self, state: Any, next_step: int) -> Any:
        """Report a save that has committed meanwhile; start the next one when due, or when storage lost the last."""
        self.saves.settle(wait=False)
        if self._checkpoint_due(next_step) or self.saves.resave:
            self.save(state, next_step)
        return state

    def _valid_samples(self, planned: tuple[int, ...], skipped: tuple[int, ...]) -> tuple[int, ...]:
        """Planned samples per expert minus the ones every process skipped (one collective per expert on
        multi-process jobs, so all processes normalise the loss and skip updates alike)."""
        if self.backend.process_count > 1:
            skipped = tuple(int(sum(self.backend.gather_floats(float(n)))) for n in skipped)
        return tuple(p - s for p, s in zip(planned, skipped, strict=True))

    def _checkpoint_due(self, next_step: int) -> bool:
        ckpt = self.config.checkpoint
        return ckpt.uri is not None and (next_step % ckpt.interval == 0 or next_step == self.config.steps)

    def save(self, state: Any, next_step: int) -> None:
        cfg = self.config
        meta = {
            "next_step": next_step,
            "seed": cfg.seed,
            "variant": cfg.model.variant,
            "trainingjob": cfg.job_name,
            "routing": {"mode": cfg.routing.mode, "boundary_ratio": cfg.routing.boundary_ratio},
            # Plans, timesteps and noise are functions of (seed, step): the loader's position is next_step.
            "data": self.data.state_dict() if self.data is not None else {"next_step": next_step},
            # Refits decided so far: the steps after next_step are planned with the models chosen for them.
            "cost_models": [[first, model.to_dict()] for first, model in self.schedule.changes()],
            # The learning-rate schedule the next steps follow (a changed run length re-lays its decay).
            "lr_schedule": self.lr_segment.to_dict(),
            "saved_at": time.time(),  # the checkpoint-age gauge of a run that resumes from it
        }
        self.saves.settle(wait=True)  # one save in flight at a time
        self.saves.start(state, next_step, meta)


def finish(config: TrainConfig, backend: Backend, result: RunResult, reporter: Reporter) -> None:
    """Export the final checkpoint (``spec.export``) and draw the loss curve of the whole history, resumed parts
    included (process 0). The final checkpoint is already committed: the loop treats next_step == steps as due and
    waits for its save."""
    if backend.process_index != 0:
        return
    if config.export is not None and result.next_step == config.steps and result.stopped_by is None:
        result.exported = export_final(config)
    if reporter.log is None:
        return
    reporter.log.close()
    records = read_log(reporter.log.path)
    if records:
        events = read_events(reporter.log.events_path)
        validations = read_validation(reporter.log.validation_path)
        result.plot = plot_losses(
            records, events, Path(config.run_dir) / "loss.png", f"{config.job_name}: flow-matching loss", validations
        )
