"""The progress text of `wanloom run`: fixed-width fields, SI units."""

from __future__ import annotations

from wanloom_trainer.metrics.records import StepLog
from wanloom_trainer.train.reporting import _si, progress_text


def _record(loss: float, step_time: float, tokens: int, mfu: float | None) -> StepLog:
    return StepLog(step=0, loss=loss, expert_loss={0: loss, 1: loss}, expert_samples={0: 1, 1: 1},
                   grad_norm={0: 1.0, 1: 1.0}, learning_rate={0: 1e-4, 1: 1e-4}, step_time_s=step_time,
                   data_wait_s=0.0, tokens=tokens, model_flops=tokens * 1e6, mfu=mfu)  # fmt: skip


def test_the_progress_text_keeps_its_width_as_numbers_grow() -> None:
    small = progress_text(_record(0.5, 0.0123, 10, 0.001))
    large = progress_text(_record(12.25, 1.5, 10_000_000, 0.456))
    assert len(small) == len(large), (small, large)
    assert "12.3 ms/step" in small and "1.50 s/step" in large and "6.67 Mtok/s" in large


def test_si_prefixes() -> None:
    assert [_si(v, "s") for v in (0.0, 0.0123, 0.5, 12.3, 1234.5, 1.2e6)] == [
        "  0.00 s",
        " 12.3 ms",
        "  500 ms",
        "  12.3 s",
        " 1.23 ks",
        " 1.20 Ms",
    ]
    assert len({len(_si(v, "tok/s")) for v in (0.0, 1.0, 999.0, 1e3, 5e5, 1e7, 3e9)}) == 1
