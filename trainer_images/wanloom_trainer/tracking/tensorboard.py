"""TensorBoard event files through tensorboardX (no TensorFlow or torch needed; writes local paths and gs://): the
per-step scalars, the validation losses, contact sheets and the validation clips (as animated GIFs)."""

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
        """PNGs as image summaries; mp4 clips as animated GIF image summaries, which TensorBoard plays (what
        tensorboardX's ``add_video`` writes, encoded here with Pillow instead of moviepy)."""
        import numpy as np
        from PIL import Image

        for tag, path in images.items():
            self._writer.add_image(
                tag, np.asarray(Image.open(path).convert("RGB")), global_step=step, dataformats="HWC"
            )
        for tag, path in videos.items():
            self._writer._get_file_writer().add_summary(gif_summary(tag, read_frames(path)), step)

    def close(self) -> None:
        self._writer.close()


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
