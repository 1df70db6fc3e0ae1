"""Fused AdaLN in Pallas (Mosaic TPU): ``y = LayerNorm(x) · (1 + scale) + shift`` with its backward, for JAX.

Same math as ``adaln_triton`` (statistics in fp32, ``g = dy·(1 + scale)``,
``dx = r·(g − mean_d g − x̂·mean_d(g·x̂))``, ``d_scale[b] = Σ_{n∈b} dy·x̂``, ``d_shift[b] = Σ_{n∈b} dy``). Blocking:

- Grid ``(B, ceil(N / tn))``; a ``(tn, D)`` block of rows sits in VMEM. Per-sample modulation is one ``(1, D)``
  block per sample; per-token modulation is blocked like x.
- Packed rows (``segment_ids [B, N]``, modulation ``[B, S, D]``; docs/architecture.md, "Packed sequences"): the
  ``[S, D]`` modulation of a row stays resident in VMEM (S padded to 128 lanes' worth of rows); a block gathers its
  rows' modulation with a one-hot ``(tn, S) × (S, D)`` matrix product, and the backward accumulates
  ``d_scale``/``d_shift`` per segment with the transposed one-hot product ``(S, tn) × (tn, D)`` into resident
  ``(S, D)`` fp32 blocks: exact (fp32, one non-zero per product), deterministic, no scatter. The ids come in twice,
  as a ``(tn, 1)`` column and a ``(1, tn)`` row, so neither product needs an in-kernel transpose.
- Backward, per-sample modulation: the sequence axis is ``"arbitrary"`` and the d_scale/d_shift outputs have an
  index_map that ignores n, so their ``(8, D)`` fp32 blocks stay resident in VMEM as accumulators (zeroed under
  ``pl.when(n == 0)``). Rows fold into 8 sublanes with plain vector adds; the 8 → 1 sum and the cast to the
  modulation dtype happen outside the kernel. One pass over x and dy, no atomics, fixed order: deterministic.
- N not a multiple of tn: the last block is partial; its rows past N are masked out of every reduction (Pallas drops
  writes past the end). D not a multiple of 128: x, scale, shift and dy are zero-padded to the next multiple of 128
  so blocks are lane-dense, and the variance masks the padded columns.
- Residuals are x and scale only. Unlike the Triton kernel, the row statistics are recomputed in the backward
  instead of saved: a per-row ``[B, N, 1]`` array is padded to 128 lanes in TPU HBM layouts (each would add ~5% of
  x's traffic at D = 5120), while recomputing costs two vector ops per element in a memory-bound kernel.

Works per shard under ``shard_map`` (the kernel sees local shapes only). With ``check_vma=False`` (tested here)
the shard_map transpose reduces d_scale/d_shift of a modulation replicated along a sharded sequence, as for any
replicated input. With ``check_vma=True`` the outputs carry x's manual axis types and the backward psums
d_scale/d_shift over the axes x varies along and scale does not; jax 0.10's Pallas interpreter rejects
``check_vma=True`` for any kernel, so that path runs on TPU only and is untested on CPU.

``interpret``: ``None`` picks Mosaic on TPU, the Pallas interpreter on CPU and raises on a GPU backend; ``True`` or
a ``pltpu.InterpretParams`` (TPU-faithful interpreter: uninitialised reads as NaN, race detection) forces it. On a
multi-device mesh the kernel must run inside ``shard_map`` (``parallel/sharded_adaln.py``): Mosaic kernels cannot
be partitioned automatically.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from wanloom_trainer.kernels.adaln_shapes import (
    PALLAS_LANES,
    PALLAS_MAX_ROWS,
    PALLAS_TILE_BYTES,
    PALLAS_VMEM_LIMIT_BYTES,
    AdaLNLayout,
    adaln_layout,
    check_dtypes,
    check_eps,
    check_segment_dtype,
)

_LANES = PALLAS_LANES
_ACC_SUBLANES = 8
_TILE_BYTES = PALLAS_TILE_BYTES
_MAX_ROWS = PALLAS_MAX_ROWS
_VMEM_LIMIT_BYTES = PALLAS_VMEM_LIMIT_BYTES
_EXACT = jax.lax.Precision.HIGHEST  # fp32 one-hot products must not round the modulation through bf16 passes

Interpret = bool | pltpu.InterpretParams | None


# ---------------------------------------------------------------------------------------------------- kernels


def _normalise(x_ref, *, d_true: int, eps: float) -> tuple[jax.Array, jax.Array]:
    """fp32 ``x̂`` of a ``(tn, Dp)`` block (padded columns ≥ d_true set to 0) and its ``(tn, 1)`` rstd."""
    x = x_ref[...].astype(jnp.float32)
    xc = x - jnp.sum(x, axis=-1, keepdims=True) / d_true
    if x.shape[-1] != d_true:
        xc = jnp.where(jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < d_true, xc, 0.0)
    rstd = jax.lax.rsqrt(jnp.sum(xc * xc, axis=-1, keepdims=True) / d_true + eps)
    return xc * rstd, rstd


def _fwd_kernel(x_ref, scale_ref, shift_ref, y_ref, *, d_true: int, eps: float):
    # x_ref, y_ref: (tn, Dp); scale_ref, shift_ref: (1, Dp) per sample or (tn, Dp) per token
    x_hat, _ = _normalise(x_ref, d_true=d_true, eps=eps)
    y = x_hat * (1.0 + scale_ref[...].astype(jnp.float32)) + shift_ref[...].astype(jnp.float32)
    y_ref[...] = y.astype(y_ref.dtype)


def _one_hot_rows(ids_col_ref, segments: int) -> jax.Array:
    """fp32 (tn, S): row r selects its segment."""
    ids = ids_col_ref[...]
    return (ids == jax.lax.broadcasted_iota(jnp.int32, (ids.shape[0], segments), 1)).astype(jnp.float32)


def _gather(one_hot: jax.Array, table_ref) -> jax.Array:
    """(tn, S) × (S, Dp): each row's modulation, exactly (one non-zero term per output)."""
    return jnp.dot(one_hot, table_ref[...].astype(jnp.float32), precision=_EXACT, preferred_element_type=jnp.float32)


