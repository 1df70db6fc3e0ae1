"""TensorBoard event files through tensorboardX (no TensorFlow or torch needed; writes local paths and gs://): the
per-step scalars, the validation losses, contact sheets and the validation clips (as animated GIFs).

The writes run on a thread of their own. tensorboardX blocks its caller once its small queue is full, and on gs://
the queue fills whenever storage stalls: training would stop for as long as the bucket is away (a checkpoint outage
that the run otherwise waits out). Here a stall costs events instead, dropped and counted once the queue is full.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

# How often buffered events reach the file (seconds): on gs:// every flush rewrites the whole object.
FLUSH_SECONDS = 30
QUEUE_CALLS = 1000  # steps' worth of scalars held while storage stalls, before new ones are dropped
CLOSE_TIMEOUT_S = 60.0  # the last flush at the end of a run; past it the events not yet written are given up


class TensorBoardTracker:
    """One event file per run segment under ``logdir``; a resume purges the events at or after ``start_step``."""

    def __init__(self, logdir: str, start_step: int, queue_calls: int = QUEUE_CALLS) -> None:
        self.logdir = logdir
        self.dropped = 0  # calls not written: the queue was full (storage stalled)
        self._calls: queue.Queue[Callable[[], object] | None] = queue.Queue(maxsize=queue_calls)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, args=(start_step,), name="tensorboard", daemon=True)
        self._thread.start()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        pairs = [(tag, float(value)) for tag, value in values.items()]
        self._submit(lambda: [self._writer.add_scalar(tag, value, global_step=step) for tag, value in pairs])

    def media(self, step: int, images: Mapping[str, str], videos: Mapping[str, str]) -> None:
        """PNGs as image summaries; mp4 clips as animated GIF image summaries, which TensorBoard plays (what
        tensorboardX's ``add_video`` writes, encoded here with Pillow instead of moviepy). The files are read now:
        the caller may remove them once this returns."""
        import numpy as np
        from PIL import Image

        pictures = {tag: np.asarray(Image.open(path).convert("RGB")) for tag, path in images.items()}
        clips = {tag: gif_summary(tag, read_frames(path)) for tag, path in videos.items()}

        def write() -> None:
            for tag, picture in pictures.items():
                self._writer.add_image(tag, picture, global_step=step, dataformats="HWC")
            for clip in clips.values():
                self._writer._get_file_writer().add_summary(clip, step)

        self._submit(write)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        if self._thread.is_alive():  # a writer that failed takes nothing more from the queue
            with contextlib.suppress(queue.Full):
                self._calls.put(None, timeout=timeout_s)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("tensorboard: events not written to %s within %.0f s (storage unreachable?); given up",
                        self.logdir, timeout_s)  # fmt: skip
        if self.dropped:
            log.warning("tensorboard: %d records dropped while %s did not keep up", self.dropped, self.logdir)
        self._raise()

    def _submit(self, call: Callable[[], object]) -> None:
        self._raise()
        try:
            self._calls.put_nowait(call)
        except queue.Full:
            if not self.dropped:
                log.warning("tensorboard: %s does not keep up (storage stalled?); records are dropped until it "
                            "does", self.logdir)  # fmt: skip
            self.dropped += 1

    def _raise(self) -> None:
        """The writer's failure, in the caller (``Trackers`` then drops this tracker)."""
        if self._error is not None:
            raise self._error

    def _write(self, start_step: int) -> None:
        try:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(
                self.logdir, purge_step=start_step if start_step > 0 else None, flush_secs=FLUSH_SECONDS
            )
            while (call := self._calls.get()) is not None:
                call()
            self._writer.close()
        except Exception as exc:  # reported by the next call from the run
            self._error = exc


def read_frames(path: str) -> list:
    """An mp4's frames as uint8 [H, W, 3] arrays."""
    import av

    with av.open(path) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def gif_summary(tag: str, frames: list, fps: int = 16) -> object:
    """An image ``Summary`` holding ``frames`` as an animated GIF."""
    import io

    from PIL import Image
    from tensorboardX.proto.summary_pb2 import Summary

    buffer = io.BytesIO()
    pictures = [Image.fromarray(f) for f in frames]
    pictures[0].save(buffer, format="GIF", save_all=True, append_images=pictures[1:], duration=1000 // fps, loop=0)
    height, width = frames[0].shape[:2]
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=buffer.getvalue())
    return Summary(value=[Summary.Value(tag=tag, image=image)])
