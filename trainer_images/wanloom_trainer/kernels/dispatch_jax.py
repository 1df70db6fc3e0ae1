"""The JAX entry point model code calls for AdaLN: ``impl`` picks the Pallas kernel or the plain jnp chain."""

from __future__ import annotations

import jax

from wanloom_trainer.kernels import ADALN_IMPLS


def adaln_jax(
    x: jax.Array,
    scale: jax.Array,
    shift: jax.Array,
    *,
    eps: float = 1e-6,
    impl: str,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """``LayerNorm(x) · (1 + scale) + shift`` (no affine, fp32 statistics), differentiable.

    Args:
        x: ``[B, N, D]`` (float32, bfloat16 or float16).
        scale, shift: per sample ``[B, D]`` / ``[B, 1, D]``, per token ``[B, N, D]``, or with ``segment_ids`` per
            segment ``[B, S, D]``; float32 or x's dtype.
        eps: LayerNorm epsilon.
        segment_ids: packed rows: int ``[B, N]`` ids of each token's segment (docs/architecture.md).
        impl: ``"fused"`` (Pallas with a custom VJP, ``adaln_pallas``; compiled by Mosaic on TPU, the Pallas
            interpreter on other backends) or ``"reference"`` (plain jnp, ``adaln_reference_jax``).

    Returns:
        ``y``: ``[B, N, D]`` in x's dtype.
    """
    if impl == "fused":
        from wanloom_trainer.kernels.adaln_pallas import adaln_pallas

        return adaln_pallas(x, scale, shift, eps, segment_ids=segment_ids)
    if impl == "reference":
        from wanloom_trainer.kernels.adaln_ref_jax import adaln_reference_jax

        return adaln_reference_jax(x, scale, shift, eps, segment_ids)
    raise ValueError(f"kernels.adaln: unknown impl {impl!r}; valid: {', '.join(ADALN_IMPLS)}")
