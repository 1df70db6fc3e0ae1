"""Transformer sequence length per sample, vectorised over a dataset.

``S = (T'/pt) · (H'/ph) · (W'/pw)`` with the latent ``T' = (F − 1)/sT + 1``, ``H' = H/sH``, ``W' = W/sW`` from the
variant's VAE strides and patch size (``config.variants``). Images are one-frame samples (T' = 1). Examples
(A14B): 720×1280×81 → 21×90×160 latent → 75,600 tokens; an image at 720×1280 → 3,600.
"""

from __future__ import annotations

import numpy as np

from wanloom_trainer.config.variants import WanVariant


def latent_shapes_for_pixels(variant: WanVariant, frames_hw: np.ndarray) -> np.ndarray:
    """Pixel (F, H, W) [n, 3] → latent (T', H', W') [n, 3] with the variant's VAE strides.

    Raises:
        ValueError: if a frame count is not 1 + a multiple of the temporal stride, or H/W is not a multiple of
            stride × patch (the VAE and the patch embedding would crop silently).
    """
    fhw = np.atleast_2d(np.asarray(frames_hw, dtype=np.int64))
    st, sh, sw = variant.vae_stride
    _, ph, pw = variant.patch_size
    f, h, w = fhw[:, 0], fhw[:, 1], fhw[:, 2]
    _require(f >= 1, fhw, "frames must be >= 1")
    _require((f - 1) % st == 0, fhw, f"frames must be 1 + a multiple of the VAE temporal stride {st}")
    _require(h % (sh * ph) == 0, fhw, f"height must be a multiple of {sh * ph} (VAE stride {sh} × patch {ph})")
    _require(w % (sw * pw) == 0, fhw, f"width must be a multiple of {sw * pw} (VAE stride {sw} × patch {pw})")
    return np.stack([(f - 1) // st + 1, h // sh, w // sw], axis=1)


def tokens_for_latents(variant: WanVariant, latent_shapes: np.ndarray) -> np.ndarray:
    """Latent (T', H', W') [n, 3] → tokens int64 [n].

    Raises:
        ValueError: if a latent dimension is not a multiple of the patch size.
    """
    shapes = np.atleast_2d(np.asarray(latent_shapes, dtype=np.int64))
    patch = np.asarray(variant.patch_size, dtype=np.int64)
    _require(
        (shapes % patch == 0).all(axis=1), shapes, f"latent shape must be a multiple of patch {variant.patch_size}"
    )
    return np.prod(shapes // patch, axis=1)


def tokens_for_pixels(variant: WanVariant, frames_hw: np.ndarray) -> np.ndarray:
    """Pixel (F, H, W) [n, 3] → tokens int64 [n]."""
    return tokens_for_latents(variant, latent_shapes_for_pixels(variant, frames_hw))


def _require(ok: np.ndarray, rows: np.ndarray, message: str) -> None:
    ok = np.asarray(ok)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise ValueError(f"{message}; row {bad} is {tuple(int(x) for x in rows[bad])}")
