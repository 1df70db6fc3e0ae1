"""Shape and dtype contract of the fused AdaLN op, shared by the Triton and Pallas launchers.

Pure Python (no jax, no torch): both launchers pass shapes as tuples and dtypes as names such as ``"bfloat16"``,
so the two frameworks reject bad input with the same messages.

Contract:
- ``x``: ``[B, N, D]`` in float32, bfloat16 or float16.
- ``scale`` and ``shift``: the same shape, either per sample ``[B, D]`` / ``[B, 1, D]`` (broadcast over the
  sequence, Wan 14B) or per token ``[B, N, D]`` (Wan 2.2 TI2V-5B); each in float32 or in x's dtype.
- Packed sequences (docs/architecture.md, "Packed sequences"): ``segment_ids`` ``[B, N]`` int32 with values in
  ``[0, S)``, non-decreasing along N, and per-segment ``scale``/``shift`` ``[B, S, D]``. Row ``(b, n)`` is modulated
  by ``scale[b, segment_ids[b, n]]``. Launchers check shapes and dtypes only (a value check would synchronise the
  device on every call); whoever builds the ids checks their values once with ``check_segment_ids``.
- ``y`` has x's dtype; gradients come back in the dtype and shape of the input they belong to.
"""

from __future__ import annotations

from dataclasses import dataclass

X_DTYPES = ("float32", "bfloat16", "float16")

# The Pallas (TPU) kernel's blocking, here so that the planner can size packed rows without importing jax.
PALLAS_LANES = 128
# Bytes of one fp32 (tn, D) tile: the kernels hold a few such temporaries plus double-buffered inputs and outputs,
# which must fit the scoped VMEM limit below (TPU v7x: 64 MiB VMEM per TensorCore).
PALLAS_TILE_BYTES = 2 * 1024 * 1024
PALLAS_MAX_ROWS = 1024
PALLAS_VMEM_LIMIT_BYTES = 48 * 1024 * 1024
# The backward's row blocks (x, dy, dx double-buffered and its fp32 temporaries), in (tn, Dp) fp32 tiles.
_ROW_TILES = 10


