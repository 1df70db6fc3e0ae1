"""Shape buckets: the finite set of latent shapes (frame count × resolution) micro-batches are built from.

A sample is resized/cropped by the data loader to its bucket's shape, so every micro-batch of one bucket stacks.
Assignment rule (``BucketTable.assign``), applied in order:

1. frames: the bucket with the most latent frames T'_b ≤ T' (clips are shortened, never padded);
2. aspect: among those, the closest aspect ratio |log(H'_b/W'_b) − log(H'/W')| (the rest is cropped);
3. area: among those, the largest H'_b·W'_b ≤ H'·W' (downscale); if none is that small, the smallest (upscale).

A sample with fewer frames than every bucket has no bucket and is an error naming it.

``derive_buckets`` builds a table from a dataset's shapes when none is configured: the distinct shapes, with the
rarest merged into a smaller bucket (never an upscale or extra frames) until at most ``max_buckets`` remain.
Where a micro-batch holds whole samples whose sequence is split over ``context`` × ``tensor`` ranks, every bucket's
token count must be a multiple of that degree: ``cut_to_token_multiple`` crops derived buckets to such shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wanloom_trainer.adaptiveload.sizing.tokens import latent_shapes_for_pixels, tokens_for_latents
from wanloom_trainer.config.variants import WanVariant

_ASPECT_TIE = 1e-6


@dataclass(frozen=True, eq=False)
class BucketTable:
    """Latent shapes int64 [k, 3] of the buckets, sorted by (tokens, shape)."""

    latent_shapes: np.ndarray

    def __post_init__(self) -> None:
        shapes = np.unique(np.atleast_2d(np.asarray(self.latent_shapes, dtype=np.int64)), axis=0)
        if shapes.ndim != 2 or shapes.shape[1] != 3 or len(shapes) == 0 or (shapes <= 0).any():
            raise ValueError(f"buckets must be a non-empty [k, 3] array of positive (T', H', W'), got {shapes}")
        order = np.lexsort((shapes[:, 2], shapes[:, 1], shapes[:, 0], np.prod(shapes, axis=1)))
        object.__setattr__(self, "latent_shapes", shapes[order])

    def __len__(self) -> int:
        return len(self.latent_shapes)

    @classmethod
    def from_pixels(cls, variant: WanVariant, frames_hw: list[tuple[int, int, int]]) -> BucketTable:
        """Buckets given in pixels (frames, height, width), e.g. from ``spec.adaptiveLoad.buckets``."""
        return cls(latent_shapes_for_pixels(variant, np.asarray(frames_hw)))

    def tokens(self, variant: WanVariant) -> np.ndarray:
        return tokens_for_latents(variant, self.latent_shapes)

    def assign(self, latent_shapes: np.ndarray) -> np.ndarray:
        """Bucket index int64 [n] of each sample's latent shape [n, 3] (rule in the module docstring)."""
        shapes = np.atleast_2d(np.asarray(latent_shapes, dtype=np.int64))
        unique, inverse = np.unique(shapes, axis=0, return_inverse=True)
        chosen = _assign_unique(unique, self.latent_shapes)
        if (chosen < 0).any():
            bad = unique[int(np.flatnonzero(chosen < 0)[0])]
            frames = sorted(set(self.latent_shapes[:, 0].tolist()))
            raise ValueError(
                f"latent shape {tuple(int(x) for x in bad)} has fewer frames than every bucket "
                f"(bucket latent frame counts: {frames}); add a bucket with T' <= {bad[0]}"
            )
        return chosen[inverse.reshape(-1)]


