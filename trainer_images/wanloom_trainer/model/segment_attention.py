"""Block-diagonal attention over packed rows (docs/architecture.md, "Packed sequences").

A packed row holds several samples one after another; a query attends only to keys of its own segment. Both cores
take the segment ids as ``Segments(q [B, Nq], kv [B, Nk], max_tokens)``, ids non-decreasing along each row:

- ``xla_segment_attention``: ``jax.nn.dot_product_attention`` with the ``q == kv`` id mask; runs anywhere and is the
  reference. It computes every (query, key) pair, so its cost is that of the whole row.
- ``splash_segment_attention``: the Pallas TPU splash kernel with the kernel's own segment-id masking *and* block
  skipping derived from the ids at run time. Splash's mask info (which kv block each grid step loads, and whether it
  computes) is normally built on the host from a static mask; here it is built in the graph from the segment
  boundaries, so one compiled program serves every packing of a row. A q block needs the kv blocks from the first
  key of its first segment to the last key of its last segment; the grid's kv axis is shrunk to the most blocks any
  q block can need, which ``Segments.max_tokens`` (the longest segment the packer puts in a row) bounds:
  ``⌈(block_q + 2·max_tokens) / block_kv⌉ + 1``. Attention then costs about ``Σ_segments s²`` instead of ``N²``.
  Steps past a q block's range repeat its last kv block index, so they issue no copy and skip the compute.

Every query must have at least one key (a fully masked softmax row gives NaN gradients): self-attention always has
the diagonal, and the packer gives every segment, padding included, its own text tokens for cross-attention.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

_NEVER = jnp.iinfo(jnp.int32).max  # id of padded keys: matches no query and keeps kv ids non-decreasing


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Segments:
    """Segment ids of a packed attention call.

    Attributes:
        q: int32 [B, Nq] segment of each query token.
        kv: int32 [B, Nk] segment of each key token (self-attention: the same ids as ``q``; cross-attention: the
            segment each text token belongs to).
        max_tokens: static bound on any segment's length in ``q`` and ``kv`` (0: no bound, no grid shrinking).
    """

    q: jax.Array
    kv: jax.Array
    max_tokens: int = field(default=0, metadata={"static": True})


def segment_mask(segments: Segments) -> jax.Array:
    """bool [B, 1, Nq, Nk]: query and key share a segment."""
    return (segments.q[:, :, None] == segments.kv[:, None, :])[:, None]


def xla_segment_attention(q_bsnh: jax.Array, k_bknh: jax.Array, v_bknh: jax.Array, segments: Segments) -> jax.Array:
    """Block-diagonal softmax attention [B, S, N, H] × [B, K, N, H] → [B, S, N, H] through XLA (the reference)."""
    return jax.nn.dot_product_attention(q_bsnh, k_bknh, v_bknh, mask=segment_mask(segments), implementation="xla")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def kv_steps(q_len: int, kv_len: int, block_q: int, block_kv: int, max_tokens: int) -> int:
    """Grid width of the forward (kv blocks any q block may need): bounded by ``max_tokens``, at most all blocks."""
    every = kv_len // block_kv
    if max_tokens <= 0:
        return every
    return min(every, -(-(block_q + 2 * max_tokens) // block_kv) + 1)


def _block_ranges(ids_major: jax.Array, ids_minor: jax.Array, block_major: int, block_minor: int):
    """For each block of ``ids_major``: the first and last block of ``ids_minor`` holding its segments."""
    first_ids = ids_major[::block_major]
    last_ids = ids_major[block_major - 1 :: block_major]
    start = jnp.searchsorted(ids_minor, first_ids, side="left")
    end = jnp.searchsorted(ids_minor, last_ids, side="right")
    lo = jnp.minimum(start, ids_minor.shape[0] - 1) // block_minor
    hi = jnp.maximum(end - 1, start) // block_minor
    return lo.astype(jnp.int32), jnp.maximum(hi, lo).astype(jnp.int32)


def _mask_info(lo: jax.Array, hi: jax.Array, steps: int, *, steps_major: bool):
    """Splash ``MaskInfo``: step j of block i loads block lo_i + j (clamped to hi_i, so later steps issue no copy)
    and computes while lo_i + j ≤ hi_i. Laid out [1, blocks, steps] (forward, dq) or [1, steps, blocks] (dkv)."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import MaskInfo

    wanted = lo[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    data_next = jnp.minimum(wanted, hi[:, None])
    block_mask = jnp.where(wanted <= hi[:, None], 2, 0).astype(jnp.int32)
    if steps_major:
        data_next, block_mask = data_next.T, block_mask.T
    return MaskInfo(data_next[None], None, block_mask[None], partial_mask_blocks=None, q_sequence=None)


def segment_mask_infos(q_ids: jax.Array, kv_ids: jax.Array, block_q: int, block_kv: int, max_tokens: int):
    """(forward/dq, dkv) mask infos of one example: q-major ranges over kv blocks, and kv-major over q blocks."""
    q_len, kv_len = q_ids.shape[0], kv_ids.shape[0]
    fwd_steps = kv_steps(q_len, kv_len, block_q, block_kv, max_tokens)
    dkv_steps = kv_steps(kv_len, q_len, block_kv, block_q, max_tokens)
    fwd = _mask_info(*_block_ranges(q_ids, kv_ids, block_q, block_kv), fwd_steps, steps_major=False)
    dkv = _mask_info(*_block_ranges(kv_ids, q_ids, block_kv, block_q), dkv_steps, steps_major=True)
    return fwd, dkv


@functools.lru_cache(maxsize=16)
def splash_block_sizes(block_q: int, block_kv: int):
    """One block size for the forward and both backward kernels (what both splash wrappers compile)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    return sk.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        block_q_dq=block_q,
        block_kv_dq=block_kv,
    )


def splash_layout(
    q_bsnh: jax.Array, k_bknh: jax.Array, v_bknh: jax.Array, block_q: int, block_kv: int
) -> tuple[jax.Array, jax.Array, jax.Array, int, int]:
    """(q, k, v) as splash takes them, head-major [B, N, S, H], q pre-scaled by 1/sqrt(H) (the kernel does not
    scale), each sequence zero-padded to its block; and the block sizes (no larger than the padded sequence)."""
    q_len, head_dim = q_bsnh.shape[1], q_bsnh.shape[3]
    kv_len = k_bknh.shape[1]
    bq, bkv = min(block_q, _round_up(q_len, 128)), min(block_kv, _round_up(kv_len, 128))
    q_pad, kv_pad = _round_up(q_len, bq) - q_len, _round_up(kv_len, bkv) - kv_len
    q = jnp.swapaxes(q_bsnh * (1.0 / math.sqrt(head_dim)), 1, 2).astype(q_bsnh.dtype)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, q_pad), (0, 0)))
    k = jnp.pad(jnp.swapaxes(k_bknh, 1, 2), ((0, 0), (0, 0), (0, kv_pad), (0, 0)))
    v = jnp.pad(jnp.swapaxes(v_bknh, 1, 2), ((0, 0), (0, 0), (0, kv_pad), (0, 0)))
    return q, k, v, bq, bkv


def splash_segment_attention(
    q_bsnh: jax.Array,
    k_bknh: jax.Array,
    v_bknh: jax.Array,
    segments: Segments,
    *,
    block_q: int = 512,
    block_kv: int = 512,
    interpret: bool | None = None,
) -> jax.Array:
    """Block-diagonal attention through the Pallas TPU splash kernel, skipping blocks across segments (module
    docstring). ``interpret`` None: Mosaic on TPU, the Pallas interpreter elsewhere."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, q_len = q_bsnh.shape[:2]
    q, k, v, bq, bkv = splash_layout(q_bsnh, k_bknh, v_bknh, block_q, block_kv)
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    # Padded queries join the row's last segment (their outputs are sliced off); padded keys match nothing.
    q_ids = jnp.pad(segments.q.astype(jnp.int32), ((0, 0), (0, q.shape[2] - q_len)), mode="edge")
    kv_ids = jnp.pad(segments.kv.astype(jnp.int32), ((0, 0), (0, k.shape[2] - k_bknh.shape[1])), constant_values=_NEVER)
    sizes = splash_block_sizes(bq, bkv)
    outs = []
    # One kernel call per row, each with its own block tables (rows per device are few: packing fills one).
    for i in range(b):
        fwd, dkv = segment_mask_infos(q_ids[i], kv_ids[i], bq, bkv, segments.max_tokens)
        kernel = sk.SplashAttentionKernel(
            fwd,
            fwd,
            dkv,
            block_sizes=sizes,
            is_mqa=False,
            save_residuals=False,
            mask_value=sk.DEFAULT_MASK_VALUE,
            attn_logits_soft_cap=None,
            residual_checkpoint_name=None,
            mask_function=None,
            interpret=interpret,
        )
        outs.append(kernel(q[i], k[i], v[i], segment_ids=sk.SegmentIds(q=q_ids[i], kv=kv_ids[i])))
    out = jnp.stack(outs)
    return jnp.swapaxes(out[:, :, :q_len], 1, 2).astype(q_bsnh.dtype)
