"""3D rotary position embedding of the Wan transformer.

The head dimension is split into a frame part and two equal spatial parts (for head_dim 128: t = 44, h = w = 42),
each an ordinary 1D RoPE over its own axis (Su et al., 2021, "RoFormer"). Rotations act on interleaved pairs
(channels 2i, 2i+1), as in the official Wan code and diffusers' ``WanRotaryPosEmbed``.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

ROPE_THETA = 10000.0


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels given to the (frame, height, width) axes; each is even."""
    if head_dim % 2:
        raise ValueError(f"attention head_dim must be even for RoPE, got {head_dim}")
    h_dim = w_dim = 2 * (head_dim // 6)
    return head_dim - h_dim - w_dim, h_dim, w_dim


@functools.lru_cache(maxsize=64)
def _axis_angles(dim: int, length: int) -> np.ndarray:
    """Angles [length, dim // 2] of one axis, in float64 so long positions keep full precision."""
    inv_freq = 1.0 / (ROPE_THETA ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    return np.outer(np.arange(length, dtype=np.float64), inv_freq)


def rope_cos_sin(grid_thw: tuple[int, int, int], head_dim: int, max_seq_len: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-token rotation tables for a (T', H', W') token grid, flattened in (t, h, w) order.

    Args:
        grid_thw: post-patch grid (frames, height, width).
        head_dim: attention head dimension.
        max_seq_len: largest position the checkpoint was trained for, per axis.

    Returns:
        (cos, sin), each float32 [T'·H'·W', head_dim // 2]: one angle per rotated channel pair.
    """
    if max(grid_thw) > max_seq_len:
        raise ValueError(f"token grid {grid_thw} exceeds rope_max_seq_len={max_seq_len} on some axis")
    tables = []
    for axis, (dim, length) in enumerate(zip(rope_axis_dims(head_dim), grid_thw, strict=True)):
        # Small per-axis cos/sin constants; the full [S, head_dim/2] table is built by broadcasting inside the
        # graph, so a 75k-token grid does not become a 40 MB HLO constant.
        angles = _axis_angles(dim, length)
        shape = [1, 1, 1, dim // 2]
        shape[axis] = length
        tables.append(
            (np.cos(angles).astype(np.float32).reshape(shape), np.sin(angles).astype(np.float32).reshape(shape))
        )
    full = (*grid_thw,)
    cos = jnp.concatenate([jnp.broadcast_to(c, (*full, c.shape[-1])) for c, _ in tables], axis=-1)
    sin = jnp.concatenate([jnp.broadcast_to(s, (*full, s.shape[-1])) for _, s in tables], axis=-1)
    tokens = int(np.prod(grid_thw))
    return cos.reshape(tokens, head_dim // 2), sin.reshape(tokens, head_dim // 2)


def rope_cos_sin_at(positions_bs3: jnp.ndarray, head_dim: int, max_seq_len: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Rotation tables for tokens at explicit (t, h, w) grid positions: packed rows, where every segment's grid
    starts at 0 (docs/architecture.md, "Packed sequences"). Token (t, h, w) gets the same angles as in
    ``rope_cos_sin`` of its own grid.

    Args:
        positions_bs3: int [B, S, 3] positions inside each token's own segment, each < ``max_seq_len``.

    Returns:
        (cos, sin), each float32 [B, S, head_dim // 2].
    """
    cos, sin = [], []
    for axis, dim in enumerate(rope_axis_dims(head_dim)):
        angles = _axis_angles(dim, max_seq_len)
        table_cos, table_sin = (jnp.asarray(f(angles).astype(np.float32)) for f in (np.cos, np.sin))
        index = positions_bs3[..., axis]
        cos.append(table_cos[index])
        sin.append(table_sin[index])
    return jnp.concatenate(cos, axis=-1), jnp.concatenate(sin, axis=-1)


def apply_rope(x_bsnh: jnp.ndarray, cos_sh: jnp.ndarray, sin_sh: jnp.ndarray) -> jnp.ndarray:
    """Rotate interleaved channel pairs of queries or keys.

    Args:
        x_bsnh: [B, S, N, head_dim] queries or keys.
        cos_sh, sin_sh: [S, head_dim // 2] tables from ``rope_cos_sin``, or per row [B, S, head_dim // 2]
            (``rope_cos_sin_at``).

    Returns:
        [B, S, N, head_dim] in the dtype of ``x_bsnh``; the rotation itself runs in float32.
    """
    pairs = x_bsnh.astype(jnp.float32).reshape(*x_bsnh.shape[:-1], -1, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    cos = cos_sh[..., None, :] if cos_sh.ndim == 3 else cos_sh[None, :, None, :]
    sin = sin_sh[..., None, :] if sin_sh.ndim == 3 else sin_sh[None, :, None, :]
    rotated = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return rotated.reshape(x_bsnh.shape).astype(x_bsnh.dtype)
