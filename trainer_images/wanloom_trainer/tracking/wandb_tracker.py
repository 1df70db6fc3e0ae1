"""Weights & Biases (``spec.tracking.wandb``): one W&B run per TrainingJob, resumed across restarts.

The W&B run id is derived from the job's name and namespace, so a restarted pod (or a rerun of ``wanloom run``)
continues the same run; ``mode: offline`` writes it under ``<run dir>/wandb`` for ``wandb sync``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from wanloom_trainer.config.train_config import TrackingConfig


def run_id(tracking: TrackingConfig) -> str:
    return hashlib.sha256(f"{tracking.namespace or ''}/{tracking.job_name}".encode()).hexdigest()[:16]


class WandbTracker:
    def __init__(self, tracking: TrackingConfig, start_step: int) -> None:
        import wandb

        spec = tracking.spec.wandb
        assert spec is not None
        self._run = wandb.init(
            project=spec.project,
            entity=spec.entity,
            mode=spec.mode,
            dir=tracking.run_dir,
            name=tracking.job_name,
            id=run_id(tracking),
            resume="allow",
            config=dict(tracking.summary),
        )
        self.start_step = start_step

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def media(self, step: int, images: Mapping[str, str], videos: Mapping[str, str]) -> None:
        import wandb

        logged = {tag: wandb.Image(path) for tag, path in images.items()}
        logged.update({tag: wandb.Video(path, format="mp4") for tag, path in videos.items()})
        self._run.log(logged, step=step)

    def close(self) -> None:
        self._run.finish()
