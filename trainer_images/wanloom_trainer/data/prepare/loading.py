"""The CPU side of data preparation: read, decode and resize each source into its bucket, on a pool of processes.

Decoding video is CPU work that would otherwise leave the accelerator idle between batches, so a pod runs it on
``workers`` processes (sized to the pod's CPU request; the operator sets ``WANLOOM_DECODE_WORKERS``) while its main
process encodes. Results come back in input order whatever the pool does, so a unit's bytes do not depend on the
number of workers. Each result carries the seconds its source spent in each CPU stage (``stages.py``).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import BinaryIO

import numpy as np

from wanloom_api.keys import ENV_DECODE_WORKERS
from wanloom_trainer.data.bucketing import Bucket, choose_bucket, resize_crop
from wanloom_trainer.data.prepare.media import MediaError, load_media
from wanloom_trainer.data.prepare.sources import SourceItem, open_media
from wanloom_trainer.data.storage import GCS_SCHEME, TransientStorageError, is_transient


@dataclass(frozen=True)
class LoadSettings:
    buckets: tuple[Bucket, ...]
    fps: float


@dataclass(frozen=True)
class Loaded:
    """One source after the CPU stages: its pixels in ``bucket``, or why it is skipped (``reason``)."""

    item: SourceItem
    bucket: Bucket | None = None
    pixels: np.ndarray | None = None
    fps: float = 0.0
    reason: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # read, decode, resize


class _TimedReader:
    """A binary stream that adds the time spent in its reads and seeks to ``seconds`` (the "read" stage: a
    ranged GCS read or the local disk), so decode time is what is left."""

    def __init__(self, stream: BinaryIO, name: str) -> None:
        self._stream = stream
        self.name = name
        self.seconds = 0.0

    def __repr__(self) -> str:  # decoders' errors quote the stream: the source's name keeps skip lists reproducible
        return repr(self.name)

    def _timed(self, call: str, *args: int) -> object:
        started = time.perf_counter()
        try:
            return getattr(self._stream, call)(*args)
        finally:
            self.seconds += time.perf_counter() - started

    def read(self, size: int = -1) -> bytes:
        return self._timed("read", size)  # type: ignore[return-value]

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._timed("seek", offset, whence)  # type: ignore[return-value]

    def tell(self) -> int:
        return self._stream.tell()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


def load_item(item: SourceItem, settings: LoadSettings) -> Loaded:
    """Read, decode and resize one source (in a pool worker); a source that cannot be used comes back with its
    reason ("<kind>: <detail>", the kinds of ``sources.SKIP_KINDS``), never as an exception."""
    if item.problem is not None:
        return Loaded(item, reason=item.problem)
    max_frames = max(b.frames for b in settings.buckets)
    started = time.perf_counter()
    try:
        with open_media(item.uri) as media, _opened(media) as stream:
            reader = _TimedReader(stream, item.uri)
            clip = load_media(
                reader,  # type: ignore[arg-type]
                settings.fps,
                max_frames,
                name=item.uri,
                start=item.start,
                end=item.end,
            )
    except (MediaError, FileNotFoundError) as exc:
        kind = "missing" if isinstance(exc, FileNotFoundError) else "undecodable"
        return Loaded(item, reason=f"{kind}: {exc}")
    except Exception as exc:
        if not isinstance(exc, TransientStorageError) and not (item.uri.startswith(GCS_SCHEME) and is_transient(exc)):
            raise
        # Storage is down, not the source: the caller waits and redoes the unit. A plain OSError crosses the pool.
        raise TransientStorageError(f"{item.uri}: {exc}") from None
    loaded = time.perf_counter()
    _, h, w, _ = clip.frames.shape
    bucket = choose_bucket(settings.buckets, len(clip.frames), h, w, clip.is_image)
    if bucket is None:
        reason = f"no-bucket: fits no bucket ({len(clip.frames)} frames at {settings.fps:g} fps, {h}x{w})"
        return Loaded(item, reason=reason)
    pixels = resize_crop(clip.frames[: bucket.frames], bucket.height, bucket.width)
    seconds = {
        "read": reader.seconds,
        "decode": loaded - started - reader.seconds,
        "resize": time.perf_counter() - loaded,
    }
    return Loaded(item, bucket, pixels, clip.fps, seconds=seconds)


def decode_workers() -> int:
    """Pool size: ``$WANLOOM_DECODE_WORKERS`` where set (0: decode in the main process), else the CPUs this
    process may use, less one for the main process."""
    value = os.environ.get(ENV_DECODE_WORKERS)
    if value is None:
        return max(1, len(os.sched_getaffinity(0)) - 1)
    if not value.strip().isdigit():
        raise ValueError(f"{ENV_DECODE_WORKERS}={value!r}: must be a whole number of processes (0: no pool)")
    return int(value)


@contextmanager
def _opened(media: Path | BinaryIO) -> Iterator[BinaryIO]:
    """A local file opened for reading (closed after), or the stream as it is (its owner closes it)."""
    if isinstance(media, Path):
        with media.open("rb") as f:
            yield f
    else:
        yield media


def load_all(items: Iterable[SourceItem], settings: LoadSettings, workers: int) -> Iterator[Loaded]:
    """``load_item`` of every item, in order: inline with 0 workers, else on a pool of ``workers`` processes that
    keeps at most ``2 * workers`` sources in flight (the memory of a few decoded clips per worker)."""
    if workers <= 0:
        for item in items:
            yield load_item(item, settings)
        return
    # spawn, not fork: the main process may already hold JAX or CUDA state, which a forked child must not inherit.
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"))
    try:
        pending: deque[Future[Loaded]] = deque()
        for item in items:
            pending.append(pool.submit(load_item, item, settings))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # also when the consumer stops early (an error, a stopped run): queued sources are dropped
        pool.shutdown(wait=True, cancel_futures=True)