def _fwd_kernel_segments(ids_col_ref, x_ref, scale_ref, shift_ref, y_ref, *, d_true: int, eps: float):
    # ids_col: (tn, 1) int32; x_ref, y_ref: (tn, Dp); scale_ref, shift_ref: (S, Dp), resident per row
    x_hat, _ = _normalise(x_ref, d_true=d_true, eps=eps)
    one_hot = _one_hot_rows(ids_col_ref, scale_ref.shape[0])
    y = x_hat * (1.0 + _gather(one_hot, scale_ref)) + _gather(one_hot, shift_ref)
    y_ref[...] = y.astype(y_ref.dtype)


def _row_grads(x_ref, dy_ref, scale: jax.Array, dx_ref, *, d_true: int, eps: float, n_true: int | None):
    """Write dx of a ``(tn, Dp)`` block; return fp32 ``x̂`` and ``dy`` (rows past N zeroed when n_true is set)."""
    x_hat, rstd = _normalise(x_ref, d_true=d_true, eps=eps)
    dy = dy_ref[...].astype(jnp.float32)
    if n_true is not None:  # partial last block: rows past N hold garbage and must not reach the column sums
        tn = x_hat.shape[0]
        valid = pl.program_id(1) * tn + jax.lax.broadcasted_iota(jnp.int32, (tn, 1), 0) < n_true
        x_hat, dy = jnp.where(valid, x_hat, 0.0), jnp.where(valid, dy, 0.0)
    g = dy * (1.0 + scale.astype(jnp.float32))  # 0 on padded columns, where dy is 0
    c1 = jnp.sum(g, axis=-1, keepdims=True) / d_true
    c2 = jnp.sum(g * x_hat, axis=-1, keepdims=True) / d_true
    dx_ref[...] = (rstd * (g - c1 - x_hat * c2)).astype(dx_ref.dtype)
    return x_hat, dy


