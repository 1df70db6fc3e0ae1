"""A process that fails or dies ends the whole run within seconds, with the right status (issue: one failed process
left its peer blocked in a collective for minutes, and the failed one waited five minutes in jax.distributed's
shutdown barrier).

- A failure of the job's inputs on one process (here: a corrupt sample only process 1 loads, maxBadSamples 0) exits
  with the configuration-error status and its one-line reason, and ``wanloom run --processes`` stops the other.
- A process killed mid-run (SIGKILL): the supervisor stops the other and reports the killed one's status.
- Without a supervisor (pods on different nodes), the survivor notices the dead peer through the coordination
  service's heartbeat and ends by itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from wanloom_api import keys
from wanloom_trainer.distributed_jax import HEARTBEAT_TIMEOUT_S
from wanloom_trainer.train.launch import free_port, pod_command, pod_env, with_overrides

pytestmark = pytest.mark.slow
WANLOOM = "import sys; from wanloom_cli import main; sys.argv[0] = 'wanloom'; main()"


def _job(tiny: Any, workdir: Path, **spec: Any) -> Any:
    return with_overrides(tiny.tiny_job(workdir, **spec), processes=2)


def _wanloom_run(spawn: Callable[..., subprocess.Popen], job_file: Path, cwd: Path, env: dict[str, str]) -> Any:
    args = ["run", str(job_file), "--processes", "2", "--metrics-port", "0", "--run-dir", str(cwd / "run")]
    return spawn([sys.executable, "-c", WANLOOM, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, text=True)  # fmt: skip


def test_a_bad_input_on_one_process_fails_the_run_at_once_with_the_configuration_error(
    tiny: Any, tmp_path: Path, script_environ, spawn
) -> None:
    job = _job(tiny, tmp_path, data={"maxBadSamples": 0}, training={"steps": 40})
    sample = tiny.corrupt_sample_of_rank(job, tmp_path / "data", 1, tmp_path / "run")
    env = script_environ()
    env.pop("XLA_FLAGS")
    started = time.monotonic()
    proc = _wanloom_run(spawn, tiny.write_job(tmp_path / "job.yaml", job), tmp_path, env)
    out, _ = proc.communicate(timeout=240)
    took = time.monotonic() - started
    worker = (tmp_path / "run" / "logs" / "process-1.log").read_text()
    print(f"injected: corrupt sample {sample} on process 1; found: exit {proc.returncode} after {took:.0f} s")
    assert proc.returncode == keys.EXIT_CONFIG_ERROR, out[-3000:] + worker[-3000:]
    assert "maxBadSamples" in worker and "Shutdown barrier" not in worker, worker[-3000:]
    assert "step 40/40" not in out
    assert took < 90, f"the run took {took:.0f} s to end"  # start-up and compiling included; it hung 5.5 min


def test_a_killed_process_stops_its_peer_within_seconds(tiny: Any, tmp_path: Path, script_environ, spawn) -> None:
    import psutil

    job = _job(tiny, tmp_path, training={"steps": 400})
    env = script_environ()
    env.pop("XLA_FLAGS")
    proc = _wanloom_run(spawn, tiny.write_job(tmp_path / "job.yaml", job), tmp_path, env)
    log = tmp_path / "run" / "steps.jsonl"
    deadline = time.monotonic() + 180
    while not (log.exists() and log.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not get to step 3"
        time.sleep(0.5)
    victim = _process_of(proc.pid, host_index=1)
    data_process = [c for c in psutil.Process(victim).children() if "--multiprocessing-fork" in c.cmdline()]
    assert len(data_process) == 1, "process 1 has no data process"
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - killed
    _, alive = psutil.wait_procs(data_process, timeout=15)
    print(f"injected: SIGKILL of process 1 (pid {victim}); found: exit {proc.returncode} {took:.1f} s later, its "
          f"data process {'still running' if alive else 'gone'}")  # fmt: skip
    assert proc.returncode == 128 + signal.SIGKILL, out[-3000:]
    assert took < 15, f"process 0 was stopped {took:.1f} s after its peer died"
    assert not alive, "the killed process's data process outlived it (nothing will ever read its steps)"


def test_without_a_supervisor_the_survivor_notices_a_dead_peer(
    tiny: Any, tmp_path: Path, script_environ, spawn
) -> None:
    """As pods on two nodes: nobody stops process 0 when process 1 dies, the coordination service's heartbeat
    does."""
    job = _job(tiny, tmp_path, training={"steps": 400})
    config_path = tiny.write_job(tmp_path / "job.yaml", job)
    base = script_environ()
    base.pop("XLA_FLAGS")
    coordinator, procs = f"127.0.0.1:{free_port()}", []
    for i in range(2):
        env = {**base, **pod_env(job, host_index=i, hosts=2, coordinator=coordinator, config_path=str(config_path),
                                 run_dir=str(tmp_path / "run"), metrics_port=0)}  # fmt: skip
        out = open(tmp_path / f"process-{i}.log", "w")  # noqa: SIM115 (closed with the process)
        procs.append((spawn(pod_command(job), env=env, stdout=out, stderr=subprocess.STDOUT), out))
    try:
        log = tmp_path / "run" / "steps.jsonl"
        deadline = time.monotonic() + 180
        while not (log.exists() and log.read_text().count("\n") >= 3):
            assert all(p.poll() is None for p, _ in procs) and time.monotonic() < deadline, "no step 3"
            time.sleep(0.5)
        procs[1][0].kill()
        killed = time.monotonic()
        code = procs[0][0].wait(timeout=4 * HEARTBEAT_TIMEOUT_S)
        took = time.monotonic() - killed
        print(f"injected: SIGKILL of process 1; found: process 0 ended with {code} {took:.0f} s later")
        assert code != 0
        assert took < 2 * HEARTBEAT_TIMEOUT_S + 15
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close()


def _process_of(root: int, *, host_index: int) -> int:
    """The pid of the descendant of ``root`` started as host ``host_index``."""
    import psutil

    for child in psutil.Process(root).children(recursive=True):
        try:
            if child.environ().get(keys.ENV_HOST_INDEX) == str(host_index) and "wanloom_trainer" in child.cmdline():
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no process with {keys.ENV_HOST_INDEX}={host_index} under {root}")


def test_a_collective_that_failed_with_its_peer_is_not_an_input_error() -> None:
    """A peer that exits on bad data breaks the next collective of the others ("UNKNOWN: Gloo AllGather failed",
    which jax raises as a ValueError): they exit as failures, so the operator reports the peer's cause."""
    from wanloom_trainer.__main__ import is_input_error

    gloo = "UNKNOWN: Gloo AllGather failed: [gloo/transport/tcp/pair.cc:547] Connection closed by peer [10.0.0.2]:1"
    assert not is_input_error(ValueError(gloo))
    assert not is_input_error(RuntimeError("spec.data.uri: no dataset"))
    assert is_input_error(ValueError("spec.data.uri: no dataset index at gs://b/x"))
    assert is_input_error(FileNotFoundError("gs://b/x/index.json"))
