"""Per-step reporting of a run: Prometheus metrics, the step log, the progress bar, FLOPs and MFU.

FLOPs count the *useful* model FLOPs of the step's real samples (``wanloom_trainer.flops``: forward × 3, no
remat, no padding rows) at each micro-batch's bucket token count. MFU divides them by the step's wall time (the
slowest process), the device count and the per-device dense bf16 peak of ``TrainConfig.accelerator_type``
(``flops.ACCELERATORS``: per TensorCore on TPU v7x, per GPU otherwise, one core's fp32 rate on CPU).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from wanloom_api.metrics import EXPERT_LABELS
from wanloom_trainer import flops
from wanloom_trainer.backends.interface import StepOutputs
from wanloom_trainer.config.train_config import TrainConfig
from wanloom_trainer.metrics.records import StepLog, StepRecord
from wanloom_trainer.tracking import open_trackers
from wanloom_trainer.train.loss_log import LossLog, ValidationRecord

log = logging.getLogger(__name__)
_SHORT = {0: "hi", 1: "lo"}


def plan_flops(plan: Any, variant: Any, *, lora: bool = False) -> float:
    """Training FLOPs of a plan's real samples over all ranks (``StepPlan`` or ``LocalPlan``); ``lora``: frozen base."""
    return sum(n * flops.train_flops_per_sample(variant, tokens, lora=lora) for tokens, n in plan.token_counts)


def step_log(
    plan: Any,
    out: StepOutputs,
    *,
    config: TrainConfig,
    step_time_s: float,
    data_wait_s: float,
    num_devices: int,
    num_samples: int | None = None,
    compile_s: float = 0.0,
) -> StepLog:
    """The step's numbers: per-expert mean loss over its samples, norms and rates, throughput and MFU.
    ``num_samples``: the samples the loss was normalised by (the plan's, less skipped ones)."""
    n = plan.num_samples if num_samples is None else num_samples
    samples = {e: o.samples for e, o in enumerate(out.experts)}
    expert_loss = {e: o.loss_sum * n / o.samples for e, o in enumerate(out.experts) if o.samples}
    model_flops = plan_flops(plan, config.model.wan, lora=config.lora is not None)
    mfu = None
    if config.accelerator_type is not None:
        mfu = flops.mfu(model_flops, step_time_s, num_devices, config.accelerator_type)
    return StepLog(
        step=plan.step,
        loss=out.loss,
        expert_loss=expert_loss,
        expert_samples=samples,
        grad_norm={e: o.grad_norm for e, o in enumerate(out.experts) if o.grad_norm is not None},
        learning_rate={e: o.learning_rate for e, o in enumerate(out.experts)},
        step_time_s=step_time_s,
        data_wait_s=data_wait_s,
        tokens=int(plan.tokens),
        model_flops=model_flops,
        mfu=mfu,
        compile_s=compile_s,
    )