def _bwd_kernel_per_sample(x_ref, dy_ref, scale_ref, dx_ref, dscale_ref, dshift_ref, **static):
    # x/dy/dx: (tn, Dp); scale: (1, Dp); dscale/dshift: (8, Dp) fp32, resident across the sequence axis
    @pl.when(pl.program_id(1) == 0)
    def _init():
        dscale_ref[...] = jnp.zeros_like(dscale_ref)
        dshift_ref[...] = jnp.zeros_like(dshift_ref)

    x_hat, dy = _row_grads(x_ref, dy_ref, scale_ref[...], dx_ref, **static)
    folded = (x_hat.shape[0] // _ACC_SUBLANES, _ACC_SUBLANES, x_hat.shape[1])
    dscale_ref[...] += jnp.sum((dy * x_hat).reshape(folded), axis=0)
    dshift_ref[...] += jnp.sum(dy.reshape(folded), axis=0)


def _bwd_kernel_per_token(x_ref, dy_ref, scale_ref, dx_ref, dscale_ref, dshift_ref, **static):
    # every ref (tn, Dp); d_scale = dy·x̂ and d_shift = dy elementwise
    x_hat, dy = _row_grads(x_ref, dy_ref, scale_ref[...], dx_ref, **static)
    dscale_ref[...] = (dy * x_hat).astype(dscale_ref.dtype)
    dshift_ref[...] = dy.astype(dshift_ref.dtype)


def _bwd_kernel_segments(ids_row_ref, ids_col_ref, x_ref, dy_ref, scale_ref, dx_ref, dscale_ref, dshift_ref, **static):
    # ids_row: (1, tn), ids_col: (tn, 1) int32; x/dy/dx: (tn, Dp); scale: (S, Dp); dscale/dshift: (S, Dp) fp32,
    # resident across the sequence axis
    @pl.when(pl.program_id(1) == 0)
    def _init():
        dscale_ref[...] = jnp.zeros_like(dscale_ref)
        dshift_ref[...] = jnp.zeros_like(dshift_ref)

    segments = scale_ref.shape[0]
    x_hat, dy = _row_grads(x_ref, dy_ref, _gather(_one_hot_rows(ids_col_ref, segments), scale_ref), dx_ref, **static)
    ids = ids_row_ref[...]
    one_hot_t = (jax.lax.broadcasted_iota(jnp.int32, (segments, ids.shape[1]), 0) == ids).astype(jnp.float32)
    dot = functools.partial(jnp.dot, precision=_EXACT, preferred_element_type=jnp.float32)
    dscale_ref[...] += dot(one_hot_t, dy * x_hat)
    dshift_ref[...] += dot(one_hot_t, dy)


# ---------------------------------------------------------------------------------------------------- launchers


@functools.lru_cache(maxsize=1)
def _default_interpret() -> bool:
    """Mosaic on TPU, the Pallas interpreter on CPU (tests, local runs); a GPU host gets an error rather than an
    interpreter that would run the kernel element by element."""
    backend = jax.default_backend()
    if backend == "gpu":
        raise ValueError(
            "kernels.adaln: fused: the Pallas kernel is a TPU (Mosaic) kernel and JAX's backend here is gpu; "
            "use spec.kernels.adaln: reference with backend jax, or the PyTorch backend (Triton) on NVIDIA GPUs"
        )
    return backend != "tpu"


def _block_rows(layout: AdaLNLayout, d_pad: int, x_dtype: jnp.dtype, block_rows: int | None) -> int:
    """Rows per block tn: a multiple of the sublane tiling (8 fp32, 16 bf16), about _TILE_BYTES of fp32; with
    segments a multiple of 128, since the ids also come as a ``(1, tn)`` row."""
    sublanes = _LANES if layout.segments > 1 else 8 * max(1, 4 // jnp.dtype(x_dtype).itemsize)
    if block_rows is not None:
        if block_rows < 1 or block_rows % sublanes:
            raise ValueError(
                f"adaln_pallas: block_rows must be a positive multiple of {sublanes} for x in "
                f"{jnp.dtype(x_dtype).name}, got {block_rows}"
            )
        return block_rows
    cap = max(sublanes, min(_MAX_ROWS, _TILE_BYTES // (4 * d_pad)) // sublanes * sublanes)
    return min(cap, pl.cdiv(layout.tokens, sublanes) * sublanes)


def _pad_lanes(a: jax.Array, d_pad: int) -> jax.Array:
    extra = d_pad - a.shape[-1]
    return a if extra == 0 else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)])


class _Blocked(NamedTuple):
    x: jax.Array  # [B, N, Dp]
    mods: tuple[jax.Array, ...]  # [B, 1, Dp] per sample, [B, N, Dp] per token, [B, Sp, Dp] per segment
    tn: int
    row_spec: pl.BlockSpec
    mod_spec: pl.BlockSpec
    grid: tuple[int, int]
    ids: tuple[jax.Array, ...] = ()  # per segment: ids as [B, 1, N'] rows and [B, N', 1] columns (N' = grid · tn)
    ids_specs: tuple[pl.BlockSpec, ...] = ()


def _prepare(
    x: jax.Array,
    mods: tuple[jax.Array, ...],
    layout: AdaLNLayout,
    block_rows: int | None,
    segment_ids: jax.Array | None = None,
) -> _Blocked:
    """Lane-pad x and the modulation tensors, pick tn and build the block specs of the (B, N / tn) grid."""
    d_pad = pl.cdiv(layout.dim, _LANES) * _LANES
    tn = _block_rows(layout, d_pad, x.dtype, block_rows)
    grid = (layout.batch, pl.cdiv(layout.tokens, tn))
    mods = tuple(_pad_lanes(m.reshape(layout.batch, -1, layout.dim), d_pad) for m in mods)
    row_spec = pl.BlockSpec((None, tn, d_pad), lambda b, n: (b, n, 0))
    if segment_ids is None:
        mod_spec = row_spec if layout.per_token else pl.BlockSpec((None, 1, d_pad), lambda b, n: (b, 0, 0))
        return _Blocked(_pad_lanes(x, d_pad), mods, tn, row_spec, mod_spec, grid)
    s_pad = pl.cdiv(layout.segments, _LANES) * _LANES  # lane-dense one-hot products
    mods = tuple(jnp.pad(m, ((0, 0), (0, s_pad - layout.segments), (0, 0))) for m in mods)
    mod_spec = pl.BlockSpec((None, s_pad, d_pad), lambda b, n: (b, 0, 0))
    ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, grid[1] * tn - layout.tokens)), mode="edge")
    ids_specs = (
        pl.BlockSpec((None, 1, tn), lambda b, n: (b, 0, n)),
        pl.BlockSpec((None, tn, 1), lambda b, n: (b, n, 0)),
    )
    ids_views = (ids[:, None, :], ids[:, :, None])
    return _Blocked(_pad_lanes(x, d_pad), mods, tn, row_spec, mod_spec, grid, ids_views, ids_specs)


