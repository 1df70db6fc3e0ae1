"""Fused AdaLN in Triton: ``y = LayerNorm(x) · (1 + scale) + shift`` with its backward, for PyTorch on GPU.

Math (statistics in fp32, ``x̂ = (x − μ)·r``, ``g = dy·(1 + scale)``):
  ``dx = r·(g − mean_d g − x̂·mean_d(g·x̂))``, ``d_scale[b] = Σ_{n∈b} dy·x̂``, ``d_shift[b] = Σ_{n∈b} dy``
(per-token modulation: ``d_scale = dy·x̂`` and ``d_shift = dy`` elementwise). See docs/reference kernels.md.

Layout, Liger-Kernel style: private ``@triton.jit`` kernels, then the public launchers ``adaln_forward`` /
``adaln_backward`` that check shapes, then ``AdaLNFunction`` and ``adaln_triton``.

- Forward: one program per row; x, scale and shift read once, y written once, plus fp32 mean and rstd per row.
- Backward: one pass over x and dy. A persistent grid of P programs, each owning a contiguous block of rows,
  keeps the per-sample column sums of ``dy·x̂`` and ``dy`` in fp32 registers and writes one partial per
  (program, sample) it touches. Program p's partial for sample b goes to slot ``p + b``: rows are sorted by sample,
  so these slots never collide and the buffer has only ``P + B − 1`` rows. A second tiny kernel sums, for each
  sample, the partials of the programs that cover it, in program order: no atomics, bit-for-bit deterministic.

Saved for backward: x, mean, rstd and scale (shift is not needed). On CPU tensors the kernels run only in the
Triton interpreter, which must be switched on (``TRITON_INTERPRET=1``) before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from wanloom_trainer.kernels.adaln_shapes import AdaLNLayout, adaln_layout, check_dtypes, check_eps


@triton.jit
def _adaln_fwd_kernel(
    X,  # [R, D] rows of x, R = B·N, contiguous
    SCALE,  # per sample [B, D] (stride_n = 0) or per token [B, N, D]; last dim contiguous
    SHIFT,  # same shape as SCALE
    Y,  # [R, D] output in x's dtype
    MEAN,  # [R] fp32
    RSTD,  # [R] fp32
    scale_stride_b,
    scale_stride_n,
    shift_stride_b,
    shift_stride_n,
    n_tokens,  # N: rows per sample
    D,
    eps,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b, n = row // n_tokens, row % n_tokens
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + eps)
    scale = tl.load(SCALE + b * scale_stride_b + n * scale_stride_n + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(SHIFT + b * shift_stride_b + n * shift_stride_n + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * (1.0 + scale) + shift
    tl.store(Y + row * D + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _adaln_row_grad(X, DY, DX, MEAN, RSTD, row, one_plus_scale, cols, mask, D):
    """dx of one row (stored), and the row's ``dy·x̂`` and ``dy`` in fp32 for the column sums."""
    x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    x_hat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
    g = dy * one_plus_scale
    c1 = tl.sum(g, axis=0) / D
    c2 = tl.sum(g * x_hat, axis=0) / D
    dx = rstd * (g - c1 - x_hat * c2)
    tl.store(DX + row * D + cols, dx.to(DX.dtype.element_ty), mask=mask)
    return dy * x_hat, dy


