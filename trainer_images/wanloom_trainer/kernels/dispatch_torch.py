"""The PyTorch entry point model code calls for AdaLN: ``impl`` picks the Triton kernel or the eager chain."""

from __future__ import annotations

import torch

from wanloom_trainer.kernels import ADALN_IMPLS


def adaln_torch(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    *,
    eps: float = 1e-6,
    impl: str,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``LayerNorm(x) · (1 + scale) + shift`` (no affine, fp32 statistics), autograd-aware.

    Args:
        x: ``[B, N, D]`` (float32, bfloat16 or float16).
        scale, shift: per sample ``[B, D]`` / ``[B, 1, D]``, per token ``[B, N, D]``, or with ``segment_ids`` per
            segment ``[B, S, D]``; float32 or x's dtype.
        eps: LayerNorm epsilon.
        segment_ids: packed rows, ``[B, N]`` ids of each token's segment (docs/architecture.md, "Packed sequences").
        impl: ``"fused"`` (Triton, ``adaln_triton``) or ``"reference"`` (eager, ``adaln_reference_torch``).
            ``"fused"`` on CPU tensors runs the Triton interpreter, which needs ``TRITON_INTERPRET=1`` set before
            ``wanloom_trainer.kernels.adaln_triton`` is first imported; otherwise it raises RuntimeError.

    Returns:
        ``y``: ``[B, N, D]`` in x's dtype.
    """
    if impl == "fused":
        from wanloom_trainer.kernels.adaln_triton import adaln_triton

        return adaln_triton(x, scale, shift, eps, segment_ids)
    if impl == "reference":
        from wanloom_trainer.kernels.adaln_ref_torch import adaln_reference_torch

        return adaln_reference_torch(x, scale, shift, eps, segment_ids)
    raise ValueError(f"kernels.adaln: unknown impl {impl!r}; valid: {', '.join(ADALN_IMPLS)}")
