"""The data process (feed/process.py): planning and loading leave the training process, the steps and
their rows arrive in order, and its errors, logs, skip counts and exit reach the trainer."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wanloom_trainer.data import TooManyBadSamples, ensure_synthetic, open_dataset
from wanloom_trainer.data.prefetch import PlanPrefetcher
from wanloom_trainer.feed.inputs import make_planner, step_rows
from wanloom_trainer.feed.process import DataProcess, Pipeline
from wanloom_trainer.train.run import run


def _config(tiny: Any, tmp_path: Path, steps: int, **changes: Any) -> Any:
    return tiny.tiny_config(tmp_path, training={"steps": steps}, optimizer={"warmupSteps": 0}, **changes)


def _large_rows(tiny: Any, tmp_path: Path, steps: int) -> Any:
    """Buckets of 256x256 pixels: each step's message is several times a pipe's 64 KiB buffer."""
    buckets = [{"frames": f, "height": 256, "width": 256} for f in (1, 9)]
    return _config(tiny, tmp_path, steps, adaptiveLoad={"memoryBudgetTokens": 4096, "buckets": buckets})


def _start(config: Any, start: int = 0, data_state: dict[str, Any] | None = None, **hooks: Any) -> DataProcess:
    ensure_synthetic(config.data, config.model.wan, progress=False)
    return DataProcess(
        Pipeline(config, [0], start, "per-rank", None, [], data_state or {}),
        on_skip=hooks.get("on_skip", lambda *a, **k: None), on_outage=hooks.get("on_outage", lambda s: None),
    )  # fmt: skip


def test_the_steps_arrive_as_the_in_process_loader_would_make_them(tiny: Any, tmp_path: Path) -> None:
    config = _config(tiny, tmp_path, 4)
    data = _start(config, start=1)
    try:
        received = list(data)
    finally:
        data.close()
    with open_dataset(config.data.uri, max_bad_samples=0) as ds:
        planner = make_planner(config, ds.sample_shapes(), layout="per-rank")
        plans = [planner.plan_local(s, [0]) for s in range(1, 4)]
        with PlanPrefetcher(ds, plans, 0, depth=2, prepare=step_rows(config)) as pf:
            expected = [list(sd) for sd in pf]
    assert [step[0].plan.step for step in received] == [1, 2, 3]
    assert data.state_dict()["next_step"] == 4
    for (got,), want in zip(received, expected, strict=True):
        assert [mb.expert for mb in got] == [mb.expert for mb in want]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a.rows.noise, b.rows.noise)
            np.testing.assert_array_equal(a.rows.latents, b.rows.latents)
            np.testing.assert_array_equal(a.rows.weights, b.rows.weights)


def test_the_trainer_runs_no_planning_or_loading_threads_and_reports_its_wait(tiny: Any, tmp_path: Path) -> None:
    config = tiny.tiny_config(tmp_path, training={"steps": 3, "checkpoint": {"uri": None}},
                              optimizer={"warmupSteps": 0}, resources={"backend": "torch"})  # fmt: skip
    seen: list[set[str]] = []
    result = run(config, progress=False, on_step=lambda _: seen.append({t.name for t in threading.enumerate()}))
    names = set().union(*seen)
    assert not {n for n in names if n.startswith(("wanloom-prefetch", "wanloom-plan"))}, names
    # the first step waits for the data process to start and load: that wait is reported, and counted in the step
    first = result.records[0]
    assert first.data_wait_s > 0.05 and first.step_time_s > first.data_wait_s


def test_a_loading_error_surfaces_in_the_training_loop_with_its_type(tiny: Any, tmp_path: Path) -> None:
    config = _config(tiny, tmp_path, 4, data={"maxBadSamples": 0})
    ensure_synthetic(config.data, config.model.wan, progress=False)
    for shard in Path(config.data.uri).rglob("*.tar"):
        shard.unlink()
    data = _start(config)
    try:
        with pytest.raises(TooManyBadSamples, match="maxBadSamples=0") as raised:
            list(data)
    finally:
        data.close()
    assert any("raised in the data process" in note for note in raised.value.__notes__)


def test_skips_and_log_records_reach_the_trainer(tiny: Any, tmp_path: Path, caplog: Any) -> None:
    config = _config(tiny, tmp_path, 6, data={"maxBadSamples": 1000})
    ensure_synthetic(config.data, config.model.wan, progress=False)
    for shard in Path(config.data.uri).rglob("*.tar"):  # the first half of the samples fail their CRC
        raw = bytearray(shard.read_bytes())
        raw[1024 : len(raw) // 2] = bytes(len(raw) // 2 - 1024)
        shard.write_bytes(bytes(raw))
    skips: list[tuple[Any, ...]] = []
    with caplog.at_level(logging.WARNING):
        data = _start(config, on_skip=lambda *args, **kwargs: skips.append((*args, kwargs)))
        try:
            steps = list(data)
        finally:
            data.close()
    assert len(steps) == 6 and skips and {s[0] for s in skips} == {"corrupt"}
    assert sum(mb.skipped for (step,) in steps for mb in step) > 0
    assert any(r.name == "wanloom_trainer.data.skips" and "skipping sample" in r.getMessage() for r in caplog.records)
    assert data.state_dict()["dataset"]["skipped_by_reason"]["corrupt"] == len(skips)


def test_steps_larger_than_the_pipe_buffer_all_arrive(tiny: Any, tmp_path: Path) -> None:
    data = _start(_large_rows(tiny, tmp_path, 5))
    received = []
    try:
        for step in data:  # a slow reader: the child has finished planning and loading long before the last step
            received.append(step)
            time.sleep(0.2)
    finally:
        data.close()
    assert [step[0].plan.step for step in received] == [0, 1, 2, 3, 4]
    assert min(len(pickle.dumps(step)) for step in received) > 2 * 65536
    assert data._process.exitcode == 0


def test_a_data_process_that_dies_is_reported_not_waited_for(tiny: Any, tmp_path: Path) -> None:
    data = _start(_large_rows(tiny, tmp_path, 50))
    try:
        steps = iter(data)
        next(steps)
        time.sleep(1.0)  # the next step is half written: the pipe holds 64 KiB of it
        os.kill(data._process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"data process .* exited with code -9"):
            for _ in steps:
                pass
    finally:
        data.close()


def test_close_stops_a_child_that_is_waiting_for_room(tiny: Any, tmp_path: Path) -> None:
    config = _config(tiny, tmp_path, 1000)
    data = _start(config)
    next(iter(data))
    time.sleep(0.5)  # the child fills the queue and waits for room
    started = time.perf_counter()
    data.close()
    assert not data._process.is_alive() and data._process.exitcode == 0
    assert time.perf_counter() - started < 10
