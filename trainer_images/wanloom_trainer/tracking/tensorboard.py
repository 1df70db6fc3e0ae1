"""TensorBoard event files through tensorboardX (no TensorFlow or torch needed): the per-step scalars, the
validation losses, contact sheets and the validation clips (as animated GIFs).

tensorboardX always writes to a local folder. For a gs:// ``logdir`` that folder is a staging copy, and a thread
of ours copies its files to the bucket every ``FLUSH_SECONDS`` and at close. Writing through tensorboardX's own
gs:// writer instead held the run up whenever storage stalled: its small queue blocked ``add_scalar``, its exit
hook retried the upload for minutes, and its writer's finalizer uploads once more while the interpreter shuts
down, where the storage client cannot start its thread and the process hangs for good. Here an unreachable bucket
costs nothing: the events wait in the staging folder, and the next copy (or the folder, named in the warning at
close) holds all of them.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from wanloom_trainer.data.storage import GCS_SCHEME, Storage, open_storage

log = logging.getLogger(__name__)

# How often staged events are copied to gs:// (seconds): every copy rewrites each changed event file whole.
FLUSH_SECONDS = 30
CLOSE_TIMEOUT_S = 60.0  # the last copy at the end of a run; past it the events stay in the staging folder


class TensorBoardTracker:
    """One event file per run segment under ``logdir`` (a folder or gs://); a resume purges the events at or after
    ``start_step``."""

    def __init__(self, logdir: str, start_step: int, flush_seconds: float = FLUSH_SECONDS) -> None:
        # On the caller's thread, never on one of ours: tensorboardX imports torch, which parses source, and CPython
        # before 3.11.8 fails two parses at once on different threads ("AST constructor recursion depth mismatch").
        from tensorboardX import SummaryWriter

        self.logdir = logdir
        remote = logdir.startswith(GCS_SCHEME)
        self.local = Path(tempfile.mkdtemp(prefix="wanloom-tensorboard-")) if remote else Path(logdir)
        self._writer = SummaryWriter(
            str(self.local), purge_step=start_step if start_step > 0 else None, flush_secs=flush_seconds
        )
        self._copier = _Copier(self.local, open_storage(logdir), flush_seconds) if remote else None

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, float(value), global_step=step)

    def media(self, step: int, images: Mapping[str, str], videos: Mapping[str, str]) -> None:
        """PNGs as image summaries; mp4 clips as animated GIF image summaries, which TensorBoard plays (what
        tensorboardX's ``add_video`` writes, encoded here with Pillow instead of moviepy)."""
        import numpy as np
        from PIL import Image

        for tag, path in images.items():
            picture = np.asarray(Image.open(path).convert("RGB"))
            self._writer.add_image(tag, picture, global_step=step, dataformats="HWC")
        for tag, path in videos.items():
            self._writer._get_file_writer().add_summary(gif_summary(tag, read_frames(path)), step)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self._writer.close()
        if self._copier is None:
            return
        if self._copier.finish(timeout_s):
            shutil.rmtree(self.local, ignore_errors=True)
        else:
            log.warning("tensorboard: events not copied to %s within %.0f s (storage unreachable?); they are in %s",
                        self.logdir, timeout_s, self.local)  # fmt: skip


class _Copier:
    """Copies the event files that changed under ``local`` to ``storage`` every ``seconds``, on a daemon thread:
    a stalled bucket holds up only this thread, and the process never waits for it past ``finish``'s timeout.

    It copies what tensorboardX's own worker has written (it flushes every ``seconds`` too) and never calls into
    the writer: a flush from here could meet the run's ``close`` on the same file. The last copy, after that close,
    has every event."""

    def __init__(self, local: Path, storage: Storage, seconds: float) -> None:
        self.local, self.storage, self.seconds = local, storage, seconds
        self.copied: dict[str, int] = {}  # relative path -> size last copied
        self._failing = False
        self._deadline = float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorboard-copy", daemon=True)
        self._thread.start()

    def finish(self, timeout_s: float) -> bool:
        """Copies until everything is in the bucket or ``timeout_s`` has passed; False when it did not get there."""
        self._deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive() and not self._failing

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            self._copy()
        while not self._copy() and time.monotonic() < self._deadline:
            time.sleep(min(self.seconds, max(0.0, self._deadline - time.monotonic())))

    def _copy(self) -> bool:
        """Whether every staged file is now in the bucket."""
        try:
            for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
                name, size = path.relative_to(self.local).as_posix(), path.stat().st_size
                if self.copied.get(name) != size:
                    self.storage.upload(name, path)
                    self.copied[name] = size
        except Exception as exc:  # the bucket is away: the files stay staged, the next copy tries again
            if not self._failing:
                log.warning("tensorboard: copying events to %s failed (%s); retried every %g s, nothing is lost "
                            "meanwhile", self.storage.uri, exc, self.seconds)  # fmt: skip
            self._failing = True
            return False
        if self._failing:
            log.info("tensorboard: events reach %s again", self.storage.uri)
        self._failing = False
        return True


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
