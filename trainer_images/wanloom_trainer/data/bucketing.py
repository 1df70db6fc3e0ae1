"""Pixel buckets for ``wanloom data prepare``: which (frames, height, width) a source becomes, and the resize/crop.

The choice follows the same order as the planner's latent buckets (``adaptiveload.sizing.buckets``), in pixels:

1. frames: images go to image buckets (frames = 1); clips to the clip bucket with the most frames they can fill;
2. aspect: the closest aspect ratio (the excess is centre-cropped);
3. area: the largest bucket not bigger than the source (downscale), else the smallest (upscale).

A clip shorter than every clip bucket, or an image when no image bucket exists, is skipped and reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from wanloom_trainer.config.variants import WanVariant

_ASPECT_TIE = 1e-6


@dataclass(frozen=True, order=True)
class Bucket:
    frames: int
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.frames}x{self.height}x{self.width}"


def parse_bucket(text: str) -> Bucket:
    """'81x480x832' → Bucket(81, 480, 832)."""
    try:
        f, h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"bucket {text!r} is not FRAMESxHEIGHTxWIDTH, e.g. 81x480x832 or 1x480x832") from None
    return Bucket(f, h, w)


def validate_buckets(buckets: tuple[Bucket, ...], variant: WanVariant) -> None:
    """Every bucket must encode to whole latents and patches of ``variant``; errors name the bucket."""
    if not buckets:
        raise ValueError("no buckets configured; pass e.g. --bucket 1x480x832 --bucket 81x480x832")
    st, sh, sw = variant.vae_stride
    _, ph, pw = variant.patch_size
    for b in buckets:
        if b.frames < 1 or (b.frames - 1) % st:
            raise ValueError(f"bucket {b}: frames must be 1 or 1 + a multiple of {st} (the VAE's time stride)")
        if b.height < sh * ph or b.width < sw * pw or b.height % (sh * ph) or b.width % (sw * pw):
            raise ValueError(
                f"bucket {b}: height and width must be positive multiples of {sh * ph} and {sw * pw} "
                f"(VAE stride × patch size of {variant.name})"
            )


def choose_bucket(buckets: tuple[Bucket, ...], frames: int, height: int, width: int, is_image: bool) -> Bucket | None:
    """The bucket for a source of ``frames`` × ``height`` × ``width`` (rule in the module docstring), or None."""
    fitting = [b for b in buckets if (b.frames == 1) == is_image and b.frames <= frames]
    if not fitting:
        return None
    most = max(b.frames for b in fitting)
    fitting = [b for b in fitting if b.frames == most]
    aspect = math.log(height / width)
    best = min(abs(math.log(b.height / b.width) - aspect) for b in fitting)
    fitting = [b for b in fitting if abs(math.log(b.height / b.width) - aspect) <= best + _ASPECT_TIE]
    smaller = [b for b in fitting if b.height * b.width <= height * width]
    if smaller:
        return max(smaller, key=lambda b: (b.height * b.width, b))
    return min(fitting, key=lambda b: (b.height * b.width, b))


def resize_crop(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [F, H, W, 3] → [F, height, width, 3]: scale to cover the target, then centre-crop."""
    from PIL import Image

    _, h, w, _ = frames.shape
    scale = max(height / h, width / w)
    new_h, new_w = max(height, round(h * scale)), max(width, round(w * scale))
    top, left = (new_h - height) // 2, (new_w - width) // 2
    out = np.empty((len(frames), height, width, 3), dtype=np.uint8)
    for i, frame in enumerate(frames):
        img = Image.fromarray(frame).resize((new_w, new_h), Image.Resampling.BICUBIC, reducing_gap=2.0)
        out[i] = np.asarray(img)[top : top + height, left : left + width]
    return out
