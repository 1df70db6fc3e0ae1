"""The run's step log (``<run_dir>/steps.jsonl``), its events (``<run_dir>/events.jsonl``), its validation losses
(``<run_dir>/validation.jsonl``, with ``spec.validation``) and the loss-curve plot (``<run_dir>/loss.png``).

One JSON object per optimizer step, written by process 0 only. A resumed run first drops the records of steps it
is about to run again, so the file always describes one consistent history (a killed run may have logged steps
after its last checkpoint). The events are the committed checkpoints and the resumes, at the step boundary they
mark (``step`` N: after N steps), truncated the same way. Framework-free: both backends' runs use it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from matplotlib.figure import Figure

from wanloom_api.metrics import EXPERT_LABELS
from wanloom_trainer.metrics.records import StepLog


@dataclass(frozen=True)
class ValidationRecord:
    """The held-out loss per expert name after ``step`` steps (``evaluation.validation``), and its wall time."""

    step: int
    losses: dict[str, float]
    seconds: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> ValidationRecord:
        return cls(**json.loads(line))


@dataclass(frozen=True)
class RunEvent:
    """A checkpoint committed or a run resumed at the boundary after ``step`` steps."""

    kind: Literal["checkpoint", "resume"]
    step: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> RunEvent:
        return cls(**json.loads(line))


class LossLog:
    """Append-only step and event logs that a resumed run truncates to the history before ``start_step``."""

    def __init__(self, run_dir: str | Path, start_step: int) -> None:
        self.path = Path(run_dir) / "steps.jsonl"
        self.events_path = Path(run_dir) / "events.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_log(self.path) if r.step < start_step] if self.path.exists() else []
        self.path.write_text("".join(r.to_json() + "\n" for r in kept))
        # The checkpoint this run resumes from stays; a resume at the same step (killed again before the next
        # checkpoint) is written once.
        events = [
            e
            for e in (read_events(self.events_path) if self.events_path.exists() else [])
            if e.step < start_step or (e.step == start_step and e.kind == "checkpoint")
        ]
        if start_step > 0:
            events.append(RunEvent("resume", start_step))
        self.events_path.write_text("".join(e.to_json() + "\n" for e in events))
        # A validation after step N ran once step N's checkpoint was saved: a run resuming at N keeps it.
        self.validation_path = Path(run_dir) / "validation.jsonl"
        validations = read_validation(self.validation_path) if self.validation_path.exists() else []
        kept_validations = [v for v in validations if v.step <= start_step]
        self.validation_path.write_text("".join(v.to_json() + "\n" for v in kept_validations))
        self._file = self.path.open("a")
        self._events = self.events_path.open("a")
        self._validation = self.validation_path.open("a")

    def append(self, record: StepLog) -> None:
        self._file.write(record.to_json() + "\n")
        self._file.flush()

    def checkpoint(self, step: int) -> None:
        self._events.write(RunEvent("checkpoint", step).to_json() + "\n")
        self._events.flush()

    def validation(self, record: ValidationRecord) -> None:
        self._validation.write(record.to_json() + "\n")
        self._validation.flush()

    def close(self) -> None:
        self._file.close()
        self._events.close()
        self._validation.close()


def read_log(path: str | Path) -> list[StepLog]:
    text = Path(path).read_text()
    return [StepLog.from_json(line) for line in text.splitlines() if line.strip()]


def read_events(path: str | Path) -> list[RunEvent]:
    text = Path(path).read_text()
    return [RunEvent.from_json(line) for line in text.splitlines() if line.strip()]


def read_validation(path: str | Path) -> list[ValidationRecord]:
    text = Path(path).read_text()
    return [ValidationRecord.from_json(line) for line in text.splitlines() if line.strip()]


def latest_run(run_dir: str | Path) -> tuple[int, list[StepLog], list[int]]:
    """The first step, the steps and the committed checkpoints of the run that wrote ``run_dir`` last: those since
    its latest resume (``wanloom run --processes`` summarises from here; process 0 wrote the files)."""
    run_dir = Path(run_dir)
    events = read_events(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    start = max((e.step for e in events if e.kind == "resume"), default=0)
    records = read_log(run_dir / "steps.jsonl") if (run_dir / "steps.jsonl").exists() else []
    checkpoints = [e.step for e in events if e.kind == "checkpoint" and e.step > start]
    return start, [r for r in records if r.step >= start], checkpoints


def plot_losses(
    records: Sequence[StepLog],
    events: Sequence[RunEvent],
    path: str | Path,
    title: str,
    validations: Sequence[ValidationRecord] = (),
) -> Path:
    """Draw ``loss_figure`` to a PNG; returns its path."""
    import matplotlib.pyplot as plt

    fig = loss_figure(records, events, title, validations)
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def loss_figure(
    records: Sequence[StepLog], events: Sequence[RunEvent], title: str, validations: Sequence[ValidationRecord] = ()
) -> Figure:
    """Loss per step (total and per expert, log scale) with a moving average, the held-out validation loss per
    expert as markers (at the last step before it), each expert's learning rate on a second axis, and vertical
    lines where checkpoints committed and where the run resumed."""
    import matplotlib

    matplotlib.use("Agg")  # no display: pods and CI
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=110, layout="constrained")
    steps = [r.step for r in records]
    ax.plot(steps, [r.loss for r in records], color="0.75", lw=0.8, label="step loss")
    ax.plot(steps, _moving_average([r.loss for r in records]), color="black", lw=1.6, label="step loss (avg)")
    for expert, color in zip(range(len(EXPERT_LABELS)), ("tab:red", "tab:blue"), strict=True):
        points = [(r.step, r.expert_loss[expert]) for r in records if expert in r.expert_loss]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, _moving_average(list(ys)), color=color, lw=1.2, label=f"{EXPERT_LABELS[expert]} (avg)")
        held_out = [
            (v.step - 1, v.losses[EXPERT_LABELS[expert]]) for v in validations if EXPERT_LABELS[expert] in v.losses
        ]
        if held_out:
            xs, ys = zip(*held_out, strict=True)
            ax.plot(xs, ys, color=color, marker="o", ls="--", lw=0.8, label=f"{EXPERT_LABELS[expert]} validation")
    ax.set_yscale("log")
    # Plain numbers at 1, 2 and 5 of each decade ("0.5", "3"), not matplotlib's "3x10^0" minor labels.
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0), numticks=12))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    styles = {
        "checkpoint": dict(color="tab:green", ls=":", lw=0.9),
        "resume": dict(color="tab:purple", ls="--", lw=1.4),
    }
    for kind, style in styles.items():
        for i, step in enumerate(sorted({e.step for e in events if e.kind == kind})):
            ax.axvline(step, label=kind if i == 0 else None, **style)
    lr_axis = ax.twinx()
    for label, color, xs, ys in _learning_rate_lines(records):
        lr_axis.plot(xs, ys, color=color, lw=0.8, alpha=0.6, ls="-.", label=label)
    lr_axis.set_ylabel("learning rate")
    lr_axis.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    lr_handles, lr_labels = lr_axis.get_legend_handles_labels()
    # Below the plot, where no curve is.
    fig.legend(handles + lr_handles, labels + lr_labels, fontsize="small", loc="outside lower center", ncols=4)
    return fig


def _learning_rate_lines(records: Sequence[StepLog]) -> list[tuple[str, str, list[int], list[float]]]:
    """(label, colour, steps, rates) per expert; one line when both experts follow the same rates (drawn twice, one
    would hide the other)."""
    lines = []
    for expert, color in zip(range(len(EXPERT_LABELS)), ("tab:red", "tab:blue"), strict=True):
        points = [(r.step, r.learning_rate[expert]) for r in records if expert in r.learning_rate]
        if points:
            xs, ys = (list(v) for v in zip(*points, strict=True))
            lines.append((f"{EXPERT_LABELS[expert]} learning rate", color, xs, ys))
    if len(lines) == 2 and lines[0][2:] == lines[1][2:]:
        return [("learning rate (both experts)", "tab:gray", lines[0][2], lines[0][3])]
    return lines


def _moving_average(values: list[float], window: int = 10) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
