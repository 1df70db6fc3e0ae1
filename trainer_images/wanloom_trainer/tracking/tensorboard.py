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

    def media(self, step: int, images: Mapping[str, str], videos: Mapping[str, str]) -> None:
        """Images only: tensorboardX encodes videos through moviepy, which the images do not ship; the mp4 files
        sit beside the event files' run (``samples/``)."""
        import numpy as np
        from PIL import Image

        for tag, path in images.items():
            self._writer.add_image(
                tag, np.asarray(Image.open(path).convert("RGB")), global_step=step, dataformats="HWC"
            )

    def close(self) -> None:
        self._writer.close()
