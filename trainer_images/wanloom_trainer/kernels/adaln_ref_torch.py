"""Plain PyTorch AdaLN: the reference the Triton kernel is tested against, and the eager chain it replaces.

``y = LayerNorm(x) · (1 + scale) + shift`` with a LayerNorm without affine and statistics in fp32, written the way
diffusers' ``WanTransformerBlock`` writes it (``FP32LayerNorm`` on ``x.float()``, modulate in fp32, cast back), so
its autograd graph is also the "eager" baseline for the memory and speed comparisons.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wanloom_trainer.kernels.adaln_shapes import adaln_layout, check_dtypes, check_eps


def adaln_reference_torch(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Eager AdaLN.

    Args:
        x: ``[B, N, D]`` activations (float32, bfloat16 or float16).
        scale, shift: per sample ``[B, D]`` / ``[B, 1, D]`` or per token ``[B, N, D]``; float32 or x's dtype.
        eps: LayerNorm epsilon.

    Returns:
        ``y``: ``[B, N, D]`` in x's dtype.
    """
    layout = adaln_layout(tuple(x.shape), tuple(scale.shape), tuple(shift.shape))
    check_dtypes(x.dtype, scale.dtype, shift.dtype)
    check_eps(eps)
    if scale.dim() == 2:  # [B, D] -> [B, 1, D], broadcast over the sequence
        scale, shift = scale.unsqueeze(1), shift.unsqueeze(1)
    x_hat = F.layer_norm(x.float(), (layout.dim,), eps=eps)
    return (x_hat * (1 + scale.float()) + shift.float()).to(x.dtype)