@triton.jit
def _adaln_bwd_kernel(
    X,  # [R, D] rows of x
    DY,  # [R, D] upstream gradient
    SCALE,  # per sample [B, D] (stride_n = 0) or per token [B, N, D]; last dim contiguous
    MEAN,  # [R] fp32
    RSTD,  # [R] fp32
    DX,  # [R, D] output in x's dtype
    DSCALE,  # per token: [R, D] in scale's dtype; per sample: [P + B - 1, D] fp32 partials
    DSHIFT,  # per token: [R, D] in shift's dtype; per sample: [P + B - 1, D] fp32 partials
    scale_stride_b,
    scale_stride_n,
    n_rows,  # R
    n_tokens,  # N
    D,
    rows_per_program,
    PER_TOKEN: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    if PER_TOKEN:
        for row in range(row_start, row_end):
            mod = SCALE + (row // n_tokens) * scale_stride_b + (row % n_tokens) * scale_stride_n
            scale = tl.load(mod + cols, mask=mask, other=0.0).to(tl.float32)
            d_scale, d_shift = _adaln_row_grad(X, DY, DX, MEAN, RSTD, row, 1.0 + scale, cols, mask, D)
            tl.store(DSCALE + row * D + cols, d_scale.to(DSCALE.dtype.element_ty), mask=mask)
            tl.store(DSHIFT + row * D + cols, d_shift.to(DSHIFT.dtype.element_ty), mask=mask)
    else:
        # Walk the samples this program's rows belong to; one fp32 partial per (program, sample) in slot pid + b.
        for b in range(row_start // n_tokens, (row_end - 1) // n_tokens + 1):
            one_plus_scale = 1.0 + tl.load(SCALE + b * scale_stride_b + cols, mask=mask, other=0.0).to(tl.float32)
            acc_scale = tl.zeros([BLOCK_D], dtype=tl.float32)
            acc_shift = tl.zeros([BLOCK_D], dtype=tl.float32)
            seg_end = tl.minimum(row_end, (b + 1) * n_tokens)
            for row in range(tl.maximum(row_start, b * n_tokens), seg_end):
                d_scale, d_shift = _adaln_row_grad(X, DY, DX, MEAN, RSTD, row, one_plus_scale, cols, mask, D)
                acc_scale += d_scale
                acc_shift += d_shift
            tl.store(DSCALE + (pid + b) * D + cols, acc_scale, mask=mask)
            tl.store(DSHIFT + (pid + b) * D + cols, acc_shift, mask=mask)


@triton.jit
def _adaln_segment_sum_kernel(
    PARTIAL_SCALE,  # [P + B - 1, D] fp32, slot p + b holds program p's partial for sample b
    PARTIAL_SHIFT,  # [P + B - 1, D] fp32
    DSCALE,  # [B, D] output in scale's dtype
    DSHIFT,  # [B, D] output in shift's dtype
    n_tokens,  # N
    D,
    rows_per_program,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc_scale = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_shift = tl.zeros([BLOCK_D], dtype=tl.float32)
    # Programs covering sample b, summed in program order (fixed order: deterministic).
    first_program = (b.to(tl.int64) * n_tokens) // rows_per_program
    last_program = ((b.to(tl.int64) + 1) * n_tokens - 1) // rows_per_program
    for p in range(first_program, last_program + 1):
        acc_scale += tl.load(PARTIAL_SCALE + (p + b) * D + cols, mask=mask, other=0.0)
        acc_shift += tl.load(PARTIAL_SHIFT + (p + b) * D + cols, mask=mask, other=0.0)
    tl.store(DSCALE + b * D + cols, acc_scale.to(DSCALE.dtype.element_ty), mask=mask)
    tl.store(DSHIFT + b * D + cols, acc_shift.to(DSHIFT.dtype.element_ty), mask=mask)


def interpreter_active() -> bool:
    """True when this module's kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_adaln_fwd_kernel, InterpretedFunction)


def _check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(
            f"adaln_triton: x, scale, shift (and dy) must be on one device, got {sorted(map(str, devices))}"
        )
    device = devices.pop()
    if device.type == "cpu" and not interpreter_active():
        raise RuntimeError(
            "adaln_triton: CPU tensors need the Triton interpreter; set TRITON_INTERPRET=1 before "
            "importing wanloom_trainer.kernels.adaln_triton, or use impl='reference'"
        )


def _modulation_rows(t: torch.Tensor, layout: AdaLNLayout) -> tuple[torch.Tensor, int, int]:
    """``(tensor, stride_b, stride_n)`` for the kernels; keeps strided views (TI2V's chunks of ``[B, N, 6, D]``)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0), (t.stride(1) if layout.per_token else 0)


def _launch_settings(dim: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps): the whole row in one tile, more warps for wider rows (Liger's rule)."""
    block_d = triton.next_power_of_2(dim)
    num_warps = 32 if block_d >= 32768 else 16 if block_d >= 8192 else 8 if block_d >= 2048 else 4
    return block_d, num_warps


def adaln_forward(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused AdaLN forward.

    Args:
        x: ``[B, N, D]`` (float32, bfloat16 or float16).
        scale, shift: per sample ``[B, D]`` / ``[B, 1, D]`` or per token ``[B, N, D]``; float32 or x's dtype.
        eps: LayerNorm epsilon.

    Returns:
        ``(y [B, N, D] in x's dtype, mean [B, N] fp32, rstd [B, N] fp32)``.

    Raises:
        ValueError: on shapes, dtypes or devices outside the contract (message names them).
    """
    layout = adaln_layout(tuple(x.shape), tuple(scale.shape), tuple(shift.shape))
    check_dtypes(x.dtype, scale.dtype, shift.dtype)
    check_eps(eps)
    _check_device(x, scale, shift)
    x_rows = x.contiguous()
    (scale, *scale_strides), (shift, *shift_strides) = _modulation_rows(scale, layout), _modulation_rows(shift, layout)
    y = torch.empty_like(x_rows)
    rows = layout.batch * layout.tokens
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    block_d, num_warps = _launch_settings(layout.dim)
    _adaln_fwd_kernel[(rows,)](
        x_rows,
        scale,
        shift,
        y,
        mean,
        rstd,
        *scale_strides,
        *shift_strides,
        layout.tokens,
        layout.dim,
        eps,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return y, mean.view(layout.batch, layout.tokens), rstd.view(layout.batch, layout.tokens)


def default_num_programs(device: torch.device) -> int:
    """Persistent backward grid: a few programs per SM on GPU; a handful in the CPU interpreter."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def adaln_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    shift_dtype: torch.dtype | None = None,
    num_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused AdaLN backward: one pass over x and dy.

    Args:
        dy: ``[B, N, D]`` gradient of y.
        x, scale: as given to ``adaln_forward``; mean, rstd: its ``[B, N]`` fp32 statistics.
        shift_dtype: dtype of the shift gradient (default: scale's dtype).
        num_programs: persistent grid size P for the backward (default ``default_num_programs``); the result does
            not depend on it beyond fp32 summation order.

    Returns:
        ``(dx like x, d_scale like scale, d_shift with scale's shape in shift_dtype)``.
    """
    shift_dtype = shift_dtype or scale.dtype
    layout = adaln_layout(tuple(x.shape), tuple(scale.shape), tuple(scale.shape))
    check_dtypes(x.dtype, scale.dtype, shift_dtype)
    if dy.shape != x.shape or mean.shape != (layout.batch, layout.tokens) or rstd.shape != mean.shape:
        raise ValueError(
            f"adaln_backward: dy {list(dy.shape)} must match x {list(x.shape)}, mean/rstd "
            f"{list(mean.shape)}/{list(rstd.shape)} must be [{layout.batch}, {layout.tokens}]"
        )
    _check_device(dy, x, scale, mean, rstd)
    rows = layout.batch * layout.tokens
    programs = min(rows, num_programs or default_num_programs(x.device))
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)  # every program owns at least one row
    x, dy, (scale_rows, *scale_strides) = x.contiguous(), dy.contiguous(), _modulation_rows(scale, layout)
    dx = torch.empty_like(x)
    if layout.per_token:
        d_scale = torch.empty(scale.shape, dtype=scale.dtype, device=x.device)
        d_shift = torch.empty(scale.shape, dtype=shift_dtype, device=x.device)
    else:
        d_scale = torch.empty(programs + layout.batch - 1, layout.dim, dtype=torch.float32, device=x.device)
        d_shift = torch.empty_like(d_scale)
    block_d, num_warps = _launch_settings(layout.dim)
    _adaln_bwd_kernel[(programs,)](
        x,
        dy,
        scale_rows,
        mean.contiguous(),
        rstd.contiguous(),
        dx,
        d_scale,
        d_shift,
        *scale_strides,
        rows,
        layout.tokens,
        layout.dim,
        rows_per_program,
        PER_TOKEN=layout.per_token,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    if layout.per_token:
        return dx, d_scale, d_shift
    return dx, *_segment_sum(d_scale, d_shift, scale, shift_dtype, layout, rows_per_program)


def _segment_sum(
    partial_scale: torch.Tensor,
    partial_shift: torch.Tensor,
    scale: torch.Tensor,
    shift_dtype: torch.dtype,
    layout: AdaLNLayout,
    rows_per_program: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Finish the per-sample column sums: ``[P + B − 1, D]`` partials -> ``[B, D]`` in the modulation dtypes."""
    d_scale = torch.empty(scale.shape, dtype=scale.dtype, device=scale.device)
    d_shift = torch.empty(scale.shape, dtype=shift_dtype, device=scale.device)
    block_d = min(1024, triton.next_power_of_2(layout.dim))
    grid = (layout.batch, triton.cdiv(layout.dim, block_d))
    _adaln_segment_sum_kernel[grid](
        partial_scale, partial_shift, d_scale, d_shift, layout.tokens, layout.dim, rows_per_program, BLOCK_D=block_d
    )
    return d_scale, d_shift


class AdaLNFunction(torch.autograd.Function):
    """Autograd wrapper: saves x, mean, rstd and scale (not y, not x̂, not shift)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        y, mean, rstd = adaln_forward(x, scale, shift, eps)
        ctx.save_for_backward(x, mean, rstd, scale)
        ctx.shift_dtype = shift.dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        x, mean, rstd, scale = ctx.saved_tensors
        dx, d_scale, d_shift = adaln_backward(dy, x, scale, mean, rstd, shift_dtype=ctx.shift_dtype)
        return dx, d_scale, d_shift, None


def adaln_triton(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Fused ``LayerNorm(x) · (1 + scale) + shift`` (autograd-aware); shapes and dtypes as in ``adaln_forward``."""
    return AdaLNFunction.apply(x, scale, shift, eps)
