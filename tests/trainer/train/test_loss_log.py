"""The step and event logs a resumed run keeps consistent, and the loss plot that marks checkpoints and resumes."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from wanloom_trainer.metrics.records import StepLog
from wanloom_trainer.train.loss_log import LossLog, RunEvent, loss_figure, read_events, read_log


def _record(step: int, lr: float = 1e-4) -> StepLog:
    return StepLog(step=step, loss=1.0 / (step + 1), expert_loss={0: 0.5, 1: 0.25}, expert_samples={0: 1, 1: 1},
                   grad_norm={0: 1.0, 1: 1.0}, learning_rate={0: lr, 1: lr / 2}, step_time_s=0.1,
                   data_wait_s=0.0, tokens=10, model_flops=1e6, mfu=None)  # fmt: skip


def _run(run_dir: Path, start: int, stop: int, checkpoints: range) -> None:
    log = LossLog(run_dir, start)
    for step in range(start, stop):
        log.append(_record(step))
        if step + 1 in checkpoints:
            log.checkpoint(step + 1)
    log.close()


def test_a_resumed_run_keeps_one_history_of_steps_checkpoints_and_resumes(tmp_path: Path) -> None:
    _run(tmp_path, 0, 6, range(2, 5, 2))  # checkpoints after 2 and 4 steps; killed after step 5
    _run(tmp_path, 4, 5, range(2, 100, 2))  # resumed from 4, killed again after step 4
    _run(tmp_path, 4, 9, range(2, 100, 2))  # resumed from 4 again, to the end
    assert [r.step for r in read_log(tmp_path / "steps.jsonl")] == list(range(9))
    assert read_events(tmp_path / "events.jsonl") == [
        RunEvent("checkpoint", 2),
        RunEvent("checkpoint", 4),
        RunEvent("resume", 4),
        RunEvent("checkpoint", 6),
        RunEvent("checkpoint", 8),
    ]


def test_the_loss_plot_marks_checkpoints_and_resumes_and_shows_the_learning_rate() -> None:
    records = [_record(step, lr=1e-4 * (step + 1) / 10) for step in range(10)]
    events = [RunEvent("checkpoint", 4), RunEvent("resume", 4), RunEvent("checkpoint", 8)]
    fig = loss_figure(records, events, "t")
    try:
        loss_axis, lr_axis = fig.axes
        vertical = {
            (line.get_label(), line.get_xdata()[0]) for line in loss_axis.lines if line.get_linestyle() in (":", "--")
        }
        assert {x for _, x in vertical} == {4, 8}
        labels = [text.get_text() for text in fig.legends[0].get_texts()]
        assert {"checkpoint", "resume", "high_noise learning rate", "low_noise learning rate"} <= set(labels)
        assert lr_axis.get_ylabel() == "learning rate"
        high = next(line for line in lr_axis.lines if line.get_label() == "high_noise learning rate")
        assert list(high.get_ydata()) == [r.learning_rate[0] for r in records]
    finally:
        plt.close(fig)


def test_the_loss_plot_reads_plainly() -> None:
    """Plain tick numbers on the log axis, one learning-rate line when both experts share it, and a legend that
    covers no curve."""
    records = [StepLog(step=s, loss=3.0 / (s + 1) ** 0.3, expert_loss={0: 2.0, 1: 1.0}, expert_samples={0: 1, 1: 1},
                       grad_norm={}, learning_rate={0: 1e-3, 1: 1e-3}, step_time_s=0.1, data_wait_s=0.0, tokens=10,
                       model_flops=1e6, mfu=None) for s in range(50)]  # fmt: skip
    fig = loss_figure(records, [RunEvent("checkpoint", 25)], "t")
    try:
        fig.canvas.draw()
        loss_axis, lr_axis = fig.axes
        ticks = [label.get_text() for label in loss_axis.get_yticklabels(minor=True) + loss_axis.get_yticklabels()]
        assert ticks and not any("10^" in t or "times" in t for t in ticks), ticks
        assert [line.get_label() for line in lr_axis.lines] == ["learning rate (both experts)"]
        renderer = fig.canvas.get_renderer()
        legend, plot_area = fig.legends[0].get_window_extent(renderer), loss_axis.get_window_extent(renderer)
        assert not legend.overlaps(plot_area), (legend, plot_area)
    finally:
        plt.close(fig)
