"""The benchmarks' tiny run: jobs/tiny-local.yaml with its data and checkpoints in a scratch directory, and spec
changes merged in (camelCase), built with the package alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wanloom_api.validation import load_trainingjob_file, with_spec
from wanloom_trainer.config.train_config import TrainConfig, from_trainingjob

TINY_LOCAL = Path(__file__).resolve().parents[1] / "jobs" / "tiny-local.yaml"


def tiny_config(workdir: str | Path, env: dict[str, str] | None = None, **spec_changes: Any) -> TrainConfig:
    workdir = Path(workdir)
    paths = {"data": {"uri": str(workdir / "data")}, "training": {"checkpoint": {"uri": str(workdir / "checkpoints")}}}
    job = with_spec(with_spec(load_trainingjob_file(TINY_LOCAL), **paths), **spec_changes)
    environ = {"WANLOOM_RUN_DIR": str(workdir / "run"), "WANLOOM_METRICS_PORT": "0", **(env or {})}
    return from_trainingjob(job, environ)
