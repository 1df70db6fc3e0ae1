"""The end-of-run summary of ``wanloom run``: the steady state apart from the warm-up.

Warm-up is the run's first step (lazy initialisation, first allocations, the collectives' first connection) and
every step that traced or compiled a program (``StepLog.compile_s`` > 0: JAX compiles each new micro-batch shape
once, and a resume loads them from the persistent cache). They measure start-up, not training: step time and
tokens/s come from the other steps, and the warm-up is reported on its own line.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from wanloom_trainer.metrics.records import StepLog


@dataclass(frozen=True)
class StepSummary:
    first_step: int
    last_step: int
    first_loss: float
    last_loss: float
    steps: int
    steady_steps: int
    median_step_s: float | None  # over the steady-state steps (None: every step compiled)
    tokens_per_s: float | None  # steady-state tokens over steady-state time
    mfu: float | None  # steady-state model FLOPs utilisation (None: no stated peak)
    warm_up_steps: int  # the first step and the steps that compiled
    compile_s: float  # the warm-up's tracing and compiling
    warm_up_s: float  # the warm-up steps' whole time
    skipped_samples: int

    @classmethod
    def of(cls, records: Sequence[StepLog]) -> StepSummary:
        if not records:
            raise ValueError("no steps to summarise")
        warm_up = [r for i, r in enumerate(records) if i == 0 or r.compile_s > 0]
        steady = [r for i, r in enumerate(records) if i > 0 and r.compile_s <= 0]
        busy = sum(r.step_time_s for r in steady)
        # MFU = FLOPs / (time x devices x peak); the devices and the peak are the run's, so one step gives them.
        per_flop_s = next((r.mfu * r.step_time_s / r.model_flops for r in steady if r.mfu and r.model_flops), None)
        return cls(
            first_step=records[0].step,
            last_step=records[-1].step,
            first_loss=records[0].loss,
            last_loss=records[-1].loss,
            steps=len(records),
            steady_steps=len(steady),
            median_step_s=statistics.median(r.step_time_s for r in steady) if steady else None,
            tokens_per_s=sum(r.tokens for r in steady) / busy if busy else None,
            mfu=sum(r.model_flops for r in steady) / busy * per_flop_s if per_flop_s and busy else None,
            warm_up_steps=len(warm_up),
            compile_s=sum(r.compile_s for r in warm_up),
            warm_up_s=sum(r.step_time_s for r in warm_up),
            skipped_samples=sum(int(r.extra.get("skipped_samples", 0)) for r in records),
        )

    def lines(self, wall_s: float | None = None) -> list[str]:
        wall = f" in {wall_s:.1f} s wall" if wall_s is not None else ""
        out = [f"steps {self.first_step}..{self.last_step}: loss {self.first_loss:.4f} -> {self.last_loss:.4f}"]
        if self.median_step_s is None:
            out.append(f"{self.steps} steps{wall}, all of them warm-up: no steady-state figure yet")
        else:
            mfu = f"MFU {self.mfu:.1%}" if self.mfu is not None else "MFU n/a (no stated peak for this device)"
            out.append(
                f"{self.steps} steps{wall}; steady state ({self.steady_steps} steps): median step "
                f"{self.median_step_s * 1e3:,.0f} ms, {self.tokens_per_s:,.0f} tokens/s, {mfu}, "
                f"{self.skipped_samples} samples skipped"
            )
        out.append(
            f"warm-up (first step and steps that compiled programs, not in the figures above): {self.warm_up_steps} "
            f"step(s), {self.warm_up_s:.1f} s, {self.compile_s:.1f} s of it tracing and compiling"
        )
        return out
