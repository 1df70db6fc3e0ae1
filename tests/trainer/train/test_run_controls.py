"""What a run tells and keeps when its user changes it: a longer run continues its learning rate, a resume shows the
checkpoint it came from, compiling steps are reported apart from the steady state, and a refit that cannot start
says so once."""

from __future__ import annotations

import itertools
import logging
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from wanloom_trainer.train.launch import free_port
from wanloom_trainer.train.run import run
from wanloom_trainer.train.summary import StepSummary


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_a_longer_run_continues_its_learning_rate_and_shows_its_checkpoint(
    tiny: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="wanloom_trainer.train.run")
    spec = {"optimizer": {"warmupSteps": 2, "schedule": "cosine"}, "resources": {"backend": "torch"},
            "adaptiveLoad": {"refitEverySteps": 5}}  # fmt: skip
    short = tiny.tiny_config(tmp_path, training={"steps": 20, "checkpoint": {"interval": 10, "keep": 5}}, **spec)
    first = run(short, progress=False)
    assert first.checkpoints == [10, 20]
    # The two buckets of the tiny job give two sequence lengths: the refit cannot fit, and says so once.
    waits = [r.getMessage() for r in caplog.records if "cost refit waits" in r.getMessage()]
    assert len(waits) == 1, waits
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000020")  # resume from step 10, mid-decay

    port = free_port()
    seen: list[str] = []
    env = {"WANLOOM_METRICS_PORT": str(port)}
    longer = tiny.tiny_config(tmp_path, env, training={"steps": 40, "checkpoint": {"interval": 10, "keep": 5}},
                              **spec)  # fmt: skip
    caplog.clear()
    second = run(longer, progress=False, on_step=lambda r: seen.append(_scrape(port)) if r.step == 10 else None)
    rates = {r.step: r.learning_rate[1] for r in [*first.records, *second.records]}
    before = [r.learning_rate[1] for r in first.records]
    after = [r.learning_rate[1] for r in second.records]
    # No jump at the resume: step 10 goes on from the rate the 20-step run reached, then decays over 10..39.
    assert after[0] == pytest.approx(before[10]), (before, after)
    assert all(a > b for a, b in itertools.pairwise(after)) and after[-1] < 0.01 * after[0]
    assert max(rates.values()) <= short.optimizer.learning_rate
    changed = [
        r.getMessage() for r in caplog.records if "length changed from 20 to 40 steps at step 10" in r.getMessage()
    ]
    assert len(changed) == 1, [r.getMessage() for r in caplog.records]
    # Before its own first save, the resumed run reports the checkpoint it started from.
    assert 'wanloom_last_checkpoint_step{trainingjob="tiny-local"} 10.0' in seen[0], seen[0][:3000]
    assert 'wanloom_last_checkpoint_timestamp_seconds{trainingjob="tiny-local"} 0.0' not in seen[0]

    # A resume at the length the checkpoint was written with follows that schedule exactly.
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000040")
    again = run(longer, progress=False)
    assert [r.learning_rate[1] for r in again.records] == pytest.approx([rates[s] for s in range(30, 40)])


@pytest.mark.slow
def test_compiling_steps_are_reported_apart_from_the_steady_state(tiny: Any, tmp_path: Path) -> None:
    config = tiny.tiny_config(tmp_path, training={"steps": 12, "checkpoint": {"uri": None}})
    records = run(config, progress=False).records
    compiling = [r.step for r in records if r.compile_s > 0]
    assert 0 in compiling and len(compiling) < len(records) / 2, [(r.step, r.compile_s) for r in records]
    summary = StepSummary.of(records)
    assert summary.warm_up_steps == len(compiling) and summary.steady_steps == len(records) - len(compiling)
    steady = [r.step_time_s for r in records if r.compile_s == 0]
    assert summary.median_step_s == pytest.approx(sorted(steady)[len(steady) // 2], rel=0.5)
    assert summary.compile_s == pytest.approx(sum(r.compile_s for r in records))
    lines = summary.lines(wall_s=30.0)
    assert "steady state (" in lines[1] and "warm-up" in lines[2], lines