def _check(
    x: jax.Array,
    scale: jax.Array,
    shift_shape: tuple[int, ...],
    shift_dtype: object,
    eps: float,
    segment_ids: jax.Array | None = None,
):
    layout = adaln_layout(x.shape, scale.shape, shift_shape, None if segment_ids is None else segment_ids.shape)
    check_dtypes(x.dtype, scale.dtype, shift_dtype)
    check_eps(eps)
    if segment_ids is not None:
        check_segment_dtype(segment_ids.dtype)
    return layout


def _like(x: jax.Array, shape: tuple[int, ...], dtype: object) -> jax.ShapeDtypeStruct:
    """An output aval that varies over the same shard_map axes as x (needed under ``check_vma=True``)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(x).mat)


def _resolve_interpret(x: jax.Array, interpret: object) -> object:
    interpret = _default_interpret() if interpret is None else interpret
    if interpret and jax.typeof(x).mat.varying:
        raise ValueError(
            "adaln_pallas: the Pallas interpreter (jax 0.10) cannot run under shard_map(check_vma=True); "
            "use shard_map(..., check_vma=False) off TPU"
        )
    return interpret


def _compiler_params(*semantics: str) -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=_VMEM_LIMIT_BYTES)


def adaln_forward(
    x: jax.Array,
    scale: jax.Array,
    shift: jax.Array,
    eps: float = 1e-6,
    *,
    interpret: Interpret = None,
    block_rows: int | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Fused AdaLN forward.

    Args:
        x: ``[B, N, D]`` (float32, bfloat16 or float16).
        scale, shift: per sample ``[B, D]`` / ``[B, 1, D]``, per token ``[B, N, D]``, or with ``segment_ids`` per
            segment ``[B, S, D]``; float32 or x's dtype.
        eps: LayerNorm epsilon.
        interpret: run the Pallas interpreter (default: when the backend is not TPU); see the module docstring.
        block_rows: rows per block tn (default: about 2 MiB of fp32 per block).
        segment_ids: packed rows: int32 ``[B, N]`` ids of each token's segment (docs/architecture.md).

    Returns:
        ``y``: ``[B, N, D]`` in x's dtype.

    Raises:
        ValueError: on shapes, dtypes or block sizes outside the contract (message names them).
    """
    layout = _check(x, scale, shift.shape, shift.dtype, eps, segment_ids)
    blk = _prepare(x, (scale, shift), layout, block_rows, segment_ids)
    kernel = _fwd_kernel if segment_ids is None else _fwd_kernel_segments
    y = pl.pallas_call(
        functools.partial(kernel, d_true=layout.dim, eps=eps),
        out_shape=_like(x, blk.x.shape, x.dtype),
        grid=blk.grid,
        in_specs=[*blk.ids_specs[1:], blk.row_spec, blk.mod_spec, blk.mod_spec],
        out_specs=blk.row_spec,
        compiler_params=_compiler_params("parallel", "parallel"),
        interpret=_resolve_interpret(x, interpret),
        name="adaln_fwd",
    )(*blk.ids[1:], blk.x, *blk.mods)
    return y[..., : layout.dim]


