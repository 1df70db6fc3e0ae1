"""Plain JAX AdaLN: the reference the Pallas kernel is tested against, and the XLA chain it replaces.

``y = LayerNorm(x) · (1 + scale) + shift`` with a LayerNorm without affine and statistics in fp32 (two-pass
variance, like ``flax.nnx.LayerNorm``), modulation in fp32, result cast back to x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from wanloom_trainer.kernels.adaln_shapes import adaln_layout, check_dtypes, check_eps, check_segment_dtype


def adaln_reference_jax(
    x: jax.Array, scale: jax.Array, shift: jax.Array, eps: float = 1e-6, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Plain jnp AdaLN.

    Args:
        x: ``[B, N, D]`` activations (float32, bfloat16 or float16).
        scale, shift: per sample ``[B, D]`` / ``[B, 1, D]``, per token ``[B, N, D]``, or with ``segment_ids`` per
            segment ``[B, S, D]``; float32 or x's dtype.
        eps: LayerNorm epsilon.
        segment_ids: packed rows: int ``[B, N]`` ids of each token's segment (docs/architecture.md).

    Returns:
        ``y``: ``[B, N, D]`` in x's dtype.
    """
    adaln_layout(x.shape, scale.shape, shift.shape, None if segment_ids is None else segment_ids.shape)
    check_dtypes(x.dtype, scale.dtype, shift.dtype)
    check_eps(eps)
    if segment_ids is not None:  # each token takes its segment's row; autograd sums the rows back per segment
        check_segment_dtype(segment_ids.dtype)
        index = segment_ids[..., None].astype(jnp.int32)
        scale, shift = (jnp.take_along_axis(m, index, axis=1) for m in (scale, shift))
    elif scale.ndim == 2:  # [B, D] -> [B, 1, D], broadcast over the sequence
        scale, shift = scale[:, None, :], shift[:, None, :]
    xf = x.astype(jnp.float32)
    xc = xf - jnp.mean(xf, axis=-1, keepdims=True)
    x_hat = xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
    return (x_hat * (1 + scale.astype(jnp.float32)) + shift.astype(jnp.float32)).astype(x.dtype)
