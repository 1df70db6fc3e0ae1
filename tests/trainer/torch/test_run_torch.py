"""The driver on the PyTorch backend: ``train.run`` with a crash and a resume, and ``wanloom run`` of
jobs/tiny-local-torch.yaml (1 and 2 processes) finishing with a falling loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from wanloom_trainer.train.run import run

STEPS, INTERVAL, CRASH_AT = 12, 5, 8


class _Crash(RuntimeError):
    pass


def _crash_at(step: int):
    def hook(record) -> None:
        if record.step == step:
            raise _Crash(f"killed after step {step}")

    return hook


def test_driver_crash_and_resume_reproduce_the_uninterrupted_losses(make_config, tmp_path) -> None:
    spec = {"training": {"steps": STEPS, "checkpoint": {"interval": INTERVAL}}, "optimizer": {"warmupSteps": 2}}
    env = {"WANLOOM_METRICS_PORT": "0"}
    full = run(make_config(env={**env, "WANLOOM_RUN_DIR": str(tmp_path / "full")}, **spec), progress=False)
    config = make_config(
        env={**env, "WANLOOM_RUN_DIR": str(tmp_path / "killed")},
        **{**spec, "training": {**spec["training"], "checkpoint": {"uri": str(tmp_path / "ckpt"), "interval": 5}}},
    )
    with pytest.raises(_Crash):
        run(config, progress=False, on_step=_crash_at(CRASH_AT))
    resumed = run(config, progress=False)
    assert resumed.start_step == 5  # the latest checkpoint before the crash after step 8 (interval 5)
    want = {r.step: (r.loss, r.expert_loss, r.grad_norm) for r in full.records}
    got = {r.step: (r.loss, r.expert_loss, r.grad_norm) for r in resumed.records}
    assert got == {s: want[s] for s in range(5, STEPS)}  # exact: same data, timesteps, noise, state
    assert {e for r in full.records for e in r.expert_samples if r.expert_samples[e]} == {0, 1}


def _wanloom_run(repo_root, tmp_path, processes: int) -> tuple[float, list[dict]]:
    run_dir = tmp_path / f"p{processes}"
    env = {**os.environ, "PYTHONPATH": f"{repo_root / 'operator'}:{repo_root / 'trainer_images'}"}
    cmd = [sys.executable, "-c", "from wanloom_cli import main; main()", "run",
           str(repo_root / "jobs" / "tiny-local-torch.yaml"), "--processes", str(processes), "--metrics-port", "0",
           "--run-dir", str(run_dir), "--no-progress"]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return elapsed, [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_wanloom_run_tiny_torch_job_finishes_in_five_minutes_with_a_falling_loss(repo_root, tmp_path, processes):
    elapsed, records = _wanloom_run(repo_root, tmp_path, processes)
    assert elapsed < 300, f"{elapsed:.0f} s"
    assert [r["step"] for r in records] == list(range(200))
    first, last = (sum(r["loss"] for r in part) / len(part) for part in (records[:20], records[-20:]))
    assert last < 0.6 * first, (first, last)
    assert (tmp_path / f"p{processes}" / "loss.png").is_file()
