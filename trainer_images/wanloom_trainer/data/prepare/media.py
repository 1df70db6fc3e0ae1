"""Decoding source media into RGB frames: images with Pillow, videos with PyAV (FFmpeg bundled in its wheel).

Videos are resampled in time to the training frame rate while decoding (frames are picked at the target rate
and decoding stops once enough are held), so a long source never sits in memory whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

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


def media_kind(path: Path) -> str | None:
    ext = path.suffix.lower()
    return "image" if ext in IMAGE_EXTS else "video" if ext in VIDEO_EXTS else None


def load_image(path: Path) -> Clip:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            rgb = np.asarray(img.convert("RGB"))
    except (OSError, UnidentifiedImageError) as exc:
        raise MediaError(f"{path}: cannot decode image: {exc}") from exc
    return Clip(rgb[None], 0.0)


def load_video(path: Path, fps: float, max_frames: int) -> Clip:
    """Up to ``max_frames`` frames sampled at ``fps`` (or the source rate if that is lower)."""
    import av

    if fps <= 0 or max_frames < 1:
        raise ValueError(f"fps must be > 0 and max_frames >= 1, got {fps}, {max_frames}")
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            src = float(stream.average_rate or stream.guessed_rate or _FALLBACK_FPS)
            rate = min(fps, src)
            frames = _sample_frames(container.decode(stream), src / rate, max_frames)
    except (av.FFmpegError, IndexError, OSError) as exc:
        raise MediaError(f"{path}: cannot decode video: {exc}") from exc
    if not frames:
        raise MediaError(f"{path}: the video holds no frames")
    return Clip(np.stack(frames), rate)


def _sample_frames(decoded: object, step: float, max_frames: int) -> list[np.ndarray]:
    """Keep source frame n when n = round(j·step) for the next j (step ≥ 1: source frames per output frame)."""
    out: list[np.ndarray] = []
    for n, frame in enumerate(decoded):  # type: ignore[call-overload]
        if n == round(len(out) * step):
            out.append(frame.to_ndarray(format="rgb24"))
            if len(out) == max_frames:
                break
    return out


def load_media(path: Path, fps: float, max_frames: int) -> Clip:
    kind = media_kind(path)
    if kind == "image":
        return load_image(path)
    if kind == "video":
        return load_video(path, fps, max_frames)
    raise MediaError(f"{path}: unsupported extension; images: {sorted(IMAGE_EXTS)}, videos: {sorted(VIDEO_EXTS)}")
