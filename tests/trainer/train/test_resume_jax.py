"""A run killed mid-way and resumed from its last checkpoint reproduces the uninterrupted run's losses exactly."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from wanloom_trainer.train.loss_log import RunEvent, read_events, read_log


@pytest.mark.slow
def test_killed_and_resumed_run_reproduces_the_losses_exactly(run_script: Callable[..., dict[str, Any]]) -> None:
    r = run_script("resume")
    assert len(r["a"]) == 8
    assert r["b_before_resume"] == r["a"][:6]  # B logged steps 0..5, then died inside step 5's hook
    assert r["c_start"] == 4  # the last checkpoint before the crash
    assert r["c"] == r["a"][4:]  # bit-for-bit: same plans, timesteps, noise, params and AdamW moments
    assert r["b_history"] == r["a"]  # the resumed run replaced the steps the crash had logged past its checkpoint
    assert r["checkpoints"] == [6, 8]  # keep: 2
    assert r["plot"] and r["plot"].endswith("loss.png")
    # per-batch routing: one expert per step, and only that expert gets an update (a gradient norm)
    assert all(len(experts) == 1 for experts in r["per_batch_experts"]), r["per_batch_experts"]
    assert r["per_batch_updated"] == r["per_batch_experts"]
    assert r["lora_c_start"] == 4 and r["lora_c"] == r["lora_a"][4:]  # LoRA: bit-for-bit too
    assert r["lora_a"] != r["a"]  # the adapters, not the whole model, trained


@pytest.mark.slow
def test_sigkilled_wanloom_run_resumes_to_the_same_losses(tiny: Any, tmp_path: Path, script_environ) -> None:
    """The real thing: `wanloom run` killed with SIGKILL after its first checkpoint, then run again."""
    env = script_environ(cache_dir=tmp_path / "xla-cache")
    env.pop("XLA_FLAGS")
    spec = {"training": {"steps": 16, "checkpoint": {"interval": 4, "keep": 3}}}
    runs = {}
    for name in ("whole", "killed"):
        (tmp_path / name).mkdir()
        runs[name] = tiny.write_job(tmp_path / name / "job.yaml", tiny.tiny_job(tmp_path / name, **spec))
    code = "import sys; from wanloom_cli import main; sys.argv[0] = 'wanloom'; main()"

    def start(name: str) -> subprocess.Popen:
        args = ["run", str(runs[name]), "--metrics-port", "0", "--no-progress"]
        return subprocess.Popen([sys.executable, "-c", code, *args], cwd=tmp_path / name, env=env,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip

    whole_run = start("whole")
    _, whole_messages = whole_run.communicate(timeout=600)
    assert whole_run.returncode == 0, whole_messages
    victim = start("killed")
    checkpoint = tmp_path / "killed" / "checkpoints" / "4"
    deadline = time.monotonic() + 600
    while not (checkpoint / "commit_success.txt").exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL  # killed mid-run, not finished
    assert not (tmp_path / "killed" / "checkpoints" / "16").exists()
    again = start("killed")
    _, messages = again.communicate(timeout=600)
    assert again.returncode == 0, messages
    assert "resuming from the checkpoint of step " in messages, messages  # the user is told

    whole = read_log(tmp_path / "whole" / "runs" / "tiny-local" / "steps.jsonl")
    resumed = read_log(tmp_path / "killed" / "runs" / "tiny-local" / "steps.jsonl")
    assert [r.loss for r in resumed] == [r.loss for r in whole]
    assert [r.grad_norm for r in resumed] == [r.grad_norm for r in whole]
    resumed_at = int(re.search(r"resuming from the checkpoint of step (\d+)", messages).group(1))
    events = read_events(tmp_path / "killed" / "runs" / "tiny-local" / "events.jsonl")
    assert RunEvent("resume", resumed_at) in events  # the loss plot marks it
    assert [e.step for e in events if e.kind == "checkpoint" and e.step > resumed_at] == list(
        range(resumed_at + 4, 17, 4)
    )
    assert all(e.kind == "checkpoint" for e in read_events(tmp_path / "whole" / "runs" / "tiny-local" / "events.jsonl"))