def adaln_backward(
    dy: jax.Array,
    x: jax.Array,
    scale: jax.Array,
    eps: float = 1e-6,
    *,
    shift_dtype: object = None,
    interpret: Interpret = None,
    block_rows: int | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fused AdaLN backward: one pass over x and dy.

    Args:
        dy: ``[B, N, D]`` gradient of y; x, scale, eps, interpret, block_rows, segment_ids: as given to
            ``adaln_forward``.
        shift_dtype: dtype of the shift gradient (default: scale's dtype).

    Returns:
        ``(dx like x, d_scale like scale, d_shift with scale's shape in shift_dtype)``.
    """
    shift_dtype = jnp.dtype(shift_dtype or scale.dtype)
    layout = _check(x, scale, scale.shape, shift_dtype, eps, segment_ids)
    if dy.shape != x.shape:
        raise ValueError(f"adaln_pallas: dy shape {list(dy.shape)} must match x {list(x.shape)}")
    blk = _prepare(x, (scale,), layout, block_rows, segment_ids)
    d_pad = blk.x.shape[-1]
    static = {"d_true": layout.dim, "eps": eps, "n_true": None if layout.tokens % blk.tn == 0 else layout.tokens}
    if segment_ids is not None:
        kernel, acc_spec, semantics = _bwd_kernel_segments, blk.mod_spec, ("parallel", "arbitrary")
        acc_shapes = [_like(x, blk.mods[0].shape, jnp.float32)] * 2
    elif layout.per_token:
        kernel, acc_spec, semantics = _bwd_kernel_per_token, blk.row_spec, ("parallel", "parallel")
        acc_shapes = [_like(x, blk.x.shape, dtype) for dtype in (scale.dtype, shift_dtype)]
    else:
        kernel, semantics = _bwd_kernel_per_sample, ("parallel", "arbitrary")
        acc_spec = pl.BlockSpec((None, _ACC_SUBLANES, d_pad), lambda b, n: (b, 0, 0))
        acc_shapes = [_like(x, (layout.batch, _ACC_SUBLANES, d_pad), jnp.float32)] * 2
    dx, d_scale, d_shift = pl.pallas_call(
        functools.partial(kernel, **static),
        out_shape=[_like(x, blk.x.shape, x.dtype), *acc_shapes],
        grid=blk.grid,
        in_specs=[*blk.ids_specs, blk.row_spec, blk.row_spec, blk.mod_spec],
        out_specs=[blk.row_spec, acc_spec, acc_spec],
        compiler_params=_compiler_params(*semantics),
        interpret=_resolve_interpret(x, interpret),
        name="adaln_bwd",
    )(*blk.ids, blk.x, _pad_lanes(dy, d_pad), *blk.mods)
    if segment_ids is not None:  # drop the lane padding of S
        d_scale, d_shift = (a[:, : layout.segments] for a in (d_scale, d_shift))
    elif not layout.per_token:  # 8 sublane partials -> one row per sample, in a fixed order
        d_scale, d_shift = (jnp.sum(a, axis=1) for a in (d_scale, d_shift))
    d_scale, d_shift = (a[..., : layout.dim].reshape(scale.shape) for a in (d_scale, d_shift))
    return dx[..., : layout.dim], d_scale.astype(scale.dtype), d_shift.astype(shift_dtype)


# ---------------------------------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _adaln(x, scale, shift, segment_ids, eps, interpret, block_rows, shift_dtype):
    return adaln_forward(x, scale, shift, eps, interpret=interpret, block_rows=block_rows, segment_ids=segment_ids)


def _adaln_fwd(x, scale, shift, segment_ids, eps, interpret, block_rows, shift_dtype):
    y = adaln_forward(x, scale, shift, eps, interpret=interpret, block_rows=block_rows, segment_ids=segment_ids)
    return y, (x, scale, segment_ids)


def _adaln_bwd(eps, interpret, block_rows, shift_dtype, residuals, dy):
    x, scale, segment_ids = residuals
    dx, d_scale, d_shift = adaln_backward(
        dy,
        x,
        scale,
        eps,
        shift_dtype=shift_dtype,
        interpret=interpret,
        block_rows=block_rows,
        segment_ids=segment_ids,
    )
    # Under shard_map(check_vma=True) with the sequence sharded and the modulation replicated along it, each shard
    # holds a partial column sum: reduce it over the axes x varies along and scale does not.
    summed = tuple(sorted(jax.typeof(x).mat.varying - jax.typeof(scale).mat.varying))
    if summed:
        d_scale, d_shift = jax.lax.psum((d_scale, d_shift), summed)
    return dx, d_scale, d_shift, None


_adaln.defvjp(_adaln_fwd, _adaln_bwd)


def adaln_pallas(
    x: jax.Array,
    scale: jax.Array,
    shift: jax.Array,
    eps: float = 1e-6,
    interpret: Interpret = None,
    *,
    block_rows: int | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Fused ``LayerNorm(x) · (1 + scale) + shift`` with a custom VJP; arguments as in ``adaln_forward``."""
    interpret = _default_interpret() if interpret is None else interpret
    return _adaln(x, scale, shift, segment_ids, eps, interpret, block_rows, jnp.dtype(shift.dtype))
