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


def corrupt_sample_of_rank(job: TrainingJob, data_dir: str | Path, rank: int, run_dir: str | Path) -> int:
    """Write ``job``'s synthetic dataset into ``data_dir`` (a local folder) and break the latents of one sample that
    data-parallel ``rank`` loads at step 0 (its .npy header zeroed: the loader cannot parse it); the sample's id."""
    import json

    from wanloom_api.validation import with_spec
    from wanloom_trainer.data import ensure_synthetic
    from wanloom_trainer.data.reader import read_index
    from wanloom_trainer.feed.inputs import make_planner

    data_dir = Path(data_dir)
    job = with_spec(job, "a local copy of the job's data", data={"uri": str(data_dir)})
    config = from_trainingjob(job, {"WANLOOM_RUN_DIR": str(run_dir)})
    ensure_synthetic(config.data, config.model.wan, progress=False)
    shapes = read_index(config.data.uri, config.data.index).sample_shapes()
    layout = "per-rank" if config.backend == "torch" else "spmd"
    plan = make_planner(config, shapes, layout=layout).plan_local(0, [rank])
    mbs = plan.ranks[rank].micro_batches
    sample = next(i for mb in mbs for i, w in zip(mb.sample_ids, mb.weights, strict=True) if w > 0)
    doc = json.loads((data_dir / "index.json").read_text())
    rows = doc["samples"]
    offset = rows["span"][sample][0] + rows["member_ranges"][sample][0][0]
    with open(data_dir / doc["shards"][rows["shard"][sample]], "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * 64)
    return sample
