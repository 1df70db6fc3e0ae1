"""SIGTERM (preemption, maintenance) during `wanloom run`: the run checkpoints after the current step, exits 143
(128 + SIGTERM, so a pod stopped this way is not Succeeded) and resumes from that step. A real signal to a real
process, on both backends."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CLI = "import sys; from wanloom_cli import main; sys.argv[0] = 'wanloom'; main()"


def _job(tmp_path: Path, name: str) -> Path:
    text = (ROOT / "jobs" / f"{name}.yaml").read_text()
    text = text.replace(f"uri: runs/{name}/data", f"uri: {tmp_path / 'data'}")
    text = text.replace(f"uri: runs/{name}/checkpoints", f"uri: {tmp_path / 'ckpt'}")
    text = text.replace("interval: 50", "interval: 100000")  # only the SIGTERM writes a checkpoint
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def _records(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _wanloom(job: Path, tmp_path: Path, steps: int, *more: str) -> subprocess.Popen:
    args = ["run", str(job), "--steps", str(steps), "--metrics-port", "0", "--no-progress", "--run-dir", str(tmp_path),
            *more]  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-c", CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-local", "tiny-local-torch"])
def test_sigterm_checkpoints_the_current_step_and_the_run_resumes_there(tmp_path: Path, name: str) -> None:
    job = _job(tmp_path, name)
    proc = _wanloom(job, tmp_path, steps=100_000)
    deadline = time.monotonic() + 300
    while len(_records(tmp_path / "steps.jsonl")) < 3:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not reach step 3"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=120)
    stopped_in = time.monotonic() - sent
    assert proc.returncode == 143, err[-3000:]
    last = _records(tmp_path / "steps.jsonl")[-1]["step"]
    assert f"stopped by SIGTERM at step {last + 1}" in out, out
    # The checkpoint is the step after the last logged one, and it is committed (orbax: its folder; DCP: renamed).
    ckpt = tmp_path / "ckpt"
    saved = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("."))
    assert saved == ([str(last + 1)] if name == "tiny-local" else [f"step_{last + 1:08d}"]), saved
    assert stopped_in < 60, stopped_in  # well inside a pod's termination grace period

    (tmp_path / "again").mkdir()
    resumed = _wanloom(job, tmp_path / "again", steps=last + 3)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert f"steps {last + 1}..{last + 2}" in out, out


@pytest.mark.slow
def test_sigterm_to_a_two_process_torch_run_checkpoints_through_the_launchers(tmp_path: Path) -> None:
    """`wanloom run --processes 2` starts each pod's launcher, as a GPU pod does: SIGTERM to wanloom reaches both
    workers once, they checkpoint the same step and exit 143, and nothing is left running."""
    import psutil

    job = _job(tmp_path, "tiny-local-torch")
    proc = _wanloom(job, tmp_path, 100_000, "--processes", "2")
    _wait_for_steps(proc, tmp_path / "steps.jsonl", 3)
    family = psutil.Process(proc.pid).children(recursive=True)
    commands = [" ".join(p.cmdline()) for p in family]
    assert sum("wanloom_trainer.launcher" in c for c in commands) == 2, commands
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert time.monotonic() - sent < 60
    last = _records(tmp_path / "steps.jsonl")[-1]["step"]
    assert f"steps 0..{last}: loss" in out, out
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [f"step_{last + 1:08d}"]
    for i in (0, 1):  # each worker got the signal itself, through its launcher
        assert f"stopped by SIGTERM before step {last + 1}" in (tmp_path / "logs" / f"process-{i}.log").read_text()
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _wait_for_steps(proc: subprocess.Popen, log: Path, n: int) -> int:
    deadline = time.monotonic() + 300
    while len(_records(log)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"the run did not reach step {n}"
        time.sleep(0.2)
    return len(_records(log))


@pytest.mark.slow
def test_ctrl_c_checkpoints_like_sigterm_and_exits_130(tmp_path: Path) -> None:
    job = _job(tmp_path, "tiny-local-torch")
    proc = _wanloom(job, tmp_path, steps=100_000)
    _wait_for_steps(proc, tmp_path / "steps.jsonl", 3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Ctrl-C: checkpointing and stopping after this step" in err, err[-3000:]
    last = _records(tmp_path / "steps.jsonl")[-1]["step"]
    assert f"stopped by SIGINT at step {last + 1}" in out, out
    assert (tmp_path / "ckpt" / f"step_{last + 1:08d}").is_dir()


@pytest.mark.slow
def test_a_run_waiting_for_data_that_never_comes_still_stops(tmp_path: Path) -> None:
    """The shards become FIFOs with no writer: opening one blocks forever, so the step's data never arrives."""
    import os

    job = _job(tmp_path, "tiny-local")
    first = _wanloom(job, tmp_path, steps=2)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    for shard in (tmp_path / "data" / "shards").glob("*.tar"):
        shard.unlink()
        os.mkfifo(shard)
    proc = _wanloom(job, tmp_path, steps=10)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not any("resuming" in line for line in _lines(tmp_path)):
        assert time.monotonic() < deadline, "the second run did not start"
        time.sleep(0.2)
    time.sleep(5)  # it is waiting on the data process now
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert time.monotonic() - sent < 30, "the stop waited for loads that never finish"
    assert "stopped by SIGTERM at step 2" in out, out
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith(".")) == ["2"]


