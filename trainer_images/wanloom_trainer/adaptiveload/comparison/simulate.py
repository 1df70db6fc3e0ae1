"""A synthetic mixed image/video dataset for comparing planning policies (``adaptiveload.comparison.compare``).

The dataset follows the published statistics of public corpora (the Panda-70M, WebVid-10M and OpenVid-1M papers);
none of them ships per-clip metadata in a package here, so the shape distribution is built from these assumptions:

- **images vs clips**: 30% still images (WebDataset-style image shards), 70% clips (Koala-36M/Panda-70M-style);
  the AdaptiveLoad paper mixes WebDataset and Koala-36M without giving the ratio.
- **clip duration**: log-normal with mean 8.5 s (Panda-70M's mean clip length) and log-σ 0.6, sampled at 16 fps;
  a clip gets the longest frame bucket ``F = 1 + 16·j`` (17, 33, 49, 65, 81 frames) it fills, so with Wan's
  81-frame window ≈70% of clips fill the top bucket and ≈30% are shorter.
- **resolution**: 40% of clips come from 720p-or-better sources (Panda-70M/HD-VILA, OpenVid-1M's 1080p part) and
  train in the 720p bucket, 60% in the 480p bucket (WebVid's ~336×596 previews and other low-res sources);
  images split 50/50.
- **aspect**: clips 85% landscape 16:9, 10% portrait 9:16, 5% square; images 50% / 30% / 20%. Buckets per tier:
  720×1280, 1280×720, 960×960 and 480×832, 832×480, 624×624 (equal pixel counts per tier, Wan's sizes).

``MixSpec.scale`` shrinks every side (keeping frames) for a tiny-model version of the same mix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wanloom_trainer.adaptiveload.sizing.shape_index import SampleShapes
from wanloom_trainer.adaptiveload.sizing.tokens import latent_shapes_for_pixels
from wanloom_trainer.config.variants import WanVariant

_TIERS = {
    "720p": ((720, 1280), (1280, 720), (960, 960)),
    "480p": ((480, 832), (832, 480), (624, 624)),
}


@dataclass(frozen=True)
class MixSpec:
    """Parameters of the synthetic distribution (defaults: the assumptions in the module docstring)."""

    image_share: float = 0.30
    clip_720p_share: float = 0.40
    image_720p_share: float = 0.50
    duration_mean_s: float = 8.5
    duration_log_sigma: float = 0.6
    fps: int = 16
    frame_buckets: tuple[int, ...] = (17, 33, 49, 65, 81)
    clip_aspects: tuple[float, float, float] = (0.85, 0.10, 0.05)
    image_aspects: tuple[float, float, float] = (0.50, 0.30, 0.20)
    scale: int = 1

    def pixel_shapes(self, n: int, seed: int) -> np.ndarray:
        """(frames, height, width) int64 [n] drawn from the mix."""
        rng = np.random.default_rng([seed, 0xD15])
        is_image = rng.random(n) < self.image_share
        frames = np.where(is_image, 1, self._clip_frames(rng, n))
        hi_res = rng.random(n) < np.where(is_image, self.image_720p_share, self.clip_720p_share)
        aspect = np.where(is_image, rng.choice(3, n, p=self.image_aspects), rng.choice(3, n, p=self.clip_aspects))
        sizes = np.array([_TIERS["480p"], _TIERS["720p"]])  # [tier, aspect, (h, w)]
        hw = sizes[hi_res.astype(int), aspect] // self.scale
        return np.column_stack([frames, hw])

    def _clip_frames(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = np.log(self.duration_mean_s) - self.duration_log_sigma**2 / 2  # log-normal with the given mean
        seconds = rng.lognormal(mu, self.duration_log_sigma, n)
        buckets = np.asarray(self.frame_buckets)
        fits = np.searchsorted(buckets, seconds * self.fps, side="right") - 1
        return buckets[np.clip(fits, 0, len(buckets) - 1)]


def synthetic_index(variant: WanVariant, n: int, seed: int = 0, mix: MixSpec | None = None) -> SampleShapes:
    """A shape index of ``n`` samples drawn from ``mix``; pixel sizes are rounded down to what the variant's VAE
    stride × patch size accepts."""
    pixels = (mix or MixSpec()).pixel_shapes(n, seed)
    unit = np.array([1, variant.vae_stride[1] * variant.patch_size[1], variant.vae_stride[2] * variant.patch_size[2]])
    pixels[:, 1:] = np.maximum(pixels[:, 1:] // unit[1:], 1) * unit[1:]
    return SampleShapes.from_arrays(latent_shapes_for_pixels(variant, pixels))
