"""Tiny TrainingJobs for the trainer tests: jobs/tiny-local.yaml with paths in a scratch directory and overrides.

Imported by the subprocess scripts next to it and, through the ``tiny_config`` fixture, by the in-process tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from wanloom_api.trainingjob import TrainingJob
from wanloom_api.validation import load_trainingjob_file, with_spec
from wanloom_trainer.config.train_config import TrainConfig, from_trainingjob

ROOT = Path(__file__).resolve().parents[4]
TINY_LOCAL = ROOT / "jobs" / "tiny-local.yaml"


def tiny_job(workdir: str | Path, **spec_changes: Any) -> TrainingJob:
    """tiny-local with data, checkpoints in ``workdir`` and ``spec_changes`` merged into the spec (camelCase)."""
    workdir = Path(workdir)
    paths = {"data": {"uri": str(workdir / "data")}, "training": {"checkpoint": {"uri": str(workdir / "checkpoints")}}}
    job = with_spec(load_trainingjob_file(TINY_LOCAL), "tiny test job", **paths)
    return with_spec(job, "tiny test job", **spec_changes)


def tiny_config(workdir: str | Path, env: dict[str, str] | None = None, **spec_changes: Any) -> TrainConfig:
    environ = {"WANLOOM_RUN_DIR": str(Path(workdir) / "run"), "WANLOOM_METRICS_PORT": "0", **(env or {})}
    return from_trainingjob(tiny_job(workdir, **spec_changes), environ)


def write_job(path: str | Path, job: TrainingJob) -> Path:
    path = Path(path)
    path.write_text(yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True)))
    return path
