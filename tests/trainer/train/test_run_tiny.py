"""`wanloom run jobs/tiny-local.yaml`, shortened: synthetic data, both experts, a falling loss, checkpoints, the
loss plot and live Prometheus metrics, exactly as a user runs it (a fresh process from a scratch directory)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from wanloom_trainer.train.launch import free_port
from wanloom_trainer.train.loss_log import read_log

ROOT = Path(__file__).resolve().parents[3]
STEPS = 80


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return ""


def wanloom(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    code = "import sys; from wanloom_cli import main; sys.argv[0] = 'wanloom'; main()"
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_tiny_local_run_trains_checkpoints_plots_and_serves_metrics(tmp_path: Path, script_environ) -> None:
    port = free_port()
    env = script_environ()
    env.pop("XLA_FLAGS")  # the run sets its own, as it does for a user
    args = ["run", str(ROOT / "jobs" / "tiny-local.yaml"), "--steps", str(STEPS), "--metrics-port", str(port)]
    proc = wanloom([*args, "--no-progress"], tmp_path, env)
    seen = ""
    while proc.poll() is None:
        text = scrape(port)
        if "wanloom_step{" in text:
            seen = text
        time.sleep(0.5)
    out = proc.stdout.read()
    assert proc.returncode == 0, out

    run_dir = tmp_path / "runs" / "tiny-local"
    records = read_log(run_dir / "steps.jsonl")
    assert [r.step for r in records] == list(range(STEPS))
    first = statistics.mean(r.loss for r in records[:3])
    last = statistics.mean(r.loss for r in records[-10:])
    assert last < 0.5 * first, (first, last)
    assert all(r.expert_samples[0] + r.expert_samples[1] == 8 for r in records)  # globalBatch: 8
    assert sum(r.expert_samples[0] for r in records) > 0 and sum(r.expert_samples[1] for r in records) > 0
    assert (run_dir / "loss.png").stat().st_size > 10_000
    checkpoints = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert checkpoints == [50, 80]
    assert 'wanloom_step{trainingjob="tiny-local"}' in seen and "wanloom_loss{" in seen, seen[:2000]
    assert f"steps 0..{STEPS - 1}: loss" in out
    # The summary a user reads, and the step log naming experts as the metrics do.
    assert f"{STEPS} steps in " in out and " tokens/s, MFU " in out and "0 samples skipped" in out, out
    assert "checkpoints at steps 50, 80 in runs/tiny-local/checkpoints" in out, out
    raw = json.loads((run_dir / "steps.jsonl").read_text().splitlines()[0])
    assert set(raw["expert_samples"]) <= {"high_noise", "low_noise"} and raw["expert_samples"], raw