def _assign_unique(shapes: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """Index of the bucket for each of the (few) distinct shapes [u, 3]; -1 where none has few enough frames."""
    t, area = shapes[:, :1], (shapes[:, 1] * shapes[:, 2])[:, None]
    bt, barea = buckets[None, :, 0], (buckets[:, 1] * buckets[:, 2])[None, :]
    ok = bt <= t
    best_t = np.where(ok, bt, -1).max(axis=1, keepdims=True)
    ok &= bt == best_t
    dist = np.abs(np.log(buckets[None, :, 1] / buckets[None, :, 2]) - np.log(shapes[:, 1:2] / shapes[:, 2:3]))
    dist = np.where(ok, dist, np.inf)
    ok &= dist <= dist.min(axis=1, keepdims=True) + _ASPECT_TIE
    fits = ok & (barea <= area)
    down = np.where(fits, barea, -1).argmax(axis=1)
    up = np.where(ok, barea, np.iinfo(np.int64).max).argmin(axis=1)
    chosen = np.where(fits.any(axis=1), down, up)
    return np.where(ok.any(axis=1), chosen, -1)


def derive_buckets(latent_shapes: np.ndarray, max_buckets: int = 32) -> BucketTable:
    """Buckets from a dataset's shapes [n, 3]: distinct shapes, rarest merged down until ≤ ``max_buckets``.

    A shape is merged only into a bucket it can be cut down to (T'_b ≤ T' and H'_b·W'_b ≤ H'·W', and a clip only
    into a clip bucket); shapes with no such bucket stay, so the result can exceed ``max_buckets`` when the data
    leaves no safe merge.
    """
    if max_buckets < 1:
        raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
    unique, counts = np.unique(np.atleast_2d(np.asarray(latent_shapes, dtype=np.int64)), axis=0, return_counts=True)
    keep = np.ones(len(unique), dtype=bool)
    counts = counts.astype(np.int64)
    while keep.sum() > max_buckets:
        merged = False
        for i in np.lexsort((-np.prod(unique, axis=1), counts)):  # rarest first, then the largest
            if not keep[i]:
                continue
            target = _merge_target(unique, keep, i)
            if target >= 0:
                keep[i], counts[target], merged = False, counts[target] + counts[i], True
                break
        if not merged:
            break
    return BucketTable(unique[keep])


def _merge_target(unique: np.ndarray, keep: np.ndarray, i: int) -> int:
    others = np.flatnonzero(keep & (np.arange(len(unique)) != i))
    if len(others) == 0:
        return -1
    j = int(_assign_unique(unique[i : i + 1], unique[others])[0])
    if j < 0:
        return -1
    target = others[j]
    t, tb = unique[i, 0], unique[target, 0]
    same_kind = (t == 1) == (tb == 1)  # a clip never becomes an image
    fits = tb <= t and unique[target, 1] * unique[target, 2] <= unique[i, 1] * unique[i, 2]
    return int(target) if fits and same_kind else -1


def cut_to_token_multiple(table: BucketTable, variant: WanVariant, multiple: int) -> BucketTable:
    """Each bucket cropped to the largest (T', H'_b ≤ H', W'_b ≤ W'), in whole patches, whose token count
    ``multiple`` divides (ties: the closer aspect ratio); buckets it already divides are unchanged."""
    if multiple <= 1:
        return table
    _, ph, pw = variant.patch_size
    cut = []
    for shape in table.latent_shapes.tolist():
        t, h, w = shape
        best = None
        for hb in range(h, max(ph, h - multiple * ph) - 1, -ph):
            for wb in range(w, max(pw, w - multiple * pw) - 1, -pw):
                tokens = int(tokens_for_latents(variant, np.asarray([t, hb, wb]))[0])
                if tokens % multiple:
                    continue
                key = (tokens, -abs(np.log(hb / wb) - np.log(h / w)))
                if best is None or key > best[0]:
                    best = (key, (t, hb, wb))
        if best is None:
            raise ValueError(
                f"no crop of the latent bucket {tuple(shape)} has a token count that {multiple} (context x tensor) "
                "divides; configure spec.adaptiveLoad.buckets"
            )
        cut.append(best[1])
    return BucketTable(np.asarray(cut))


def require_token_multiple(table: BucketTable, variant: WanVariant, multiple: int) -> None:
    """Configured buckets are used as given: one whose token count ``multiple`` does not divide is refused (``wanloom
    validate`` reports the same, with the bucket's index)."""
    tokens = table.tokens(variant)
    bad = np.flatnonzero(tokens % multiple)
    if len(bad):
        shape = tuple(table.latent_shapes[bad[0]].tolist())
        raise ValueError(
            f"spec.adaptiveLoad.buckets: the latent bucket {shape} is {int(tokens[bad[0]]):,} tokens per sample, "
            f"which context x tensor = {multiple} does not divide; choose bucket sizes whose token count it divides"
        )