def _lines(run_dir: Path) -> list[str]:
    events = run_dir / "events.jsonl"
    return ["resuming"] if events.exists() and '"resume"' in events.read_text() else []


class _AsyncSaves:
    """A backend whose saves commit only when the test says so (orbax's asynchronous checkpoints)."""

    process_count = 1

    def __init__(self) -> None:
        self.writing = False

    def save(self, state: object, next_step: int, meta: object) -> float:
        self.writing = True
        return 0.0

    def checkpoint_pending(self) -> bool:
        return self.writing

    def wait_checkpoint(self) -> None:
        assert not self.writing, "Saves polls checkpoint_pending() instead of blocking in the backend's wait"


class _Reports:
    def __init__(self) -> None:
        self.checkpoints: list[tuple[int, float]] = []

    def checkpoint(self, next_step: int, seconds: float) -> None:
        self.checkpoints.append((next_step, seconds))


def test_a_checkpoint_is_reported_when_it_commits_not_when_it_starts() -> None:
    from types import SimpleNamespace

    from wanloom_trainer.feed.plan_ahead import CostSchedule
    from wanloom_trainer.train.run import RunResult, _Loop
    from wanloom_trainer.train.saves import Saves
    from wanloom_trainer.train.schedule import Segment

    loop = _Loop.__new__(_Loop)  # only the checkpoint bookkeeping: no model, no data
    loop.config = SimpleNamespace(seed=0, model=SimpleNamespace(variant="tiny"), job_name="t",
                                  routing=SimpleNamespace(mode="per-sample", boundary_ratio=0.875))  # fmt: skip
    loop.backend, loop.reporter, loop.result = _AsyncSaves(), _Reports(), RunResult(0, 0)
    loop.data, loop.saves = None, Saves(loop.backend, "ckpt", 600.0, loop._committed)
    loop.schedule = CostSchedule(None, start=0, lag=None)
    loop.lr_segment = Segment(100)
    loop.save(state=None, next_step=50)
    assert loop.reporter.checkpoints == [] and loop.result.checkpoints == []  # still being written
    loop.saves.settle(wait=False)
    assert loop.reporter.checkpoints == []
    loop.backend.writing = False  # committed in the background
    loop.saves.settle(wait=False)
    assert [s for s, _ in loop.reporter.checkpoints] == [50] and loop.result.checkpoints == [50]
    loop.save(state=None, next_step=100)
    threading.Timer(0.3, lambda: setattr(loop.backend, "writing", False)).start()  # commits in the background
    loop.saves.settle(wait=True)  # end of the run (or SIGTERM): wait for the commit
    assert loop.result.checkpoints == [50, 100] and all(seconds >= 0 for _, seconds in loop.reporter.checkpoints)
