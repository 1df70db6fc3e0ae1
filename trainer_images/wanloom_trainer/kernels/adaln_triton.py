"""Fused AdaLN in Triton: ``y = LayerNorm(x) · (1 + scale) + shift`` with its backward, for PyTorch on GPU.

Math (statistics in fp32, ``x̂ = (x − μ)·r``, ``g = dy·(1 + scale)``):
  ``dx = r·(g − mean_d g − x̂·mean_d(g·x̂))``, ``d_scale[s] = Σ_{n∈s} dy·x̂``, ``d_shift[s] = Σ_{n∈s} dy``
for each segment s (a sample, or a segment of a packed row); per-token modulation: ``d_scale = dy·x̂`` and
``d_shift = dy`` elementwise. Contract and packing: ``adaln_shapes.py`` and docs/architecture.md.

Layout, Liger-Kernel style: private ``@triton.jit`` kernels, the launch table, the public launchers
``adaln_forward`` / ``adaln_backward`` that check shapes, the same as PyTorch operators (``wanloom::adaln_forward``,
``wanloom::adaln_backward``, with shape-only fake implementations), then ``AdaLNFunction`` and ``adaln_triton``.

Rows are the flattened ``R = B·N`` tokens. Each row belongs to a *global segment* ``g = b·S + s`` (per sample:
``g = b``), and g is non-decreasing over the rows; the modulation row of row r is ``scale[g // S, g % S]`` (per
token: ``scale[b, n]``). Every kernel works on ``(BLOCK_R, BLOCK_D)`` tiles, so no program holds a whole row in
registers (a full row of 5120 spilled at 16 warps):

- Forward: a program owns BLOCK_R rows and sweeps D twice: once for the statistics (tile means and M2 combined with
  Chan's update: stable, one read), once to normalise, modulate and write y (the re-read hits L1/L2). A block whose
  rows share one segment loads each modulation tile once and broadcasts it over the rows.
- Backward, the paper's (d_tile, row range) layout: a small row kernel computes ``mean_d g`` and ``mean_d(g·x̂)``
  per row; then program (j, p) owns D-tile j of row range p, writes dx for its tile and keeps the column sums of
  ``dy·x̂`` and ``dy`` for the current segment in fp32 registers, coalesced along D. On a segment change it writes the
  partial to slot ``p + g`` of a ``[P + G − 1, D]`` buffer: ranges are contiguous and g non-decreasing, so slots of
  different programs never collide. A last kernel sums, per segment, the partials of the ranges that cover it, in
  range order: no atomics, bit-for-bit deterministic.

HBM bytes per element (bf16 x): forward 4 (read x, write y); backward 10 (x and dy read by both backward kernels,
dx written), plus 4/D per row for the statistics. Saved for backward: x, mean, rstd and scale. On CPU tensors the
kernels run only in the Triton interpreter, which must be switched on (``TRITON_INTERPRET=1``) before this module is
imported; ``kernels/triton_aot.py`` compiles them for sm_90/sm_100 without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from wanloom_trainer.kernels.adaln_shapes import (
    AdaLNLayout,
    adaln_layout,
    check_dtypes,
    check_eps,
    check_segment_dtype,
)

# ---------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _segment_of(rows, SEG, n_tokens, SEGMENTED: tl.constexpr):
    """Global segment of each row (int64): ``SEG[r]`` for packed rows, ``r // N`` (the sample) otherwise."""
    if SEGMENTED:
        return tl.load(SEG + rows).to(tl.int64)
    return rows // n_tokens


