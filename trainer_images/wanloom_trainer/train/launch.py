"""``wanloom run``: a TrainingJob on this machine, in one process or in N processes wired exactly like pods.

With ``processes > 1`` every process runs the pod's command (``python -m wanloom_trainer``; for torch the launcher,
``python -m wanloom_trainer.launcher``, which starts the worker) with the environment the operator gives a pod
(docs/startup-contract.md): the TrainingJob file in ``WANLOOM_CONFIG``, process 0's address in
``WANLOOM_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port here; for torch also ``MASTER_ADDR``/``MASTER_PORT``
with ``NNODES`` = N, ``NODE_RANK`` = i, one process per node), one slice of N hosts, host index i, and the CPU
platform with ``devicesPerNode`` host devices each. Every process logs to ``<run_dir>/logs/process-<i>.log``;
process 0's lines also reach the terminal, as a one-process run prints them (no timestamps, no Gloo connection
chatter). The processes are supervised as the launcher supervises its workers (``launcher.Supervisor``): SIGTERM
or Ctrl-C is forwarded once to each (they checkpoint and stop), and if one process fails, the rest are stopped.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import yaml

from wanloom_api import keys
from wanloom_api.trainingjob import TrainingJob

COMPILE_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
COMPILE_CACHE_MIN_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# What the pod log format (wanloom_trainer.__main__) adds in front of an INFO line, and the collective libraries'
# own start-up lines: the log files keep them, the terminal does not.
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO [\w.]+: ")
_NOISE = re.compile(r"^\[Gloo\]")


def with_overrides(job: TrainingJob, *, steps: int | None = None, processes: int | None = None) -> TrainingJob:
    """The job with ``training.steps`` and/or the CPU process count (``resources.cpu.nodes``) replaced."""
    spec = job.spec
    if steps is not None:
        if steps < 1:
            raise ValueError(f"--steps must be >= 1, got {steps}")
        training = spec.training.model_copy(update={"steps": steps})
        warmup = min(spec.optimizer.warmup_steps, steps)
        spec = spec.model_copy(
            update={"training": training, "optimizer": spec.optimizer.model_copy(update={"warmup_steps": warmup})}
        )
    if processes is not None:
        if spec.resources.cpu is None:
            raise ValueError(
                f"--processes runs CPU jobs only; {job.metadata.name} requests {spec.resources.accelerator}"
            )
        if processes < 1:
            raise ValueError(f"--processes must be >= 1, got {processes}")
        cpu = spec.resources.cpu.model_copy(update={"nodes": processes})
        spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"cpu": cpu})})
    return job.model_copy(update={"spec": spec})


def require_local_devices(job: TrainingJob) -> None:
    """Fail at once, in one line, when this machine cannot run the job's accelerators (not after loading data).

    Raises:
        ValueError: a TPU job off a TPU VM, a multi-node GPU job, or a GPU job without enough CUDA devices.
    """
    res = job.spec.resources
    name = job.metadata.name
    if res.tpu is not None and not (Path("/dev/accel0").exists() or Path("/dev/vfio/0").exists()):
        raise ValueError(
            f"{name} asks for a tpu7x {res.tpu.topology} slice (spec.resources.tpu) and this machine has no TPU: "
            "run it in a cluster (kubectl apply); `wanloom compile` checks its step here, and jobs/tiny-local.yaml "
            "trains on this CPU"
        )
    if res.gpu is None:
        return
    if res.gpu.nodes > 1:
        raise ValueError(
            f"{name} asks for {res.gpu.nodes} GPU nodes (spec.resources.gpu.nodes): wanloom run uses one machine; "
            "run it in a cluster (kubectl apply), or set nodes: 1"
        )
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < res.gpu.per_node:
        raise ValueError(
            f"{name} asks for {res.gpu.per_node} {res.gpu.type} GPUs (spec.resources.gpu.perNode) and this machine "
            f"has {found} CUDA device(s): run it on a GPU node or in a cluster (kubectl apply); "
            "jobs/tiny-local-torch.yaml trains on this CPU"
        )


def pod_env(
    job: TrainingJob,
    *,
    host_index: int,
    hosts: int,
    coordinator: str,
    config_path: str,
    run_dir: str,
    metrics_port: int,
) -> dict[str, str]:
    """The WANLOOM_* variables (and JAX CPU platform) the operator would render for host ``host_index``."""
    devices = job.spec.resources.cpu.devices_per_node if job.spec.resources.cpu else 1
    env = {
        keys.ENV_CONFIG: config_path,
        keys.ENV_JOB_NAME: job.metadata.name,
        keys.ENV_METRICS_PORT: str(metrics_port),
        keys.ENV_RUN_DIR: run_dir,
        keys.ENV_COORDINATOR_ADDRESS: coordinator,
        keys.ENV_NUM_SLICES: "1",
        keys.ENV_SLICE_INDEX: "0",
        keys.ENV_HOSTS_PER_SLICE: str(hosts),
        keys.ENV_HOST_INDEX: str(host_index),
        keys.ENV_DEVICES_PER_HOST: str(devices),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    }
    if job.spec.resources.resolved_backend == "torch":  # the launcher's static rendezvous, one worker per pod
        host, port = coordinator.rsplit(":", 1)
        env.update(NNODES=str(hosts), NPROC_PER_NODE="1", NODE_RANK=str(host_index), MASTER_ADDR=host, MASTER_PORT=port)
    return env


def pod_command(job: TrainingJob) -> list[str]:
    """What a pod of the job runs: the torch launcher (one worker per device) or the trainer itself."""
    module = "wanloom_trainer.launcher" if job.spec.resources.resolved_backend == "torch" else "wanloom_trainer"
    return [sys.executable, "-m", module]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_run_dir(job: TrainingJob) -> str:
    return os.path.abspath(os.path.join("runs", job.metadata.name))


def local_env(run_dir: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The base environment of a local run: a persistent XLA compilation cache next to the runs, holding every
    program (jax keeps only those that took a second by default), so a resumed run loads its programs instead of
    compiling them again (it still traces them)."""
    env = dict(os.environ if base is None else base)
    env.setdefault(COMPILE_CACHE_ENV, os.path.join(os.path.dirname(run_dir), ".jax-compile-cache"))
    env.setdefault(COMPILE_CACHE_MIN_ENV, "0")
    return env


