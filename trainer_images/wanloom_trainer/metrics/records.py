"""What one optimizer step reports: ``StepLog`` (the step's own numbers: step log, progress bar, hooks) and
``StepRecord`` (a ``StepLog`` with what the exporter adds across ranks). Expert-keyed dicts use routing's expert ids
(0 = high noise, 1 = low noise; a single-model variant uses 0); ``loss`` is always the step's float, per-expert
losses are ``expert_loss``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from wanloom_api.metrics import EXPERT_LABELS

_PER_EXPERT = ("expert_loss", "expert_samples", "grad_norm", "learning_rate")


@dataclass(frozen=True)
class StepLog:
    """One step as this process saw it (``step``: its index from 0); ``compile_s``: the part of the step's time
    that any process spent tracing and compiling programs (a step with 0 is a steady-state measurement)."""

    step: int
    loss: float
    expert_loss: dict[int, float]
    expert_samples: dict[int, int]
    grad_norm: dict[int, float]
    learning_rate: dict[int, float]
    step_time_s: float
    data_wait_s: float
    tokens: int
    model_flops: float
    mfu: float | None
    compile_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(self.step >= 0, f"StepLog.step must be >= 0, got {self.step}")
        _require(_positive(self.step_time_s), f"StepLog.step_time_s must be > 0, got {self.step_time_s}")
        _require(self.tokens >= 0, f"StepLog.tokens must be >= 0, got {self.tokens}")
        _require(self.model_flops >= 0, f"StepLog.model_flops must be >= 0, got {self.model_flops}")
        bad = {e: n for e, n in self.expert_samples.items() if n < 0}
        _require(not bad, f"StepLog.expert_samples must be >= 0, got {bad}")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s

    @property
    def tflops_per_s(self) -> float:
        return self.model_flops / self.step_time_s / 1e12

    def to_json(self) -> str:
        """Experts by the names the metrics use (``high_noise``, ``low_noise``), not by routing's ids."""
        doc = asdict(self)
        for key in _PER_EXPERT:
            doc[key] = {EXPERT_LABELS[k]: v for k, v in doc[key].items()}
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> StepLog:
        doc = json.loads(line)
        for key in _PER_EXPERT:
            doc[key] = {EXPERT_LABELS.index(k): v for k, v in doc[key].items()}
        return cls(**doc)


@dataclass(frozen=True)
class StepRecord:
    """A step as the exporter sees it. Cross-rank fields are filled on rank 0 only (None elsewhere); an expert counts
    as updated by this step when ``log.expert_samples[id] > 0``."""

    log: StepLog
    total_steps: int
    num_devices: int  # devices the step ran on, in the unit of `accelerator`'s peak
    accelerator: str  # key of wanloom_trainer.flops.ACCELERATORS
    rank_step_times_s: list[float] | None = None  # measured wall time of every rank, shape (ranks,)
    rank_predicted_costs: list[float] | None = None  # AdaptiveLoad's predicted load of every rank, shape (ranks,)
    rank_busy_s: list[float] | None = None  # every process's measured busy time, shape (processes,)
    rank_predicted_busy_s: list[float] | None = None  # the cost model's prediction of the same

    def __post_init__(self) -> None:
        _require(self.total_steps >= 1, f"StepRecord.total_steps must be >= 1, got {self.total_steps}")
        _require(self.num_devices >= 1, f"StepRecord.num_devices must be >= 1, got {self.num_devices}")

    @property
    def completed_steps(self) -> int:
        """Steps done once this one is, like a checkpoint's step: the progress panel reaches 100%."""
        return self.log.step + 1

    @property
    def wall_time_s(self) -> float:
        """The global step's wall time: the slowest rank when known (steps are synchronous), else this rank's."""
        return max(self.rank_step_times_s) if self.rank_step_times_s else self.log.step_time_s


def per_rank(values: list[float], what: str) -> np.ndarray:
    """One finite, non-negative value per rank, shape (ranks,)."""
    out = np.asarray(values, dtype=np.float64)
    if out.ndim != 1 or not np.all(np.isfinite(out)) or np.any(out < 0):
        raise ValueError(f"{what} must be one finite value >= 0 per rank, got {values[:8]}")
    return out


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
