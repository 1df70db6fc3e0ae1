"""Experiment tracking for researchers (Prometheus stays for operations): TensorBoard event files and Weights &
Biases, fed by process 0 from the same per-step numbers as the step log.

``open_trackers(tracking, start_step)`` (``config.train_config.TrackingConfig``) returns the configured trackers
behind one ``Trackers`` object; each takes ``scalars(step, values)`` and ``close()``. A resumed run continues the
same history: TensorBoard purges the events at or after the step it restarts from, like the step log; W&B resumes
its run and ignores steps it already has.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from wanloom_api.metrics import EXPERT_LABELS
from wanloom_trainer.config.train_config import TrackingConfig
from wanloom_trainer.metrics.records import StepLog

log = logging.getLogger(__name__)


class Tracker(Protocol):
    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...

    def media(self, step: int, images: Mapping[str, str], videos: Mapping[str, str]) -> None:
        """PNG and mp4 files (local paths) under their tags."""
        ...

    def close(self) -> None: ...


def artifact_dir(checkpoint_uri: str | None, run_dir: str, name: str) -> str:
    """Where a run keeps ``name`` (tensorboard, samples): ``<run dir>/<name>`` for a local (or no) checkpoint root,
    else ``<name>/`` beside the gs:// checkpoint root (a pod's run directory does not outlive it)."""
    root = checkpoint_uri
    if root is None or not root.startswith("gs://"):
        return f"{run_dir}/{name}"
    parent = root.rstrip("/").rpartition("/")[0]
    return f"{parent if parent != 'gs:/' else root.rstrip('/')}/{name}"


def tensorboard_dir(tracking: TrackingConfig) -> str:
    """``spec.tracking.tensorboardUri``, else the run's ``artifact_dir`` "tensorboard"."""
    if tracking.spec.tensorboard_uri is not None:
        return tracking.spec.tensorboard_uri
    return artifact_dir(tracking.checkpoint_uri, tracking.run_dir, "tensorboard")


def step_scalars(record: StepLog) -> dict[str, float]:
    """A step's numbers under the names the trackers show (``train/``, per expert ``train/loss/high_noise``)."""
    values = {
        "train/loss": record.loss,
        "perf/step_time_s": record.step_time_s,
        "perf/tokens_per_s": record.tokens_per_s,
        "perf/data_wait_s": record.data_wait_s,
    }
    if record.mfu is not None:
        values["perf/mfu"] = record.mfu
    for per_expert, prefix in (
        (record.expert_loss, "train/loss"),
        (record.grad_norm, "train/grad_norm"),
        (record.learning_rate, "train/learning_rate"),
    ):
        values.update({f"{prefix}/{EXPERT_LABELS[e]}": float(v) for e, v in per_expert.items()})
    return values


class Trackers:
    """Every configured tracker; a tracker that fails is reported once and dropped: tracking never stops a run."""

    def __init__(self, trackers: list[tuple[str, Tracker]]) -> None:
        self._trackers = trackers

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._trackers]

    def step(self, record: StepLog) -> None:
        self.scalars(record.step, step_scalars(record))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._each("scalars", step, values)

    def media(self, step: int, images: Mapping[str, str], videos: Mapping[str, str]) -> None:
        self._each("media", step, images, videos)

    def _each(self, method: str, *args: Any) -> None:
        for name, tracker in list(self._trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # any tracker failure: report it, drop the tracker, keep training
                log.warning("tracking: %s failed (%s); no more %s records this run", name, exc, name)
                self._trackers.remove((name, tracker))

    def close(self) -> None:
        for name, tracker in self._trackers:
            try:
                tracker.close()
            except Exception as exc:
                log.warning("tracking: closing %s failed (%s)", name, exc)


def open_trackers(tracking: TrackingConfig, start_step: int) -> Trackers:
    """The trackers ``spec.tracking`` asks for (call on process 0 only)."""
    trackers: list[tuple[str, Any]] = []
    if tracking.spec.tensorboard:
        from wanloom_trainer.tracking.tensorboard import TensorBoardTracker

        trackers.append(("tensorboard", TensorBoardTracker(tensorboard_dir(tracking), start_step)))
    if tracking.spec.wandb is not None:
        from wanloom_trainer.tracking.wandb_tracker import WandbTracker

        trackers.append(("wandb", WandbTracker(tracking, start_step)))
    return Trackers(trackers)
