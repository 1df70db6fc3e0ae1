"""Plain PyTorch AdaLN: the reference the Triton kernel is tested against, and the eager chain it replaces.

``y = LayerNorm(x) · (1 + scale) + shift`` with a LayerNorm without affine and statistics in fp32, written the way
diffusers' ``WanTransformerBlock`` writes it (``FP32LayerNorm`` on ``x.float()``, modulate in fp32, cast back), so
its autograd graph is also the "eager" baseline for the memory and speed comparisons.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wanloom_trainer.kernels.adaln_shapes import adaln_layout, check_dtypes, check_eps, check_segment_dtype


def adaln_reference_torch(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager AdaLN.

    Args:
        x: ``[B, N, D]`` activations (float32, bfloat16 or float16).
        scale, shift: per sample ``[B, D]`` / ``[B, 1, D]``, per token ``[B, N, D]``, or with ``segment_ids`` per
            segment ``[B, S, D]``; float32 or x's dtype.
        eps: LayerNorm epsilon.
        segment_ids: packed rows: ``[B, N]`` ids into the S segments (docs/architecture.md, "Packed sequences").

    Returns:
        ``y``: ``[B, N, D]`` in x's dtype.
    """
    segment_shape = None if segment_ids is None else tuple(segment_ids.shape)
    layout = adaln_layout(tuple(x.shape), tuple(scale.shape), tuple(shift.shape), segment_shape)
    check_dtypes(x.dtype, scale.dtype, shift.dtype)
    check_eps(eps)
    if segment_ids is not None:  # gather each token's segment row: autograd sums the rows back per segment
        check_segment_dtype(segment_ids.dtype)
        index = segment_ids.long()[..., None].expand(-1, -1, layout.dim)
        scale, shift = scale.gather(1, index), shift.gather(1, index)
    elif scale.dim() == 2:  # [B, D] -> [B, 1, D], broadcast over the sequence
        scale, shift = scale.unsqueeze(1), shift.unsqueeze(1)
    x_hat = F.layer_norm(x.float(), (layout.dim,), eps=eps)
    return (x_hat * (1 + scale.float()) + shift.float()).to(x.dtype)