def run_in_process(job: TrainingJob, *, run_dir: str, metrics_port: int, progress: bool = True) -> object:
    """One process: the same driver as a pod, without a coordinator."""
    from wanloom_trainer.config.train_config import from_trainingjob
    from wanloom_trainer.distributed_jax import prepare_platform

    env = local_env(run_dir)
    env.update({keys.ENV_RUN_DIR: run_dir, keys.ENV_METRICS_PORT: str(metrics_port)})
    config = from_trainingjob(job, env)
    for name in (COMPILE_CACHE_ENV, COMPILE_CACHE_MIN_ENV):
        os.environ.setdefault(name, env[name])
    prepare_platform(config)
    from wanloom_trainer.train.run import run

    return run(config, progress=progress)


def read_result(run_dir: str) -> object:
    """What the processes of ``run_processes`` did, read back from process 0's step log and events
    (``train.run.RunResult``)."""
    from wanloom_trainer.train.loss_log import latest_run
    from wanloom_trainer.train.run import RunResult

    start, records, checkpoints = latest_run(run_dir)
    plot = Path(run_dir, "loss.png")
    next_step = records[-1].step + 1 if records else start
    return RunResult(start, next_step, records, checkpoints, plot if plot.exists() else None)


def run_processes(job: TrainingJob, processes: int, *, run_dir: str, metrics_port: int) -> int:
    """N pod-like processes, supervised (module docstring); their combined exit status (``launcher.exit_code``)."""
    from wanloom_trainer.launcher import DEFAULT_SHUTDOWN_S, Supervisor

    Path(run_dir, "logs").mkdir(parents=True, exist_ok=True)
    config_path = os.path.join(run_dir, keys.CONFIG_FILE_NAME)
    Path(config_path).write_text(yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True)))
    coordinator = f"127.0.0.1:{free_port()}"
    supervisor, logs, echo = Supervisor(DEFAULT_SHUTDOWN_S), [], None
    try:
        for i in range(processes):
            env = local_env(run_dir)
            port = metrics_port + i if metrics_port else 0
            env.update(
                pod_env(
                    job,
                    host_index=i,
                    hosts=processes,
                    coordinator=coordinator,
                    config_path=config_path,
                    run_dir=run_dir,
                    metrics_port=port,
                )
            )
            out = open(os.path.join(run_dir, "logs", f"process-{i}.log"), "w")  # noqa: SIM115 (closed below)
            logs.append(out)
            stdout = subprocess.PIPE if i == 0 else out
            child = supervisor.start(pod_command(job), env, stdout=stdout, stderr=subprocess.STDOUT, text=True)
            if i == 0:
                echo = threading.Thread(target=_echo, args=(child.stdout, out), daemon=True)
                echo.start()
        code = supervisor.wait()
        if echo is not None:
            echo.join(timeout=5)
        for out in logs:
            out.flush()
        if code != 0:
            _say_why(run_dir, supervisor.children)
        return code
    finally:
        for p in supervisor.children:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()


def _say_why(run_dir: str, children: list[subprocess.Popen]) -> None:
    """The reason each failed process gave (its last ``wanloom trainer:`` line, as a pod's termination message
    says it), on stderr: only process 0's output reaches the terminal."""
    for i, child in enumerate(children):
        if child.returncode in (0, None):
            continue
        lines = Path(run_dir, "logs", f"process-{i}.log").read_text(errors="replace").splitlines()
        reasons = [line for line in lines if line.startswith("wanloom trainer: ")]
        if reasons:
            print(f"process {i}: {reasons[-1]}", file=sys.stderr, flush=True)


def _echo(stream: IO[str], log_file: IO[str]) -> None:
    """Process 0's output: every line to its log file, the readable ones to the terminal."""
    for line in stream:
        log_file.write(line)
        log_file.flush()
        if not _NOISE.match(line):
            sys.stdout.write(_LOG_PREFIX.sub("", line))
            sys.stdout.flush()