class Reporter:
    """Feeds the exporter (every process; owned by the caller) and owns the step log and progress bar
    (process 0)."""

    def __init__(
        self, config: TrainConfig, *, metrics: Any, process_index: int, start_step: int, progress: bool
    ) -> None:
        self.config, self.process_index, self.metrics = config, process_index, metrics
        self.primary = process_index == 0
        self.log = LossLog(config.run_dir, start_step) if self.primary else None
        self.trackers = open_trackers(config.tracking_config, start_step) if self.primary else None
        self.bar = None
        if self.primary and progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=config.steps, initial=start_step, desc=config.job_name, unit="step", dynamic_ncols=True
            )

    def step(self, record: StepLog, plan: Any, every: Any, num_devices: int) -> None:
        """``every``: float [processes, 4], each process's wall time, busy time, predicted busy time and compile
        time."""
        self.metrics.record_data_wait(record.data_wait_s)
        self.metrics.record_step(self._prometheus_record(record, plan, every, num_devices))
        if self.log is not None:
            self.log.append(record)
        if self.trackers is not None:
            self.trackers.step(record)
        if self.bar is not None:
            self.bar.set_postfix_str(progress_text(record), refresh=False)
            self.bar.update(1)
        elif self.primary and (record.step + 1) % self.config.log_every == 0:
            log.info("step %d/%d %s", record.step + 1, self.config.steps, progress_text(record))

    def validation(self, result: Any) -> None:
        """A ``validation.ValidationResult``: Prometheus, the trackers (at the step it follows) and the log."""
        self.metrics.record_validation(result.losses, result.seconds)
        if not self.primary:
            return
        by_name = {EXPERT_LABELS[e]: v for e, v in sorted(result.losses.items())}
        if self.log is not None:
            self.log.validation(ValidationRecord(result.step, by_name, result.seconds))
        values = {f"val/loss/{name}": v for name, v in by_name.items()}
        samples = result.samples
        if samples is not None:
            values["perf/sampling_s"] = result.sample_seconds
            log.info("validation videos after step %d: %s/", result.step, samples.folder)
        if self.trackers is not None:
            self.trackers.scalars(result.step - 1, {**values, "perf/validation_s": result.seconds})
            if samples is not None and samples.local is not None:
                files = {name: str(samples.local / name) for name in samples.files}
                images = {f"samples/{Path(n).stem}": f for n, f in files.items() if n.endswith(".png")}
                videos = {f"samples/{Path(n).stem}": f for n, f in files.items() if n.endswith(".mp4")}
                self.trackers.media(result.step - 1, images, videos)
        if samples is not None:
            from wanloom_trainer.evaluation.samples import cleanup

            cleanup(samples)
        losses = ", ".join(f"{name} {v:.4f}" for name, v in by_name.items())
        log.info("validation after step %d: %s (%.1f s)", result.step, losses, result.seconds)

    def checkpoint(self, next_step: int, seconds: float) -> None:
        self.metrics.record_checkpoint(next_step, seconds, time.time())
        if self.log is not None:
            self.log.checkpoint(next_step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            self.log.close()
        if self.trackers is not None:
            self.trackers.close()

    def _prometheus_record(self, record: StepLog, plan: Any, every: Any, num_devices: int) -> StepRecord:
        times, busy, predicted = (every[:, i].tolist() if self.primary else None for i in range(3))
        return StepRecord(
            log=record,
            total_steps=self.config.steps,
            num_devices=num_devices,
            accelerator=self.config.accelerator_type or self.config.accelerator,
            rank_step_times_s=times,
            rank_predicted_costs=[float(c) for c in plan.rank_costs] if self.primary else None,
            rank_busy_s=busy,
            rank_predicted_busy_s=predicted,
        )


def progress_text(record: StepLog) -> str:
    """One step in fixed-width fields (the bar does not jump as numbers grow), large rates with SI prefixes."""
    experts = " ".join(f"{_SHORT.get(e, e)} {v:7.4f}" for e, v in sorted(record.expert_loss.items()))
    mfu = f"{record.mfu:6.1%}" if record.mfu is not None else "   n/a"
    return (
        f"loss {record.loss:7.4f} ({experts}) | {_si(record.step_time_s, 's')}/step | "
        f"{_si(record.tokens_per_s, 'tok/s')} | {_si(record.tflops_per_s * 1e12, 'FLOP/s')} | MFU {mfu}"
    )


def _si(value: float, unit: str) -> str:
    """``value`` in 3 significant digits with an SI prefix, in a fixed width: ' 12.3 ms', '  1.50 s'."""
    prefixes = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "u"))
    scale, prefix = next(((s, p) for s, p in prefixes if abs(value) >= s), (1e-6, "u"))
    scaled = value / scale
    digits = 0 if abs(scaled) >= 100 else 1 if abs(scaled) >= 10 else 2
    width = 5 if prefix else 6  # the number takes the prefix's column when there is none
    return f"{scaled:{width}.{digits}f} {prefix}{unit}" if value else f"{0:6.2f} {unit}"


def start_exporter(config: TrainConfig, process_index: int) -> Any:
    """This process's ``metrics.TrainerMetrics``, serving on ``config.metrics_port`` (0: not served).

    Only the first process of a pod serves: torchrun starts one process per GPU and they share the pod's port. On
    pod 0 that process is global rank 0, which exports every cross-rank gauge; the other local processes'
    step-time histograms stay unexported (their times still reach rank 0's load-imbalance CV).
    """
    from wanloom_trainer.metrics import TrainerMetrics

    metrics = TrainerMetrics(config.job_name, process_index)
    if config.metrics_port and config.distributed.local_rank == 0:
        try:
            metrics.serve(config.metrics_port)
        except OSError as exc:
            # Metrics must never stop training: a busy port (a second local run) only loses the endpoint.
            log.warning("not serving Prometheus metrics on port %d: %s", config.metrics_port, exc)
    return metrics
