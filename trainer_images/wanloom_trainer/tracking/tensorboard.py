"""TensorBoard event files through tensorboardX (no TensorFlow or torch needed; writes local paths and gs://)."""

from __future__ import annotations

from collections.abc import Mapping

# How often buffered events reach the file (seconds): on gs:// every flush rewrites the whole object.
FLUSH_SECONDS = 30


class TensorBoardTracker:
    """One event file per run segment under ``logdir``; a resume purges the events at or after ``start_step``."""

    def __init__(self, logdir: str, start_step: int) -> None:
        from tensorboardX import SummaryWriter

        self.logdir = logdir
        self._writer = SummaryWriter(
            logdir, purge_step=start_step if start_step > 0 else None, flush_secs=FLUSH_SECONDS
        )

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, float(value), global_step=step)

    def close(self) -> None:
        self._writer.close()
