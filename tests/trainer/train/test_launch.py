"""`wanloom run --processes N`: N processes wired like pods (jax.distributed over 127.0.0.1) train the same run
as one process holding the same devices, and the pod environment is the operator's contract."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wanloom_api import keys
from wanloom_trainer.config.train_config import from_trainingjob
from wanloom_trainer.train.launch import pod_env, with_overrides
from wanloom_trainer.train.loss_log import read_log

STEPS = 6


def test_pod_env_is_the_startup_contract(tiny: Any, tmp_path: Path) -> None:
    job = with_overrides(tiny.tiny_job(tmp_path), processes=3)
    env = pod_env(
        job, host_index=2, hosts=3, coordinator="127.0.0.1:1234", config_path="/x.yaml", run_dir="/r", metrics_port=9
    )
    config = from_trainingjob(job, env)
    d = config.distributed
    assert (d.num_processes, d.process_id, d.coordinator_address) == (3, 2, "127.0.0.1:1234")
    assert env[keys.ENV_CONFIG] == "/x.yaml" and config.metrics_port == 9 and config.run_dir == "/r"
    assert config.parallel.fsdp == 3  # fsdp: -1 fills the three processes' devices


def test_overrides_reject_what_cannot_run_locally(tiny: Any, tmp_path: Path) -> None:
    job = tiny.tiny_job(tmp_path)
    assert with_overrides(job, steps=5).spec.training.steps == 5
    with pytest.raises(ValueError, match="--processes must be >= 1"):
        with_overrides(job, processes=0)


def _wanloom(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    code = "import sys; from wanloom_cli import main; sys.argv[0] = 'wanloom'; main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_two_devices(tiny: Any, tmp_path: Path, script_environ) -> None:
    env = script_environ()
    env.pop("XLA_FLAGS")
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
    spec = {"training": {"steps": STEPS}, "optimizer": {"warmupSteps": 2}}
    job_one = tiny.write_job(one / "job.yaml", tiny.tiny_job(one, resources={"cpu": {"devicesPerNode": 2}}, **spec))
    job_two = tiny.write_job(two / "job.yaml", tiny.tiny_job(two, **spec))
    _wanloom(["run", str(job_one), "--metrics-port", "0", "--no-progress"], one, env)
    out = _wanloom(["run", str(job_two), "--processes", "2", "--metrics-port", "0"], two, env)

    single = [r.loss for r in read_log(one / "runs" / "tiny-local" / "steps.jsonl")]
    multi = [r.loss for r in read_log(two / "runs" / "tiny-local" / "steps.jsonl")]
    assert len(single) == len(multi) == STEPS
    np.testing.assert_allclose(multi, single, rtol=1e-5)  # same mesh (fsdp=2), same plans; collectives differ
    worker_log = (two / "runs" / "tiny-local" / "logs" / "process-1.log").read_text()
    assert "num_processes=2, process_id=1" in worker_log
    assert "num_processes=2, process_id=0" in out
    # The terminal reads like a one-process run: the summary, no timestamps, no Gloo chatter (the log file keeps all).
    assert f"steps 0..{STEPS - 1}: loss" in out and "steady state (" in out and "warm-up" in out, out
    assert "[Gloo]" not in out and not re.search(r"^\d{4}-\d\d-\d\d .* INFO ", out, re.M), out
    process_0 = (two / "runs" / "tiny-local" / "logs" / "process-0.log").read_text()
    assert re.search(r"^\d{4}-\d\d-\d\d .* INFO wanloom_trainer", process_0, re.M), process_0[:2000]
