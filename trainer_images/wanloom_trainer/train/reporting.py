"""Per-step reporting of a run: Prometheus metrics, the step log, the progress bar, FLOPs and MFU.

FLOPs count the *useful* model FLOPs of the step's real samples (``wanloom_trainer.flops``: forward × 3, no
remat, no padding rows) at each micro-batch's bucket token count. MFU divides them by the step's wall time (the
slowest process), the device count and the per-device dense bf16 peak of ``TrainConfig.accelerator_type``
(``flops.ACCELERATORS``: per TensorCore on TPU v7x, per GPU otherwise); CPU runs have no peak and report none.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from wanloom_trainer import flops
from wanloom_trainer.config.train_config import TrainConfig
from wanloom_trainer.train.backend import StepOutputs
from wanloom_trainer.train.loss_log import LossLog, StepLog

log = logging.getLogger(__name__)
_SHORT = {0: "hi", 1: "lo"}


def plan_flops(plan: Any, variant: Any) -> float:
    """Training FLOPs of a plan's real samples over all ranks."""
    return sum(
        mb.num_real * flops.train_flops_per_sample(variant, mb.tokens)
        for rank in plan.ranks
        for mb in rank.micro_batches
        if mb.num_real
    )


def step_log(
    plan: Any, out: StepOutputs, *, config: TrainConfig, step_time_s: float, data_wait_s: float, num_devices: int
) -> StepLog:
    """The step's numbers: per-expert mean loss over its samples, norms and rates, throughput and MFU."""
    samples = {e: o.samples for e, o in enumerate(out.experts)}
    expert_loss = {e: o.loss_sum * plan.num_samples / o.samples for e, o in enumerate(out.experts) if o.samples}
    model_flops = plan_flops(plan, config.model.wan)
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
    )


class Reporter:
    """Owns the exporter (every process), the step log and the progress bar (process 0)."""

    def __init__(self, config: TrainConfig, *, process_index: int, start_step: int, progress: bool) -> None:
        self.config, self.process_index = config, process_index
        self.primary = process_index == 0
        self.metrics = _start_exporter(config, process_index)
        self.log = LossLog(config.run_dir, start_step) if self.primary else None
        self.bar = None
        if self.primary and progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=config.steps, initial=start_step, desc=config.job_name, unit="step", dynamic_ncols=True
            )

    def step(self, record: StepLog, plan: Any, process_times: list[float], num_devices: int) -> None:
        if self.metrics is not None:
            self.metrics.record_data_wait(record.data_wait_s)
            self.metrics.record_step(self._prometheus_record(record, plan, process_times, num_devices))
        if self.log is not None:
            self.log.append(record)
        if self.bar is not None:
            self.bar.set_postfix_str(progress_text(record), refresh=False)
            self.bar.update(1)
        elif self.primary and (record.step + 1) % self.config.log_every == 0:
            log.info("step %d/%d %s", record.step + 1, self.config.steps, progress_text(record))

    def checkpoint(self, next_step: int, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.record_checkpoint(next_step, seconds, time.time())

    def skipped(self, reason: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.record_skipped(reason, n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            self.log.close()
        if self.metrics is not None:
            self.metrics.close()

    def _prometheus_record(self, record: StepLog, plan: Any, process_times: list[float], num_devices: int) -> Any:
        from wanloom_trainer.metrics import StepRecord

        return StepRecord(
            step=record.step,
            total_steps=self.config.steps,
            step_time_s=record.step_time_s,
            rank_step_times_s=process_times if self.primary else None,
            rank_predicted_costs=[float(r.predicted_cost) for r in plan.ranks] if self.primary else None,
            tokens=record.tokens,
            model_flops=record.model_flops,
            num_devices=num_devices,
            accelerator=self.config.accelerator_type or self.config.accelerator,
            loss=dict(record.expert_loss),
            grad_norm=dict(record.grad_norm),
            learning_rate=dict(record.learning_rate),
            expert_samples=dict(record.expert_samples),
        )


def progress_text(record: StepLog) -> str:
    experts = " ".join(f"{_SHORT.get(e, e)} {v:.4f}" for e, v in sorted(record.expert_loss.items()))
    mfu = f"{record.mfu:.1%}" if record.mfu is not None else "n/a"
    return (
        f"loss {record.loss:.4f} ({experts}) | {record.step_time_s * 1e3:.0f} ms/step | "
        f"{record.tokens_per_s:,.0f} tok/s | {record.tflops_per_s:.3g} TFLOP/s | MFU {mfu}"
    )


def _start_exporter(config: TrainConfig, process_index: int) -> Any:
    from wanloom_trainer.metrics import TrainerMetrics

    metrics = TrainerMetrics(config.job_name, process_index)
    if config.metrics_port:
        try:
            metrics.serve(config.metrics_port)
        except OSError as exc:
            # Metrics must never stop training: a busy port (a second local run) only loses the endpoint.
            log.warning("not serving Prometheus metrics on port %d: %s", config.metrics_port, exc)
    return metrics
