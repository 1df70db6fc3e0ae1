"""The torch pods' launcher: torchrun's variables per worker, signals forwarded once and waited for within the
shutdown time, the rest stopped when one worker fails, and the pod's exit status from the workers' (3 for a
configuration error, 143 after a checkpointed stop). Real child processes throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wanloom_api.keys import ENV_SHUTDOWN_SECONDS, EXIT_CONFIG_ERROR
from wanloom_trainer.launcher import Node, exit_code, shutdown_seconds

ROOT = Path(__file__).resolve().parents[2]
NODE_ENV = {"NNODES": "2", "NPROC_PER_NODE": "2", "NODE_RANK": "1", "MASTER_ADDR": "pod-0.js", "MASTER_PORT": "29500"}


def test_workers_get_torchruns_variables() -> None:
    node = Node.from_env(NODE_ENV)
    assert node.worker_env(1) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "pod-0.js", "MASTER_PORT": "29500",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"NNODES": ""}, "needs NNODES"),
        ({"NODE_RANK": "x"}, "must be integers"),
        ({"NODE_RANK": "2"}, "NODE_RANK=2 must lie in 0..NNODES-1"),
    ],
)
def test_a_bad_rendezvous_is_named(change: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Node.from_env({**NODE_ENV, **change})


def test_shutdown_seconds() -> None:
    assert shutdown_seconds({ENV_SHUTDOWN_SECONDS: "285"}) == 285.0
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(ValueError, match=f"{ENV_SHUTDOWN_SECONDS}='{bad}' must be a positive number"):
            shutdown_seconds({ENV_SHUTDOWN_SECONDS: bad})


@pytest.mark.parametrize(
    ("codes", "stopped", "want"),
    [
        ([0, 0], False, 0),
        ([143, 143], True, 143),
        ([0, 143], False, 143),  # one worker stopped early: the pod did not succeed
        ([1, 143], False, 1),
        ([143, 3], True, EXIT_CONFIG_ERROR),  # a configuration error wins, whatever ended first
        ([137, 1], True, 137),
    ],
)
def test_exit_code(codes: list[int], stopped: bool, want: int) -> None:
    assert exit_code(codes, stopped=stopped) == want


# A worker that reports its rank, then on SIGTERM "checkpoints" (writes a file) and exits 143.
_WORKER = """
import os, signal, sys, time
out = sys.argv[1]
def stop(signum, frame):
    time.sleep(0.5)
    open(os.path.join(out, 'stopped-' + os.environ['RANK']), 'w').write(str(signum))
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
open(os.path.join(out, 'started-' + os.environ['RANK']), 'w').write(os.environ['WORLD_SIZE'])
mode = sys.argv[2]
if mode == 'fail' and os.environ['LOCAL_RANK'] == '1':
    sys.exit(3)
if mode == 'stubborn':
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:
    time.sleep(0.05)
"""


def _launcher(tmp_path: Path, mode: str, shutdown: str = "30") -> subprocess.Popen:
    env = {**os.environ, **NODE_ENV, ENV_SHUTDOWN_SECONDS: shutdown,
           "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'trainer_images'}"}  # fmt: skip
    worker = [sys.executable, "-c", _WORKER, str(tmp_path), mode]
    return subprocess.Popen([sys.executable, "-m", "wanloom_trainer.launcher", *worker], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_sigterm_is_forwarded_once_and_the_checkpointed_stop_exits_143(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, "run")
    for rank in (2, 3):
        _wait_for(tmp_path / f"started-{rank}")
    assert (tmp_path / "started-2").read_text() == "4"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143, out
    assert {(tmp_path / f"stopped-{r}").read_text() for r in (2, 3)} == {str(int(signal.SIGTERM))}


def test_a_configuration_error_stops_the_other_workers_and_exits_3(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, "fail")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_CONFIG_ERROR, out
    assert (tmp_path / "stopped-2").exists()  # the healthy worker was asked to stop (and checkpoint)


def test_workers_that_outlive_the_shutdown_time_are_killed(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, "stubborn", shutdown="2")
    for rank in (2, 3):
        _wait_for(tmp_path / f"started-{rank}")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL, out
    assert 2 <= time.monotonic() - started < 10


def test_a_launcher_killed_outright_leaves_no_worker_behind(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, "run")
    for rank in (2, 3):
        _wait_for(tmp_path / f"started-{rank}")
    proc.kill()
    proc.wait()
    for rank in (2, 3):  # the workers got SIGTERM from the kernel when their parent died
        _wait_for(tmp_path / f"stopped-{rank}", timeout=10)


def test_the_real_trainer_reports_a_configuration_error_through_the_launcher(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("apiVersion: wanloom.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: x}\nspec: {}\n")
    env = {**os.environ, **NODE_ENV, "NODE_RANK": "0", "NNODES": "1", "WANLOOM_CONFIG": str(bad),
           "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'trainer_images'}"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "wanloom_trainer.launcher"], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-3000:]
    # The first worker to fail stops the other, which may not get to say it too.
    assert "wanloom trainer: " in proc.stderr and "spec.model: required field is missing" in proc.stderr
