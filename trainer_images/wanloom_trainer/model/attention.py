"""Attention of the Wan transformer: the module (diffusers ``WanAttention``) and the swappable attention core.

The core is any ``AttentionFn``: ``(q_bsnh, k_bknh, v_bknh, segments=None) -> out_bsnh`` with softmax scale
1/sqrt(head_dim). Without ``segments`` there is no mask (Wan attends to every video token and every text token,
padding included); with ``segments`` (packed rows, ``segment_attention.Segments``) attention is block-diagonal.
Two are built in:

- ``xla_attention``: ``jax.nn.dot_product_attention`` (logits and softmax in fp32); runs anywhere.
- ``splash_attention``: the Pallas TPU splash kernel (packed rows: ``segment_attention.splash_segment_attention``).
  It is a single-device kernel: under a mesh, wrap it in ``shard_map`` over the batch/head axes (or a ring for
  context parallelism) and pass the wrapper to ``WanTransformer3DModel.set_attention_fn``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from wanloom_trainer.model.rope import apply_rope
from wanloom_trainer.model.segment_attention import (
    Segments,
    splash_block_sizes,
    splash_layout,
    splash_segment_attention,
    xla_segment_attention,
)

AttentionFn = Callable[..., jax.Array]  # (q_bsnh, k_bknh, v_bknh, segments: Segments | None = None) -> out_bsnh
FP32 = jnp.float32
# Remat policies refer to these names (wan_jax.REMAT_POLICIES).
SELF_ATTN_TAG = "attn_output"
CROSS_ATTN_TAG = "cross_attn_output"


def xla_attention(
    q_bsnh: jax.Array, k_bknh: jax.Array, v_bknh: jax.Array, segments: Segments | None = None
) -> jax.Array:
    """Softmax attention [B, S, N, H] × [B, K, N, H] → [B, S, N, H] through XLA; block-diagonal with ``segments``."""
    if segments is not None:
        return xla_segment_attention(q_bsnh, k_bknh, v_bknh, segments)
    return jax.nn.dot_product_attention(q_bsnh, k_bknh, v_bknh, implementation="xla")


@functools.lru_cache(maxsize=32)
def _splash_kernel(heads: int, q_len: int, kv_len: int, block_q: int, block_kv: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    # Built once per shape and reused across traces, so its mask arrays must be concrete, not tracers.
    mask = sm.MultiHeadMask([sm.FullMask((q_len, kv_len)) for _ in range(heads)])
    sizes = splash_block_sizes(block_q, block_kv)
    with jax.ensure_compile_time_eval():
        return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_attention(
    q_bsnh: jax.Array,
    k_bknh: jax.Array,
    v_bknh: jax.Array,
    segments: Segments | None = None,
    *,
    block_q: int = 512,
    block_kv: int = 512,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention through the Pallas TPU splash kernel: unmasked, or block-diagonal with ``segments``.

    ``interpret`` None runs the kernel natively on TPU and in the Pallas interpreter elsewhere (slow; for tests).

    Sequences are padded up to the block sizes; padded keys get their own segment id so real queries never
    see them, and padded queries (sliced off afterwards) attend to the real keys so no row is fully masked
    (a fully masked row would put NaNs into the backward pass).
    """
    if segments is not None:
        return splash_segment_attention(
            q_bsnh, k_bknh, v_bknh, segments, block_q=block_q, block_kv=block_kv, interpret=interpret
        )
    q_len, heads = q_bsnh.shape[1:3]
    kv_len = k_bknh.shape[1]
    q, k, v, bq, bkv = splash_layout(q_bsnh, k_bknh, v_bknh, block_q, block_kv)
    q_pad, kv_pad = q.shape[2], k.shape[2]
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    kernel = _splash_kernel(heads, q_pad, kv_pad, bq, bkv, interpret)

    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    segments = SegmentIds(q=jnp.zeros((q_pad,), jnp.int32), kv=(jnp.arange(kv_pad) >= kv_len).astype(jnp.int32))
    out = jax.vmap(lambda q1, k1, v1: kernel(q1, k1, v1, segment_ids=segments))(q, k, v)
    return jnp.swapaxes(out[:, :, :q_len], 1, 2).astype(q_bsnh.dtype)


ATTENTION_IMPLS: dict[str, AttentionFn] = {"xla": xla_attention, "splash": splash_attention}


def get_attention_fn(impl: str) -> AttentionFn:
    try:
        return ATTENTION_IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown attention_impl {impl!r}; valid: {', '.join(ATTENTION_IMPLS)}") from None


class WanAttention(nnx.Module):
    """Multi-head attention with q/k RMSNorm across all heads (``rms_norm_across_heads``) and optional RoPE.

    Self-attention when called without ``context``; cross-attention to ``context`` otherwise. Parameter names
    follow the checkpoint: ``to_q``, ``to_k``, ``to_v``, ``to_out.0``, ``norm_q``, ``norm_k``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        eps: float,
        *,
        attention_fn: AttentionFn,
        checkpoint_tag: str,
        param_dtype: jnp.dtype,
        compute_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ) -> None:
        linear = functools.partial(nnx.Linear, dtype=compute_dtype, param_dtype=param_dtype, rngs=rngs)
        self.num_heads = num_heads
        self.attention_fn = attention_fn
        self.checkpoint_tag = checkpoint_tag
        self.to_q = linear(dim, dim)
        self.to_k = linear(dim, dim)
        self.to_v = linear(dim, dim)
        self.to_out = nnx.List([linear(dim, dim)])
        # Norm weights stay fp32; the norm itself runs in fp32 (see _rms_norm).
        self.norm_q = nnx.RMSNorm(dim, epsilon=eps, dtype=FP32, param_dtype=FP32, rngs=rngs)
        self.norm_k = nnx.RMSNorm(dim, epsilon=eps, dtype=FP32, param_dtype=FP32, rngs=rngs)

    def _heads(self, x_bsd: jax.Array) -> jax.Array:
        return x_bsd.reshape(*x_bsd.shape[:2], self.num_heads, -1)

    def __call__(
        self,
        x_bsd: jax.Array,
        context_bkd: jax.Array | None = None,
        rope: tuple[jax.Array, jax.Array] | None = None,
        segments: Segments | None = None,
    ) -> jax.Array:
        """Attend from ``x_bsd`` [B, S, D] to itself or to ``context_bkd`` [B, K, D]; returns [B, S, D].

        ``rope``: (cos, sin) tables [S, head_dim // 2] (or per row [B, S, head_dim // 2]) applied to queries and
        keys (self-attention only). ``segments``: packed rows, attention stays within each segment.
        """
        source = x_bsd if context_bkd is None else context_bkd
        q = _rms_norm(self.norm_q, self.to_q(x_bsd))
        k = _rms_norm(self.norm_k, self.to_k(source))
        q, k, v = self._heads(q), self._heads(k), self._heads(self.to_v(source))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = self.attention_fn(q, k, v) if segments is None else self.attention_fn(q, k, v, segments)
        out = checkpoint_name(out, self.checkpoint_tag)
        return self.to_out[0](out.reshape(*x_bsd.shape[:2], -1))


def _rms_norm(norm: nnx.RMSNorm, x: jax.Array) -> jax.Array:
    return norm(x.astype(FP32)).astype(x.dtype)
