"""Fixtures of the JAX trainer tests: tiny TrainingJobs (scripts/tiny_job.py) and a runner for the scripts that
need a fresh process (several CPU devices, fast-compile XLA flags, a persistent compilation cache)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[3]


def _load_tiny_job() -> Any:
    spec = importlib.util.spec_from_file_location("wanloom_test_tiny_job", SCRIPTS / "tiny_job.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny() -> Any:
    """The scripts/tiny_job.py module: ``tiny_job(workdir, **spec)``, ``tiny_config(workdir, env, **spec)``."""
    return _load_tiny_job()


def script_env(devices: int = 1, cache_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer_images"), str(SCRIPTS)])
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (
        "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
        f"--xla_force_host_platform_device_count={devices}"
    )
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


@pytest.fixture(scope="session")
def script_environ() -> Callable[..., dict[str, str]]:
    """``script_env(devices, cache_dir)``: the environment the subprocess scripts run with."""
    return script_env


@pytest.fixture
def run_script(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """Run scripts/<name>.py in a fresh interpreter; it prints one JSON object as its last stdout line."""

    def run(name: str, *args: str, devices: int = 1, timeout: int = 600) -> dict[str, Any]:
        env = script_env(devices, tmp_path / "xla-cache")
        proc = subprocess.run(
            [sys.executable, str(SCRIPTS / f"{name}.py"), *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run
