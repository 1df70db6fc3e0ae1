"""Shared pieces of the PyTorch-trainer tests (fixtures: the tree is imported with --import-mode=importlib).
tests/conftest.py sets ``TRITON_INTERPRET=1`` (no GPU) before anything imports Triton."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from wanloom_trainer.config.variants import WanVariant, get_variant

TINY = get_variant("tiny")


@pytest.fixture(scope="session")
def tiny() -> WanVariant:
    return TINY


@pytest.fixture(scope="session")
def tiny_ti2v() -> WanVariant:
    """Per-token timesteps, one model (the TI2V-5B layout at toy size)."""
    return get_variant("tiny-ti2v")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def job_document(repo_root: Path, tmp_path: Path, **spec: object) -> dict:
    """jobs/tiny-local.yaml with backend torch, paths under ``tmp_path`` and ``spec`` merged in (nested dicts)."""
    import yaml

    doc = yaml.safe_load((repo_root / "jobs" / "tiny-local.yaml").read_text())
    doc["spec"]["resources"]["backend"] = "torch"
    doc["spec"]["data"]["uri"] = str(tmp_path / "data")
    doc["spec"]["training"]["checkpoint"]["uri"] = str(tmp_path / "checkpoints")
    _merge(doc["spec"], spec)
    return doc


def _merge(into: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


@pytest.fixture
def make_config(repo_root: Path, tmp_path: Path):
    """``make(env=None, **spec) -> TrainConfig`` of the tiny torch job (``WANLOOM_RUN_DIR`` under tmp_path)."""
    from wanloom_api.validation import parse_trainingjob
    from wanloom_trainer.config.train_config import from_trainingjob

    def make(env: dict | None = None, **spec: object):
        env = {"WANLOOM_RUN_DIR": str(tmp_path / "run"), **(env or {})}
        return from_trainingjob(parse_trainingjob(job_document(repo_root, tmp_path, **spec)), env)

    return make


@pytest.fixture
def write_job(repo_root: Path, tmp_path: Path):
    """``write(**spec) -> Path`` of the tiny torch job as a YAML file (for subprocess workers)."""
    import yaml

    def write(name: str = "job.yaml", **spec: object) -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(job_document(repo_root, tmp_path, **spec)))
        return path

    return write


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def run_workers(repo_root: Path, tmp_path: Path):
    """``run(job, out, processes, *args, expect_kill=False) -> list[int]``: start ``_backend_worker.py`` once per
    rank (gloo over 127.0.0.1, the wanloom process environment), wait, and return the exit codes."""
    import subprocess
    import sys

    worker = Path(__file__).with_name("_backend_worker.py")

    def run(job: Path, out: Path, processes: int, *args: str, timeout: float = 240) -> list[int]:
        out.mkdir(parents=True, exist_ok=True)
        base = {
            **os.environ,
            "PYTHONPATH": f"{repo_root / 'operator'}:{repo_root / 'trainer_images'}",
            "WANLOOM_CONFIG": str(job),
            "WANLOOM_RUN_DIR": str(tmp_path / "run"),
            "WANLOOM_HOSTS_PER_SLICE": str(processes),
            "WANLOOM_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}",
            "OMP_NUM_THREADS": "1",
        }
        procs = [
            subprocess.Popen(
                [sys.executable, str(worker), str(out), *args],
                env={**base, "WANLOOM_HOST_INDEX": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(processes)
        ]
        try:
            outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for code, text in zip((p.returncode for p in procs), outputs, strict=True):
            if code not in (0, -9):
                raise AssertionError(f"worker exited with {code}:\n{text[-4000:]}")
        return [p.returncode for p in procs]

    return run


def read_losses(out: Path, rank: int = 0) -> list[dict]:
    import json

    path = out / f"losses-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def losses_of():
    return read_losses