def max_packed_segments(dim: int) -> int:
    """The most segment slots a packed row may have for the Pallas backward to fit its VMEM limit at model width
    ``dim``: a power of two. Per padded segment the backward keeps the row's scale table (double-buffered), the
    d_scale/d_shift accumulators (written back double-buffered) and their per-block products, ``8·Dp`` fp32, plus
    two one-hot columns of the block, ``2·tn`` fp32; the row blocks take ``_ROW_TILES`` fp32 ``(tn, Dp)`` tiles."""
    d_pad = -(-dim // PALLAS_LANES) * PALLAS_LANES
    rows = max(PALLAS_LANES, min(PALLAS_MAX_ROWS, PALLAS_TILE_BYTES // (4 * d_pad)) // PALLAS_LANES * PALLAS_LANES)
    free = PALLAS_VMEM_LIMIT_BYTES - _ROW_TILES * rows * d_pad * 4
    per_segment = (8 * d_pad + 2 * rows) * 4
    fit = max(PALLAS_LANES, free // per_segment // PALLAS_LANES * PALLAS_LANES)  # tables are padded to 128 rows
    return 1 << (int(fit).bit_length() - 1)


@dataclass(frozen=True)
class AdaLNLayout:
    """What a launcher needs to know about one call: sizes and whether modulation is per token."""

    batch: int
    tokens: int
    dim: int
    per_token: bool
    segments: int = 1  # S: modulation rows per sample (1 per sample; packed rows hold S segments)


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` / ``dtype('bfloat16')`` / ``jnp.bfloat16`` -> ``"bfloat16"``."""
    name = getattr(dtype, "name", None) or str(dtype)
    return name.removeprefix("torch.")


def adaln_layout(
    x_shape: tuple[int, ...],
    scale_shape: tuple[int, ...],
    shift_shape: tuple[int, ...],
    segment_shape: tuple[int, ...] | None = None,
) -> AdaLNLayout:
    """Check shapes and classify the modulation (``segment_shape``: the shape of ``segment_ids``, if any).

    Raises:
        ValueError: naming the offending argument, its shape and the valid shapes.
    """
    x_shape, scale_shape, shift_shape = tuple(x_shape), tuple(scale_shape), tuple(shift_shape)
    if len(x_shape) != 3 or min(x_shape, default=0) < 1:
        raise ValueError(f"adaln: x must have shape [B, N, D] with B, N, D >= 1, got {list(x_shape)}")
    b, n, d = x_shape
    if scale_shape != shift_shape:
        raise ValueError(
            f"adaln: scale and shift must have the same shape, got {list(scale_shape)} and {list(shift_shape)}"
        )
    if segment_shape is not None:
        if tuple(segment_shape) != (b, n):
            raise ValueError(f"adaln: segment_ids must have shape [B, N] = [{b}, {n}], got {list(segment_shape)}")
        if len(scale_shape) != 3 or scale_shape[0] != b or scale_shape[2] != d or scale_shape[1] < 1:
            raise ValueError(
                f"adaln: with segment_ids, scale/shift must be per segment [{b}, S, {d}], got {list(scale_shape)}"
            )
        return AdaLNLayout(b, n, d, per_token=False, segments=scale_shape[1])
    per_sample = {(b, d), (b, 1, d)}
    if scale_shape in per_sample:
        return AdaLNLayout(b, n, d, per_token=False)
    if scale_shape == (b, n, d):
        return AdaLNLayout(b, n, d, per_token=True)
    raise ValueError(
        f"adaln: scale/shift shape {list(scale_shape)} does not fit x {list(x_shape)}; valid: "
        f"per sample [{b}, {d}] or [{b}, 1, {d}], per token [{b}, {n}, {d}]"
    )


def check_dtypes(x_dtype: object, scale_dtype: object, shift_dtype: object) -> None:
    """x in float32/bfloat16/float16; scale and shift each in float32 or x's dtype.

    Raises:
        ValueError: naming the argument and the valid dtypes.
    """
    x_name = dtype_name(x_dtype)
    if x_name not in X_DTYPES:
        raise ValueError(f"adaln: x dtype {x_name} is not supported; valid: {', '.join(X_DTYPES)}")
    valid = sorted({"float32", x_name})
    for arg, dtype in (("scale", scale_dtype), ("shift", shift_dtype)):
        if dtype_name(dtype) not in valid:
            raise ValueError(
                f"adaln: {arg} dtype {dtype_name(dtype)} is not supported with x in {x_name}; valid: {', '.join(valid)}"
            )


def check_segment_dtype(dtype: object) -> None:
    if dtype_name(dtype) not in ("int32", "int64"):
        raise ValueError(f"adaln: segment_ids must be int32 or int64, got {dtype_name(dtype)}")


def check_segment_ids(segment_ids: object, segments: int) -> None:
    """Values of a ``[B, N]`` segment-id array (anything numpy can read): in ``[0, segments)``, non-decreasing.

    Raises:
        ValueError: naming the first offending row and what is valid.
    """
    import numpy as np

    ids = np.asarray(segment_ids)
    if ids.ndim != 2:
        raise ValueError(f"adaln: segment_ids must have shape [B, N], got {list(ids.shape)}")
    bad = np.flatnonzero(((ids < 0) | (ids >= segments)).any(axis=1))
    if bad.size:
        outside = sorted({int(v) for v in ids[bad[0]] if not 0 <= v < segments})
        raise ValueError(f"adaln: segment_ids row {bad[0]} has ids outside [0, {segments}): {outside}")
    bad = np.flatnonzero((np.diff(ids, axis=1) < 0).any(axis=1))
    if bad.size:
        raise ValueError(
            f"adaln: segment_ids row {bad[0]} decreases along N; segments must be contiguous runs in order"
        )


def check_eps(eps: float) -> None:
    if not eps > 0:
        raise ValueError(f"adaln: eps must be > 0, got {eps}")
