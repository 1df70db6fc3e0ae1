"""Decoding source media into RGB frames: images with Pillow, videos with PyAV (FFmpeg bundled in its wheel).

Videos are resampled in time to the training frame rate while decoding (frames are picked at the target rate
and decoding stops once enough are held), so a long source never sits in memory whole. A clip cut from a longer
video (``start``/``end`` seconds, from a manifest) seeks to the key frame before ``start`` and keeps the frames
whose timestamps fall in [start, end). Sources are paths or open binary files (a ranged GCS reader: the corpus is
never copied whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

Media = Path | BinaryIO  # a file, or an open binary stream (seekable)

IMAGE_EXTS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})
VIDEO_EXTS = frozenset({".mp4", ".mov", ".webm", ".mkv", ".avi", ".m4v"})
_FALLBACK_FPS = 16.0


class MediaError(ValueError):
    """A source file that cannot be decoded (it is skipped and reported, not fatal)."""


@dataclass(frozen=True)
class Clip:
    """Decoded frames uint8 [F, H, W, 3] at ``fps`` frames per second (0 for an image)."""

    frames: np.ndarray
    fps: float

    @property
    def is_image(self) -> bool:
        return self.fps == 0.0


def media_kind(path: Path | str) -> str | None:
    ext = Path(str(path)).suffix.lower()
    return "image" if ext in IMAGE_EXTS else "video" if ext in VIDEO_EXTS else None


def load_image(media: Media, name: str | None = None) -> Clip:
    from PIL import Image, UnidentifiedImageError

    name = name or str(media)
    try:
        with Image.open(media) as img:
            rgb = np.asarray(img.convert("RGB"))
    except (OSError, UnidentifiedImageError) as exc:
        raise MediaError(f"{name}: cannot decode image: {exc}") from exc
    return Clip(rgb[None], 0.0)


def load_video(
    media: Media,
    fps: float,
    max_frames: int,
    *,
    name: str | None = None,
    start: float | None = None,
    end: float | None = None,
) -> Clip:
    """Up to ``max_frames`` frames sampled at ``fps`` (or the source rate if that is lower), from ``start`` to
    ``end`` seconds when given."""
    import av

    if fps <= 0 or max_frames < 1:
        raise ValueError(f"fps must be > 0 and max_frames >= 1, got {fps}, {max_frames}")
    name = name or str(media)
    try:
        with av.open(str(media) if isinstance(media, Path) else media) as container:
            stream = container.streams.video[0]
            src = float(stream.average_rate or stream.guessed_rate or _FALLBACK_FPS)
            rate = min(fps, src)
            decoded = container.decode(stream)
            if start is not None or end is not None:
                if start and stream.time_base:
                    container.seek(int(start / stream.time_base), stream=stream, backward=True, any_frame=False)
                decoded = _between(container.decode(stream), start or 0.0, end, 0.5 / src)
            frames = _sample_frames(decoded, src / rate, max_frames)
    except (av.FFmpegError, IndexError, OSError) as exc:
        raise MediaError(f"{name}: cannot decode video: {exc}") from exc
    if not frames:
        where = "" if start is None and end is None else f" between {start or 0:g} s and {end} s"
        raise MediaError(f"{name}: the video holds no frames{where}")
    return Clip(np.stack(frames), rate)


def _between(decoded: object, start: float, end: float | None, slack: float) -> object:
    """The decoded frames whose timestamps fall in [start, end) (half a source frame of slack for rounding)."""
    for frame in decoded:  # type: ignore[attr-defined]
        t = float(frame.time) if frame.time is not None else 0.0
        if t < start - slack:
            continue
        if end is not None and t >= end - slack:
            return
        yield frame


def _sample_frames(decoded: object, step: float, max_frames: int) -> list[np.ndarray]:
    """Keep source frame n when n = round(j·step) for the next j (step ≥ 1: source frames per output frame)."""
    out: list[np.ndarray] = []
    for n, frame in enumerate(decoded):  # type: ignore[call-overload]
        if n == round(len(out) * step):
            out.append(frame.to_ndarray(format="rgb24"))
            if len(out) == max_frames:
                break
    return out


def load_media(
    media: Media,
    fps: float,
    max_frames: int,
    *,
    name: str | None = None,
    start: float | None = None,
    end: float | None = None,
) -> Clip:
    """An image or a video (kind by the extension of ``name``, else of the path)."""
    name = name or str(media)
    kind = media_kind(name)
    if kind == "image":
        return load_image(media, name)
    if kind == "video":
        return load_video(media, fps, max_frames, name=name, start=start, end=end)
    raise MediaError(f"{name}: unsupported extension; images: {sorted(IMAGE_EXTS)}, videos: {sorted(VIDEO_EXTS)}")
