"""Packed micro-batches on the host: samples of different shapes laid end to end in rows of one fixed length.

Framework-free (numpy). The layout is the one in docs/architecture.md ("Packed sequences"): a row holds its samples'
tokens one after another, each sample a segment with ids 0, 1, … in order, then padding as one more segment;
every segment slot up to ``groups`` exists (unused ones hold no token, zero text and zero weight), so all rows of a
slot share one shape and one compiled program.

Tokens are latent patches in the model's order: (t, h, w) over the patch grid, each patch flattened as
(pt, ph, pw, channel) — the layout of the patch-embedding kernel and of ``proj_out``'s output, so the loss compares
patches directly and nothing is unpatchified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from wanloom_trainer.backends.interface import RankRows


def patchify(latents_cthw: np.ndarray, patch: tuple[int, int, int]) -> np.ndarray:
    """[C, T, H, W] → [T'·H'·W', pt·ph·pw, C] with T' = T / pt etc., tokens in (t, h, w) order."""
    c, t, h, w = latents_cthw.shape
    pt, ph, pw = patch
    grid = latents_cthw.reshape(c, t // pt, pt, h // ph, ph, w // pw, pw)
    return grid.transpose(1, 3, 5, 2, 4, 6, 0).reshape(-1, pt * ph * pw, c)


def grid_positions(grid_thw: tuple[int, int, int]) -> np.ndarray:
    """int32 [T'·H'·W', 3]: each token's (t, h, w) in its own grid, for 3-D RoPE."""
    return np.stack(np.meshgrid(*(np.arange(n) for n in grid_thw), indexing="ij"), axis=-1).reshape(-1, 3)


@dataclass(frozen=True)
class PackedRows:
    """One rank's packed micro-batch (host arrays): b rows of n tokens, g segment slots per row.

    Attributes:
        sample_ids: int64 [b, g] dataset id of each segment, -1 for padding and unused slots.
        latents, noise: float32 [b, n, Q, C] clean latents and ε as patches (zeros on padding tokens).
        condition: float32 [b, n, Q, Cc] I2V image condition as patches, or None.
        positions: int32 [b, n, 3] token position in its own sample's grid.
        segment_ids: int32 [b, n] non-decreasing; padding is the segment after the row's last sample.
        text: float32 [b, g, L, D_text] each segment's text-encoder states.
        timesteps: float32 [b, g] t in [0, 1000) per segment.
        weights: float32 [b, g] loss weight per segment (0 for padding and unused slots).
        clean_first_frame: float32 [b, n] unified TI2V: 1 on tokens of a first frame kept clean, or None.
        max_segment_tokens: the longest sample the slot may hold (bounds the attention kernel's grid).
    """

    sample_ids: np.ndarray
    latents: np.ndarray
    noise: np.ndarray
    condition: np.ndarray | None
    positions: np.ndarray
    segment_ids: np.ndarray
    text: np.ndarray
    timesteps: np.ndarray
    weights: np.ndarray
    clean_first_frame: np.ndarray | None
    max_segment_tokens: int

    @property
    def rows(self) -> int:
        return len(self.sample_ids)


def pack_rows(
    rows: Sequence[Sequence[RankRows]],
    *,
    row_tokens: int,
    groups: int,
    patch: tuple[int, int, int],
    max_segment_tokens: int,
) -> PackedRows:
    """Lay each row's samples (one-row ``RankRows``, any latent shapes) end to end.

    Args:
        rows: per packed row, its samples in order.
        row_tokens: n, tokens per row.
        groups: g, segment slots per row (≥ samples in any row + 1 when a row has padding).
        patch: the model's (pt, ph, pw).
        max_segment_tokens: static bound recorded for the attention kernel (≥ every sample's tokens).

    Raises:
        ValueError: when a row's samples exceed ``row_tokens`` or ``groups``, or a sample exceeds
            ``max_segment_tokens`` (naming the row).
    """
    first = rows[0][0]
    channels, cond = first.latents.shape[1], first.condition
    q = int(np.prod(patch))
    b, n, g = len(rows), row_tokens, groups
    out = {
        "sample_ids": np.full((b, g), -1, np.int64),
        "latents": np.zeros((b, n, q, channels), np.float32),
        "noise": np.zeros((b, n, q, channels), np.float32),
        "positions": np.zeros((b, n, 3), np.int32),
        "segment_ids": np.zeros((b, n), np.int32),
        "text": np.zeros((b, g, *first.text.shape[1:]), np.float32),
        "timesteps": np.zeros((b, g), np.float32),
        "weights": np.zeros((b, g), np.float32),
    }
    condition = None if cond is None else np.zeros((b, n, q, cond.shape[1]), np.float32)
    clean = None if first.clean_first_frame is None else np.zeros((b, n), np.float32)
    for r, samples in enumerate(rows):
        start = 0
        for s, sample in enumerate(samples):
            if sample.rows != 1:
                raise ValueError(f"packed row {r}: segment {s} holds {sample.rows} samples; pack one sample each")
            grid = tuple(d // p for d, p in zip(sample.latents.shape[2:], patch, strict=True))
            tokens = int(np.prod(grid))
            if tokens > max_segment_tokens or start + tokens > n:
                raise ValueError(
                    f"packed row {r}: sample {s} ({tokens} tokens) does not fit after {start} tokens (row {n} "
                    f"tokens, longest segment {max_segment_tokens})"
                )
            span = slice(start, start + tokens)
            out["latents"][r, span] = patchify(sample.latents[0], patch)
            out["noise"][r, span] = patchify(sample.noise[0], patch)
            if condition is not None:
                condition[r, span] = patchify(sample.condition[0], patch)
            if clean is not None:
                clean[r, span] = float(sample.clean_first_frame[0]) * (np.arange(tokens) < grid[1] * grid[2])
            out["positions"][r, span] = grid_positions(grid)
            out["segment_ids"][r, span] = s
            out["sample_ids"][r, s] = sample.sample_ids[0]
            out["text"][r, s] = sample.text[0]
            out["timesteps"][r, s] = sample.timesteps[0]
            out["weights"][r, s] = sample.weights[0]
            start += tokens
        if len(samples) + (start < n) > g:
            raise ValueError(f"packed row {r}: {len(samples)} samples and padding need more than {g} segment slots")
        out["segment_ids"][r, start:] = len(samples)  # padding: one segment of its own, after the samples
    return PackedRows(condition=condition, clean_first_frame=clean, max_segment_tokens=max_segment_tokens, **out)