@triton.jit
def _mod_offsets(rows, seg, n_tokens, n_segments, stride_b, stride_j, PER_TOKEN: tl.constexpr):
    """Element offset of each row's modulation row: ``[b, n]`` per token, ``[g // S, g % S]`` per segment."""
    if PER_TOKEN:
        return (rows // n_tokens) * stride_b + (rows % n_tokens) * stride_j
    return (seg // n_segments) * stride_b + (seg % n_segments) * stride_j


@triton.jit
def _load_mod(MOD, offs, cols, cmask, mask, uniform):
    """A ``(BLOCK_R, BLOCK_D)`` modulation tile in fp32; rows of one segment load the tile once and broadcast it."""
    if uniform:
        row = tl.load(MOD + tl.min(offs, axis=0) + cols, mask=cmask, other=0.0).to(tl.float32)
        tile = tl.where(mask, row[None, :], 0.0)
    else:
        tile = tl.load(MOD + offs[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return tile


@triton.jit
def _block_segments(rows, rmask, SEG, n_tokens, SEGMENTED: tl.constexpr, PER_TOKEN: tl.constexpr):
    """(segment of each row, whether all valid rows share one segment, the first one); invalid rows read as the
    block's first row, which is always valid. Per-token modulation is never uniform."""
    seg = _segment_of(tl.where(rmask, rows, tl.min(rows, axis=0)), SEG, n_tokens, SEGMENTED)
    first = tl.min(seg, axis=0)
    if PER_TOKEN:
        return seg, False, first
    return seg, first == tl.max(seg, axis=0), first


@triton.jit
def _adaln_fwd_kernel(
    X,  # [R, D] rows of x, contiguous
    SCALE,  # modulation rows: [B, S, D] per segment or [B, N, D] per token; last dim contiguous
    SHIFT,  # same shape as SCALE
    SEG,  # [R] global segment ids (int32) when SEGMENTED
    Y,  # [R, D] output in x's dtype
    MEAN,  # [R] fp32
    RSTD,  # [R] fp32
    scale_stride_b,
    scale_stride_j,
    shift_stride_b,
    shift_stride_j,
    n_rows,  # R
    n_tokens,  # N
    n_segments,  # S
    D,
    eps,
    PER_TOKEN: tl.constexpr,
    SEGMENTED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    mean = tl.zeros([BLOCK_R], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (cols < D)[None, :]
        x = tl.load(X + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        seen = d0 * 1.0  # every earlier tile is full
        width = tl.minimum(D - d0, BLOCK_D) * 1.0
        tile_mean = tl.sum(x, axis=1) / width
        xc = tl.where(mask, x - tile_mean[:, None], 0.0)
        delta = tile_mean - mean
        mean += delta * (width / (seen + width))
        m2 += tl.sum(xc * xc, axis=1) + delta * delta * (seen * width / (seen + width))
    rstd = 1.0 / tl.sqrt(m2 / D + eps)
    seg, uniform, _ = _block_segments(rows, rmask, SEG, n_tokens, SEGMENTED, PER_TOKEN)
    scale_offs = _mod_offsets(rows, seg, n_tokens, n_segments, scale_stride_b, scale_stride_j, PER_TOKEN)
    shift_offs = _mod_offsets(rows, seg, n_tokens, n_segments, shift_stride_b, shift_stride_j, PER_TOKEN)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = _load_mod(SCALE, scale_offs, cols, cmask, mask, uniform)
        shift = _load_mod(SHIFT, shift_offs, cols, cmask, mask, uniform)
        y = (x - mean[:, None]) * rstd[:, None] * (1.0 + scale) + shift
        tl.store(Y + rows[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _adaln_bwd_rowsum_kernel(
    X,  # [R, D]
    DY,  # [R, D]
    SCALE,  # as in the forward
    SEG,  # [R] when SEGMENTED
    MEAN,  # [R] fp32
    RSTD,  # [R] fp32
    C1,  # [R] fp32 output: mean_d g
    C2,  # [R] fp32 output: mean_d g·x̂
    stride_b,
    stride_j,
    n_rows,
    n_tokens,
    n_segments,
    D,
    PER_TOKEN: tl.constexpr,
    SEGMENTED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
    seg, uniform, _ = _block_segments(rows, rmask, SEG, n_tokens, SEGMENTED, PER_TOKEN)
    offs = _mod_offsets(rows, seg, n_tokens, n_segments, stride_b, stride_j, PER_TOKEN)
    sum_g = tl.zeros([BLOCK_R], dtype=tl.float32)
    sum_gx = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = dy * (1.0 + _load_mod(SCALE, offs, cols, cmask, mask, uniform))
        x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        sum_g += tl.sum(g, axis=1)
        sum_gx += tl.sum(g * x_hat, axis=1)
    tl.store(C1 + rows, sum_g / D, mask=rmask)
    tl.store(C2 + rows, sum_gx / D, mask=rmask)


@triton.jit
def _adaln_bwd_kernel(
    X,  # [R, D]
    DY,  # [R, D]
    SCALE,  # as in the forward
    SEG,  # [R] when SEGMENTED
    MEAN,  # [R] fp32
    RSTD,  # [R] fp32
    C1,  # [R] fp32 from the row kernel
    C2,  # [R] fp32
    DX,  # [R, D] output in x's dtype
    DSCALE,  # per token: [R, D] in scale's dtype; per segment: [P + G - 1, D] fp32 partials
    DSHIFT,  # per token: [R, D] in shift's dtype; per segment: [P + G - 1, D] fp32 partials
    stride_b,
    stride_j,
    n_rows,
    n_tokens,
    n_segments,
    D,
    rows_per_program,
    PER_TOKEN: tl.constexpr,
    SEGMENTED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    pid = tl.program_id(1)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    acc_scale = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_shift = tl.zeros([BLOCK_D], dtype=tl.float32)
    current = _segment_of(row_start, SEG, n_tokens, SEGMENTED)
    for r0 in range(row_start, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]
        tile = rows[:, None] * D + cols[None, :]
        x = tl.load(X + tile, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + tile, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=rmask, other=0.0)[:, None]
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)[:, None]
        c1 = tl.load(C1 + rows, mask=rmask, other=0.0)[:, None]
        c2 = tl.load(C2 + rows, mask=rmask, other=0.0)[:, None]
        seg, uniform, seg_lo = _block_segments(rows, rmask, SEG, n_tokens, SEGMENTED, PER_TOKEN)
        offs = _mod_offsets(rows, seg, n_tokens, n_segments, stride_b, stride_j, PER_TOKEN)
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy * (1.0 + _load_mod(SCALE, offs, cols, cmask, mask, uniform))
        tl.store(DX + tile, (rstd * (g - c1 - x_hat * c2)).to(DX.dtype.element_ty), mask=mask)
        if PER_TOKEN:
            tl.store(DSCALE + tile, (dy * x_hat).to(DSCALE.dtype.element_ty), mask=mask)
            tl.store(DSHIFT + tile, dy.to(DSHIFT.dtype.element_ty), mask=mask)
        else:
            d_scale = dy * x_hat  # both 0 on masked entries
            if uniform & (seg_lo == current):
                acc_scale += tl.sum(d_scale, axis=0)
                acc_shift += tl.sum(dy, axis=0)
            else:
                for s in range(seg_lo, tl.max(seg, axis=0) + 1):
                    if s != current:
                        tl.store(DSCALE + (pid + current) * D + cols, acc_scale, mask=cmask)
                        tl.store(DSHIFT + (pid + current) * D + cols, acc_shift, mask=cmask)
                        acc_scale = tl.zeros([BLOCK_D], dtype=tl.float32)
                        acc_shift = tl.zeros([BLOCK_D], dtype=tl.float32)
                        current = s
                    mine = (seg == s)[:, None]
                    acc_scale += tl.sum(tl.where(mine, d_scale, 0.0), axis=0)
                    acc_shift += tl.sum(tl.where(mine, dy, 0.0), axis=0)
    if not PER_TOKEN:
        tl.store(DSCALE + (pid + current) * D + cols, acc_scale, mask=cmask)
        tl.store(DSHIFT + (pid + current) * D + cols, acc_shift, mask=cmask)


@triton.jit
def _adaln_segment_sum_kernel(
    PARTIAL_SCALE,  # [P + G - 1, D] fp32: slot p + g holds row range p's partial for segment g
    PARTIAL_SHIFT,  # [P + G - 1, D] fp32
    SEG_OFFSETS,  # [G + 1] int64: segment g covers rows [SEG_OFFSETS[g], SEG_OFFSETS[g + 1])
    DSCALE,  # [G, D] output in scale's dtype
    DSHIFT,  # [G, D] output in shift's dtype
    D,
    rows_per_program,
    BLOCK_D: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    start = tl.load(SEG_OFFSETS + g)
    end = tl.load(SEG_OFFSETS + g + 1)
    first = start // rows_per_program
    count = tl.where(end > start, (end - 1) // rows_per_program - first + 1, 0)  # empty segments sum nothing
    acc_scale = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_shift = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, count):  # range order: deterministic
        slot = (first + i + g) * D + cols
        acc_scale += tl.load(PARTIAL_SCALE + slot, mask=mask, other=0.0)
        acc_shift += tl.load(PARTIAL_SHIFT + slot, mask=mask, other=0.0)
    tl.store(DSCALE + g * D + cols, acc_scale.to(DSCALE.dtype.element_ty), mask=mask)
    tl.store(DSHIFT + g * D + cols, acc_shift.to(DSHIFT.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------- launch table


@dataclass(frozen=True)
class TileConfig:
    """One kernel's launch: rows and columns per tile, warps and software-pipelining stages per program."""

    block_r: int
    block_d: int
    num_warps: int
    num_stages: int = 1  # the loops stream through registers; deeper pipelining changed nothing in the AOT report


# Elements per (BLOCK_R, BLOCK_D) tile with 8 warps: a tile costs about 8 registers per element a thread holds (x,
# dy, the modulation and their 64-bit gather addresses), so 2048 elements (8 per thread) keep the forward and the
# row kernel at <= 64 registers at D = 3072/5120 (<= 92 at D = 1536, whose 512-wide tiles take 4 rows), and the
# column kernel, which holds more tensors, takes 1024. The AOT report (`benchmarks/adaln_kernels.py --aot
# sm_90,sm_100`, docs/benchmarks.md) shows no spills and >= 50% occupancy at D = 3072/5120 on both targets;
# 4096-element tiles reached 154-255 registers and spilled in the column kernel. Column tiles divide D where they
# can (5120 = 5·1024, 3072 = 3·1024, 1536 = 3·512), so no lane is masked off; the column kernel's 512-wide tiles
# give 10 (d_tile, row range) programs per range at D = 5120.
TILE_ELEMENTS = {"forward": 2048, "backward_rows": 2048, "backward": 1024}
WIDEST_TILE = {"forward": 1024, "backward_rows": 1024, "backward": 512}


def column_tile(dim: int, widest: int) -> int:
    """The widest power of two <= ``widest`` that divides ``dim`` (at least 128), or the next power of two of a
    small ``dim``."""
    if dim <= widest:
        return triton.next_power_of_2(dim)
    tile = widest
    while tile > 128 and dim % tile:
        tile //= 2
    return tile


# The Triton interpreter costs ~0.4 ms per tile operation whatever the tile's size, so at D >= 1024 it runs tiles
# of the same width with 16x the rows (a 4096 x 5120 call takes a minute instead of nine); below that it keeps the
# compiled tiles, so the small-D tests walk several row chunks per program as the GPU does.
_INTERPRETER_ROW_FACTOR = 16


def launch_configs(dim: int, interpreted: bool = False) -> dict[str, TileConfig]:
    """Tiles per kernel (``forward``, ``backward_rows``, ``backward``, ``segment_sum``) for rows of width ``dim``;
    the same on sm_90 and sm_100 (the AOT report shows both without spills)."""
    factor = _INTERPRETER_ROW_FACTOR if interpreted and dim >= 1024 else 1
    configs = {}
    for name, elements in TILE_ELEMENTS.items():
        block_d = column_tile(dim, WIDEST_TILE[name])
        configs[name] = TileConfig(factor * max(1, elements // block_d), block_d, num_warps=8)
    configs["segment_sum"] = TileConfig(1, min(1024, triton.next_power_of_2(dim)), num_warps=4)  # tiny: B·S rows
    return configs


# ---------------------------------------------------------------------------------------------------- launchers


def interpreter_active() -> bool:
    """True when this module's kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_adaln_fwd_kernel, InterpretedFunction)


def _check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(
            f"adaln_triton: x, scale, shift (and dy, segment_ids) must be on one device, got "
            f"{sorted(map(str, devices))}"
        )
    device = devices.pop()
    if device.type == "cpu" and not interpreter_active():
        raise RuntimeError(
            "adaln_triton: CPU tensors need the Triton interpreter; set TRITON_INTERPRET=1 before "
            "importing wanloom_trainer.kernels.adaln_triton, or use impl='reference'"
        )


def _layout(x: torch.Tensor, scale: torch.Tensor, shift_shape, segment_ids: torch.Tensor | None) -> AdaLNLayout:
    if segment_ids is not None:
        check_segment_dtype(segment_ids.dtype)
    return adaln_layout(
        tuple(x.shape), tuple(scale.shape), tuple(shift_shape), None if segment_ids is None else segment_ids.shape
    )


def _modulation_rows(t: torch.Tensor, layout: AdaLNLayout) -> tuple[torch.Tensor, int, int]:
    """``(tensor, stride_b, stride_j)``: j is the token (per token) or the segment; keeps strided views (TI2V's
    chunks of ``[B, N, 6, D]``, the output norm's chunks of ``[B, 2, D]``)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:  # [B, D]: one segment per sample
        return t, t.stride(0), 0
    return t, t.stride(0), t.stride(1)


def _global_segments(segment_ids: torch.Tensor | None, layout: AdaLNLayout) -> torch.Tensor | None:
    """``[R]`` int32 ids ``b·S + s`` of packed rows (non-decreasing over all rows), or None per sample/token."""
    if segment_ids is None:
        return None
    base = torch.arange(layout.batch, device=segment_ids.device, dtype=torch.int64)[:, None] * layout.segments
    return (segment_ids.to(torch.int64) + base).reshape(-1).to(torch.int32)


def _segment_offsets(segments: torch.Tensor | None, layout: AdaLNLayout, device: torch.device) -> torch.Tensor:
    """``[G + 1]`` int64 row offsets of the G = B·S global segments (empty segments have equal offsets)."""
    count = layout.batch * layout.segments
    if segments is None:
        return torch.arange(count + 1, device=device, dtype=torch.int64) * layout.tokens
    offsets = torch.zeros(count + 1, device=device, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.bincount(segments, minlength=count), 0)
    return offsets


def adaln_forward(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused AdaLN forward.

    Args:
        x: ``[B, N, D]`` (float32, bfloat16 or float16).
        scale, shift: per sample ``[B, D]`` / ``[B, 1, D]``, per token ``[B, N, D]``, or with ``segment_ids`` per
            segment ``[B, S, D]``; float32 or x's dtype.
        eps: LayerNorm epsilon.
        segment_ids: packed rows: ``[B, N]`` int32/int64, values in ``[0, S)``, non-decreasing along N.

    Returns:
        ``(y [B, N, D] in x's dtype, mean [B, N] fp32, rstd [B, N] fp32)``.

    Raises:
        ValueError: on shapes, dtypes or devices outside the contract (message names them).
    """
    layout = _layout(x, scale, shift.shape, segment_ids)
    check_dtypes(x.dtype, scale.dtype, shift.dtype)
    check_eps(eps)
    _check_device(x, scale, shift, *([] if segment_ids is None else [segment_ids]))
    x_rows = x.contiguous()
    (scale, *scale_strides), (shift, *shift_strides) = _modulation_rows(scale, layout), _modulation_rows(shift, layout)
    segments = _global_segments(segment_ids, layout)
    y = torch.empty_like(x_rows)
    rows = layout.batch * layout.tokens
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    cfg = launch_configs(layout.dim, interpreter_active())["forward"]
    _adaln_fwd_kernel[(triton.cdiv(rows, cfg.block_r),)](
        x_rows,
        scale,
        shift,
        mean if segments is None else segments,  # SEG is never read unless SEGMENTED
        y,
        mean,
        rstd,
        *scale_strides,
        *shift_strides,
        rows,
        layout.tokens,
        layout.segments,
        layout.dim,
        eps,
        PER_TOKEN=layout.per_token,
        SEGMENTED=segments is not None,
        BLOCK_R=cfg.block_r,
        BLOCK_D=cfg.block_d,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y, mean.view(layout.batch, layout.tokens), rstd.view(layout.batch, layout.tokens)


def default_num_programs(device: torch.device, dim: int) -> int:
    """Row ranges P of the backward: with the column tiles, about 8 programs per SM on GPU; a handful in the
    CPU interpreter."""
    if device.type != "cuda":
        return 8
    d_tiles = triton.cdiv(dim, launch_configs(dim)["backward"].block_d)
    return max(1, 8 * torch.cuda.get_device_properties(device).multi_processor_count // d_tiles)


def adaln_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    shift_dtype: torch.dtype | None = None,
    num_programs: int | None = None,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused AdaLN backward.

    Args:
        dy: ``[B, N, D]`` gradient of y.
        x, scale, segment_ids: as given to ``adaln_forward``; mean, rstd: its ``[B, N]`` fp32 statistics.
        shift_dtype: dtype of the shift gradient (default: scale's dtype).
        num_programs: row ranges P of the backward grid (default ``default_num_programs``); the result does not
            depend on it beyond fp32 summation order.

    Returns:
        ``(dx like x, d_scale like scale, d_shift with scale's shape in shift_dtype)``.
    """
    shift_dtype = shift_dtype or scale.dtype
    layout = _layout(x, scale, scale.shape, segment_ids)
    check_dtypes(x.dtype, scale.dtype, shift_dtype)
    if dy.shape != x.shape or mean.shape != (layout.batch, layout.tokens) or rstd.shape != mean.shape:
        raise ValueError(
            f"adaln_backward: dy {list(dy.shape)} must match x {list(x.shape)}, mean/rstd "
            f"{list(mean.shape)}/{list(rstd.shape)} must be [{layout.batch}, {layout.tokens}]"
        )
    _check_device(dy, x, scale, mean, rstd, *([] if segment_ids is None else [segment_ids]))
    rows = layout.batch * layout.tokens
    cfgs = launch_configs(layout.dim, interpreter_active())
    programs = min(rows, num_programs or default_num_programs(x.device, layout.dim))
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)  # every range holds at least one row
    x, dy, (scale_rows, *strides) = x.contiguous(), dy.contiguous(), _modulation_rows(scale, layout)
    mean, rstd = mean.contiguous(), rstd.contiguous()
    segments = _global_segments(segment_ids, layout)
    seg_arg = mean if segments is None else segments  # never read unless SEGMENTED
    common = (rows, layout.tokens, layout.segments, layout.dim)
    flags = {"PER_TOKEN": layout.per_token, "SEGMENTED": segments is not None}
    c1, c2 = torch.empty_like(mean), torch.empty_like(mean)
    cfg = cfgs["backward_rows"]
    _adaln_bwd_rowsum_kernel[(triton.cdiv(rows, cfg.block_r),)](
        x, dy, scale_rows, seg_arg, mean, rstd, c1, c2, *strides, *common,
        **flags, BLOCK_R=cfg.block_r, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    dx = torch.empty_like(x)
    if layout.per_token:
        d_scale = torch.empty(scale.shape, dtype=scale.dtype, device=x.device)
        d_shift = torch.empty(scale.shape, dtype=shift_dtype, device=x.device)
    else:
        slots = programs + layout.batch * layout.segments - 1
        d_scale = torch.empty(slots, layout.dim, dtype=torch.float32, device=x.device)
        d_shift = torch.empty_like(d_scale)
    cfg = cfgs["backward"]
    _adaln_bwd_kernel[(triton.cdiv(layout.dim, cfg.block_d), programs)](
        x, dy, scale_rows, seg_arg, mean, rstd, c1, c2, dx, d_scale, d_shift, *strides, *common, rows_per_program,
        **flags, BLOCK_R=cfg.block_r, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if layout.per_token:
        return dx, d_scale, d_shift
    offsets = _segment_offsets(segments, layout, x.device)
    return dx, *_segment_sum(d_scale, d_shift, offsets, scale, shift_dtype, layout, rows_per_program)


def _segment_sum(
    partial_scale: torch.Tensor,
    partial_shift: torch.Tensor,
    offsets: torch.Tensor,
    scale: torch.Tensor,
    shift_dtype: torch.dtype,
    layout: AdaLNLayout,
    rows_per_program: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Finish the per-segment column sums: ``[P + G − 1, D]`` partials -> scale's shape in the modulation dtypes."""
    d_scale = torch.empty(scale.shape, dtype=scale.dtype, device=scale.device)
    d_shift = torch.empty(scale.shape, dtype=shift_dtype, device=scale.device)
    cfg = launch_configs(layout.dim)["segment_sum"]
    grid = (layout.batch * layout.segments, triton.cdiv(layout.dim, cfg.block_d))
    _adaln_segment_sum_kernel[grid](
        partial_scale, partial_shift, offsets, d_scale, d_shift, layout.dim, rows_per_program,
        BLOCK_D=cfg.block_d, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return d_scale, d_shift


# The launchers as PyTorch operators: torch.compile keeps them as single graph nodes, and FakeTensorMode (the GPU
# memory estimate of ``wanloom compile``) gets their output shapes without running a kernel.
@torch.library.custom_op("wanloom::adaln_forward", mutates_args=())
def _forward_op(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float, segment_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return adaln_forward(x, scale, shift, eps, segment_ids)


@_forward_op.register_fake
def _(x, scale, shift, eps, segment_ids):
    stats = x.new_empty(x.shape[:2], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@torch.library.custom_op("wanloom::adaln_backward", mutates_args=())
def _backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    shift_dtype: torch.dtype,
    segment_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return adaln_backward(dy, x, scale, mean, rstd, shift_dtype=shift_dtype, segment_ids=segment_ids)


@_backward_op.register_fake
def _(dy, x, scale, mean, rstd, shift_dtype, segment_ids):
    d_shift = scale.new_empty(scale.shape, dtype=shift_dtype)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(scale), d_shift


class AdaLNFunction(torch.autograd.Function):
    """Autograd wrapper: saves x, mean, rstd and scale (not y, not x̂, not shift)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        scale: torch.Tensor,
        shift: torch.Tensor,
        eps: float = 1e-6,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        y, mean, rstd = _forward_op(x, scale, shift, eps, segment_ids)
        ctx.save_for_backward(x, mean, rstd, scale, segment_ids)
        ctx.shift_dtype = shift.dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        x, mean, rstd, scale, segment_ids = ctx.saved_tensors
        dx, d_scale, d_shift = _backward_op(dy, x, scale, mean, rstd, ctx.shift_dtype, segment_ids)
        return dx, d_scale, d_shift, None, None


def adaln_triton(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused ``LayerNorm(x) · (1 + scale) + shift`` (autograd-aware); arguments as in ``adaln_forward``."""
    return AdaLNFunction.apply(x, scale, shift, eps, segment_ids)


# ---------------------------------------------------------------------------------------------------- AOT variants

MODULATIONS = ("sample", "token", "segment")
_TRITON_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def aot_variants(dim: int, x_dtype: str, modulation: str) -> list[tuple[str, object, dict, dict, TileConfig]]:
    """Every kernel the launchers can start for rows of width ``dim``: ``(pass, kernel, signature, constexprs,
    launch)`` with fp32 modulation (what the Wan models pass), for ``kernels.triton_aot.compile_kernel``."""
    if modulation not in MODULATIONS:
        raise ValueError(f"modulation {modulation!r}; valid: {', '.join(MODULATIONS)}")
    x = "*" + _TRITON_TYPES[x_dtype]
    flags = {"PER_TOKEN": modulation == "token", "SEGMENTED": modulation == "segment"}
    seg = "*i32" if flags["SEGMENTED"] else "*fp32"
    cfgs = launch_configs(dim)
    i32, f32, ptr32, const = "i32", "fp32", "*fp32", "constexpr"
    sizes = {"n_rows": i32, "n_tokens": i32, "n_segments": i32, "D": i32}
    consts = {"PER_TOKEN": const, "SEGMENTED": const, "BLOCK_R": const, "BLOCK_D": const}

    def tiles(cfg: TileConfig) -> dict:
        return {**flags, "BLOCK_R": cfg.block_r, "BLOCK_D": cfg.block_d}

    forward = {
        "X": x, "SCALE": ptr32, "SHIFT": ptr32, "SEG": seg, "Y": x, "MEAN": ptr32, "RSTD": ptr32,
        "scale_stride_b": i32, "scale_stride_j": i32, "shift_stride_b": i32, "shift_stride_j": i32,
        **sizes, "eps": f32, **consts,
    }  # fmt: skip
    rows = {
        "X": x, "DY": x, "SCALE": ptr32, "SEG": seg, "MEAN": ptr32, "RSTD": ptr32, "C1": ptr32, "C2": ptr32,
        "stride_b": i32, "stride_j": i32, **sizes, **consts,
    }  # fmt: skip
    d_mod = ptr32  # per-sample/segment partials are fp32; per-token gradients come back in scale's dtype (fp32)
    backward = {
        "X": x, "DY": x, "SCALE": ptr32, "SEG": seg, "MEAN": ptr32, "RSTD": ptr32, "C1": ptr32, "C2": ptr32,
        "DX": x, "DSCALE": d_mod, "DSHIFT": d_mod, "stride_b": i32, "stride_j": i32, **sizes,
        "rows_per_program": i32, **consts,
    }  # fmt: skip
    variants = [
        ("forward", _adaln_fwd_kernel, forward, tiles(cfgs["forward"]), cfgs["forward"]),
        ("backward_rows", _adaln_bwd_rowsum_kernel, rows, tiles(cfgs["backward_rows"]), cfgs["backward_rows"]),
        ("backward", _adaln_bwd_kernel, backward, tiles(cfgs["backward"]), cfgs["backward"]),
    ]
    if modulation != "token":
        summed = {
            "PARTIAL_SCALE": ptr32, "PARTIAL_SHIFT": ptr32, "SEG_OFFSETS": "*i64", "DSCALE": ptr32, "DSHIFT": ptr32,
            "D": i32, "rows_per_program": i32, "BLOCK_D": const,
        }  # fmt: skip
        launch = cfgs["segment_sum"]
        variants.append(("segment_sum", _adaln_segment_sum_kernel, summed, {"BLOCK_D": launch.block_d}, launch))
    return variants
