"""The run's step log (``<run_dir>/steps.jsonl``) and its loss-curve plot (``<run_dir>/loss.png``).

One JSON object per optimizer step, written by process 0 only. A resumed run first drops the records of steps it
is about to run again, so the file always describes one consistent history (a killed run may have logged steps
after its last checkpoint). Framework-free: both backends' runs use it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from wanloom_operator.api.metrics import EXPERT_LABELS

_PER_EXPERT = ("expert_loss", "expert_samples", "grad_norm", "learning_rate")


@dataclass(frozen=True)
class StepLog:
    """What one step reports to the log, the progress bar and hooks (per-expert dicts keyed by expert id)."""

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
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def tflops_per_s(self) -> float:
        return self.model_flops / self.step_time_s / 1e12 if self.step_time_s > 0 else 0.0

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


class LossLog:
    """Append-only step log that a resumed run truncates to the steps before ``start_step``."""

    def __init__(self, run_dir: str | Path, start_step: int) -> None:
        self.path = Path(run_dir) / "steps.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_log(self.path) if r.step < start_step] if self.path.exists() else []
        self.path.write_text("".join(r.to_json() + "\n" for r in kept))
        self._file = self.path.open("a")

    def append(self, record: StepLog) -> None:
        self._file.write(record.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_log(path: str | Path) -> list[StepLog]:
    text = Path(path).read_text()
    return [StepLog.from_json(line) for line in text.splitlines() if line.strip()]


def plot_losses(records: Sequence[StepLog], path: str | Path, title: str) -> Path:
    """Loss per step (total and per expert, log scale) with a moving average; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")  # no display: pods and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    steps = [r.step for r in records]
    ax.plot(steps, [r.loss for r in records], color="0.75", lw=0.8, label="step loss")
    ax.plot(steps, _moving_average([r.loss for r in records]), color="black", lw=1.6, label="step loss (avg)")
    for expert, color in zip(range(len(EXPERT_LABELS)), ("tab:red", "tab:blue"), strict=True):
        points = [(r.step, r.expert_loss[expert]) for r in records if expert in r.expert_loss]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, _moving_average(list(ys)), color=color, lw=1.2, label=f"{EXPERT_LABELS[expert]} (avg)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _moving_average(values: list[float], window: int = 10) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def expert_names(d: Mapping[int, Any]) -> dict[str, Any]:
    return {EXPERT_LABELS[k]: v for k, v in d.items()}
