"""Bringing a stored latent to its micro-batch's bucket shape: shorten, centre-crop to the aspect, resample.

The planner may put a sample into a bucket smaller than its own shape (``adaptiveload.sizing.buckets``: clips are
shortened, never padded; the aspect is cropped; the area is scaled). Datasets prepared into the same buckets the
run uses never take this path; it exists so a dataset prepared at other sizes still trains. Resampling is
separable: area averaging when shrinking, linear interpolation (half-pixel centres) when growing.
"""

from __future__ import annotations

import numpy as np


def fit_latents(x_cthw: np.ndarray, target: tuple[int, int, int]) -> np.ndarray:
    """[C, T, H, W] → [C, T', H', W'] for ``target`` = (T', H', W'); returns the input itself when it fits."""
    t_out, h_out, w_out = (int(v) for v in target)
    _, t, h, w = x_cthw.shape
    if (t, h, w) == (t_out, h_out, w_out):
        return x_cthw
    if t < t_out:
        raise ValueError(f"cannot fit a latent with {t} frames into a bucket with {t_out}: clips are never padded")
    x = x_cthw[:, :t_out]
    # Centre-crop the side that is too long for the bucket's aspect ratio.
    if h * w_out > w * h_out:
        keep = max(1, round(w * h_out / w_out))
        top = (h - keep) // 2
        x = x[:, :, top : top + keep]
    elif h * w_out < w * h_out:
        keep = max(1, round(h * w_out / h_out))
        left = (w - keep) // 2
        x = x[:, :, :, left : left + keep]
    rows, cols = resample_matrix(x.shape[2], h_out), resample_matrix(x.shape[3], w_out)
    # Two matmuls, not einsum: einsum's contraction-path search cost ~175 µs per call in the loading thread.
    return (rows @ np.asarray(x, np.float32) @ cols.T).astype(np.float32, copy=False)


def resample_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] weights: box-filter coverage when n_out < n_in, linear interpolation otherwise."""
    if n_in == n_out:
        return np.eye(n_in, dtype=np.float32)
    if n_out < n_in:
        scale = n_in / n_out
        lo = np.arange(n_out)[:, None] * scale
        edges = np.arange(n_in + 1)[None, :]
        overlap = np.clip(np.minimum(edges[:, 1:], lo + scale) - np.maximum(edges[:, :-1], lo), 0.0, None)
        return (overlap / scale).astype(np.float32)
    centres = (np.arange(n_out) + 0.5) * n_in / n_out - 0.5
    centres = np.clip(centres, 0.0, n_in - 1)
    left = np.floor(centres).astype(np.int64)
    right = np.minimum(left + 1, n_in - 1)
    frac = centres - left
    m = np.zeros((n_out, n_in), dtype=np.float32)
    m[np.arange(n_out), left] += 1.0 - frac
    m[np.arange(n_out), right] += frac
    return m
