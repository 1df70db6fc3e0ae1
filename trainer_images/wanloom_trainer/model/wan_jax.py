"""The Wan 2.x video transformer in Flax NNX, numerically faithful to diffusers' ``WanTransformer3DModel``.

Class and attribute names follow diffusers (``transformer_wan.py``), so checkpoint keys map nearly one to one
(see ``model/load.py``). Read bottom-up: modulated LayerNorm, feed-forward, block, model, init helpers.

Precision policy: timesteps, the time/text embedders, the patch embedding, all norms and the modulation tables
(``scale_shift_table``) keep float32 parameters and compute in float32 whatever ``param_dtype`` is; the
modulation (shift/scale/gate) and the gated residual adds run in float32. Attention and FFN projections use
``param_dtype`` weights and compute in ``compute_dtype``; the residual stream is stored in ``compute_dtype``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from wanloom_api.trainingjob import LoraSpec
from wanloom_trainer.config.variants import WanVariant
from wanloom_trainer.kernels import ADALN_IMPLS
from wanloom_trainer.model.attention import (
    CROSS_ATTN_TAG,
    SELF_ATTN_TAG,
    AttentionFn,
    WanAttention,
    get_attention_fn,
)
from wanloom_trainer.model.embeddings import WanTimeTextEmbedding
from wanloom_trainer.model.params import ShardingRule, ShardingSpec, param_name, sharding_for
from wanloom_trainer.model.rope import rope_cos_sin, rope_cos_sin_at
from wanloom_trainer.model.segment_attention import Segments

FP32 = jnp.float32
# The jax.checkpoint policy of each spec.parallelism.remat name, for nnx.remat around each block. "save-attention"
# keeps the attention-core outputs (tagged in attention.py), the costliest activations to recompute at long
# sequence lengths; "save-matmuls" keeps every matmul output without a batch dimension.
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save-matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save-attention": jax.checkpoint_policies.save_only_these_names(SELF_ATTN_TAG, CROSS_ATTN_TAG),
}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Packing:
    """How a packed micro-batch is laid out (docs/architecture.md, "Packed sequences").

    Attributes:
        segment_ids: int32 [B, N] segment of each token; None when modulation is per token (TI2V), which needs no
            segment lookup in the AdaLN kernels.
        self_attention: ids for block-diagonal self-attention.
        cross_attention: ids pairing each token with its own segment's text tokens.
    """

    segment_ids: jax.Array | None
    self_attention: Segments
    cross_attention: Segments


def _per_token(rows_bsd: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Per-segment rows [B, S, D] → per token [B, N, D] (unchanged without segment ids)."""
    if segment_ids is None:
        return rows_bsd
    return jnp.take_along_axis(rows_bsd, segment_ids[..., None].astype(jnp.int32), axis=1)


def _modulated_layer_norm(
    x: jax.Array,
    scale: jax.Array,
    shift: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    eps: float,
    impl: str,
) -> jax.Array:
    """``LayerNorm(x) · (1 + scale) + shift`` with no affine LayerNorm parameters (AdaLN).

    Args:
        x: [B, S, D] residual stream (any float dtype).
        scale, shift: float32 [B, 1, D] (one timestep per sample), [B, S, D] (per-token timesteps), or per segment
            [B, K, D] with ``segment_ids`` [B, S] (packed rows).
        impl: "reference" (``kernels.adaln_ref_jax``: plain jnp, float32 inside) or "fused" (the Pallas kernel).

    Returns:
        [B, S, D] in the dtype of ``x``.
    """
    from wanloom_trainer.kernels import adaln_jax  # lazy: the fused kernel pulls in Pallas

    return adaln_jax(x, scale, shift, eps=eps, impl=impl, segment_ids=segment_ids)


class _Identity(nnx.Module):
    """Stands in for the checkpoint's parameter-free ``ffn.net.1`` (dropout) so indices match diffusers."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x


class GELUProjection(nnx.Module):
    """``proj`` followed by tanh-approximated GELU (diffusers ``GELU(approximate="tanh")``)."""

    def __init__(self, dim: int, ffn_dim: int, *, linear: Callable[..., nnx.Linear]) -> None:
        self.proj = linear(dim, ffn_dim)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(self.proj(x), approximate=True)


class FeedForward(nnx.Module):
    """Two-matrix GELU-tanh MLP ``net.0.proj`` → GELU → ``net.2`` (not SwiGLU)."""

    def __init__(self, dim: int, ffn_dim: int, *, linear: Callable[..., nnx.Linear]) -> None:
        self.net = nnx.List([GELUProjection(dim, ffn_dim, linear=linear), _Identity(), linear(ffn_dim, dim)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.net:
            x = layer(x)
        return x


class WanTransformerBlock(nnx.Module):
    """One Wan block: modulated self-attention, cross-attention to text, modulated FFN."""

    def __init__(
        self,
        variant: WanVariant,
        *,
        param_dtype: jnp.dtype,
        compute_dtype: jnp.dtype,
        adaln_impl: str,
        attention_fn: AttentionFn,
        rngs: nnx.Rngs,
    ) -> None:
        dim, eps = variant.dim, variant.eps
        attn = functools.partial(
            WanAttention,
            dim,
            variant.num_heads,
            eps,
            attention_fn=attention_fn,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            rngs=rngs,
        )
        linear = functools.partial(nnx.Linear, dtype=compute_dtype, param_dtype=param_dtype, rngs=rngs)
        self.eps, self.adaln_impl, self.compute_dtype = eps, adaln_impl, compute_dtype
        self.adaln_fn: Callable[..., jax.Array] | None = None  # a mesh-aware fused kernel (set_adaln_fn)
        # 1. Self-attention (norm1 has no parameters: it is the modulated LayerNorm)
        self.attn1 = attn(checkpoint_tag=SELF_ATTN_TAG)
        # 2. Cross-attention
        self.attn2 = attn(checkpoint_tag=CROSS_ATTN_TAG)
        self.norm2 = nnx.LayerNorm(dim, epsilon=eps, use_fast_variance=False, dtype=FP32, param_dtype=FP32, rngs=rngs)
        # 3. Feed-forward (norm3 has no parameters either)
        self.ffn = FeedForward(dim, variant.ffn_dim, linear=linear)
        self.scale_shift_table = nnx.Param(jax.random.normal(rngs.params(), (1, 6, dim), FP32) / math.sqrt(dim))

    def __call__(
        self,
        x_bsd: jax.Array,
        context_bkd: jax.Array,
        timestep_proj: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        packing: Packing | None = None,
    ) -> jax.Array:
        """Args: x_bsd [B, S, D]; context_bkd [B, K, D]; timestep_proj f32 [B, 1|S, 6, D] (packed rows: per
        segment [B, G, 6, D] with ``packing.segment_ids``); rope (cos, sin); packing: packed rows or None.

        Returns [B, S, D] in the residual dtype.
        """
        mod = self.scale_shift_table[...] + timestep_proj
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (mod[:, :, i] for i in range(6))
        modulate = self.adaln_fn or functools.partial(_modulated_layer_norm, eps=self.eps, impl=self.adaln_impl)
        ids = None if packing is None else packing.segment_ids

        def norm(x: jax.Array, scale: jax.Array, shift: jax.Array) -> jax.Array:
            return modulate(x, scale, shift) if ids is None else modulate(x, scale, shift, ids)

        dtype = x_bsd.dtype

        # 1. Self-attention
        self_segments = None if packing is None else packing.self_attention
        attn_output = self.attn1(norm(x_bsd, scale_msa, shift_msa), rope=rope, segments=self_segments)
        x_bsd = (x_bsd.astype(FP32) + attn_output.astype(FP32) * _per_token(gate_msa, ids)).astype(dtype)

        # 2. Cross-attention
        normed = self.norm2(x_bsd.astype(FP32)).astype(dtype)
        cross_segments = None if packing is None else packing.cross_attention
        x_bsd = x_bsd + self.attn2(normed, context_bkd, segments=cross_segments).astype(dtype)

        # 3. Feed-forward
        ff_output = self.ffn(norm(x_bsd, c_scale_msa, c_shift_msa))
        return (x_bsd.astype(FP32) + ff_output.astype(FP32) * _per_token(c_gate_msa, ids)).astype(dtype)


def _check_choice(field: str, value: str, valid: tuple[str, ...] | dict) -> None:
    if value not in valid:
        raise ValueError(f"{field}={value!r} is not valid; valid: {', '.join(valid)}")


class WanTransformer3DModel(nnx.Module):
    """Wan transformer for one expert (A14B) or the dense TI2V-5B model, built from a ``WanVariant``.

    Args:
        variant: architecture (``wanloom_trainer.config.variants.get_variant``).
        rngs: random streams for initialisation.
        param_dtype: dtype of the attention/FFN/output projection weights (fp32-policy weights ignore it).
        compute_dtype: dtype of the residual stream and of the projections' matmuls.
        adaln_impl: "reference" (jnp) or "fused" (``wanloom_trainer.kernels.adaln_jax``) for norm1/norm3/norm_out.
        attention_impl: "xla" or "splash" core for self- and cross-attention (see ``set_attention_fn``).
        remat: a key of ``REMAT_POLICIES``; each block runs under ``jax.checkpoint`` with that policy.
    """

    def __init__(
        self,
        variant: WanVariant,
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype = FP32,
        compute_dtype: jnp.dtype = FP32,
        adaln_impl: str = "reference",
        attention_impl: str = "xla",
        remat: str = "none",
    ) -> None:
        _check_choice("adaln_impl", adaln_impl, ADALN_IMPLS)
        _check_choice("remat", remat, REMAT_POLICIES)
        attention_fn = get_attention_fn(attention_impl)
        dim, patch = variant.dim, variant.patch_size
        self.variant, self.compute_dtype, self.adaln_impl, self.remat = variant, compute_dtype, adaln_impl, remat

        # 1. Patch & position embedding (RoPE tables are computed per input shape in __call__)
        self.patch_embedding = nnx.Conv(
            variant.in_channels, dim, patch, patch, padding="VALID", dtype=FP32, param_dtype=FP32, rngs=rngs
        )
        # 2. Condition embeddings
        self.condition_embedder = WanTimeTextEmbedding(dim, variant.freq_dim, variant.text_dim, rngs=rngs)
        # 3. Transformer blocks
        self.blocks = nnx.List(
            [
                WanTransformerBlock(
                    variant,
                    param_dtype=param_dtype,
                    compute_dtype=compute_dtype,
                    adaln_impl=adaln_impl,
                    attention_fn=attention_fn,
                    rngs=rngs,
                )
                for _ in range(variant.num_layers)
            ]
        )
        # 4. Output norm & projection (norm_out is the parameter-free modulated LayerNorm)
        out_features = variant.out_channels * math.prod(patch)
        self.proj_out = nnx.Linear(dim, out_features, dtype=compute_dtype, param_dtype=param_dtype, rngs=rngs)
        self.scale_shift_table = nnx.Param(jax.random.normal(rngs.params(), (1, 2, dim), FP32) / math.sqrt(dim))
        self.adaln_fn: Callable[..., jax.Array] | None = None  # a mesh-aware fused kernel (set_adaln_fn)
        self.block_sharding: ShardingRule | None = None  # placement of one block's parameters (set_block_sharding)

    def set_attention_fn(
        self, self_attention: AttentionFn | None = None, cross_attention: AttentionFn | None = None
    ) -> None:
        """Replace the attention core of every block (e.g. a shard_map'd splash kernel or ring attention)."""
        for block in self.blocks:
            if self_attention is not None:
                block.attn1.attention_fn = self_attention
            if cross_attention is not None:
                block.attn2.attention_fn = cross_attention

    def set_adaln_fn(self, adaln: Callable[..., jax.Array]) -> None:
        """Route every modulated LayerNorm (norm1, norm3, norm_out) through ``adaln(x, scale, shift)``, e.g. the
        fused kernel inside ``shard_map`` (``parallel.sharded_adaln``)."""
        self.adaln_fn = adaln
        for block in self.blocks:
            block.adaln_fn = adaln

    def set_block_sharding(self, rule: ShardingRule) -> None:
        """Place the blocks' parameters, stacked for the scan, as ``rule(name, abstract)`` places one block's
        (``name`` relative to the block, e.g. ``attn1.to_q.kernel``); the layer axis stays whole.

        Without it the stacked weights' layout is whatever XLA's sharding propagation picks through the loop; on
        the A14B programs measured (docs/benchmarks.md) it picked this same layout, so the constraint states the
        intent rather than changing those programs.
        """
        self.block_sharding = rule

    def _grid(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        if len(shape) != 5 or shape[1] != self.variant.in_channels:
            raise ValueError(
                f"hidden_states must be [B, {self.variant.in_channels}, T, H, W] for {self.variant.name}, got {shape}"
            )
        if any(n % p for n, p in zip(shape[2:], self.variant.patch_size, strict=True)):
            raise ValueError(f"latent (T, H, W)={shape[2:]} must be divisible by patch_size {self.variant.patch_size}")
        return tuple(n // p for n, p in zip(shape[2:], self.variant.patch_size, strict=True))

    def _run_blocks(self, x_bsd: jax.Array, *args: object) -> jax.Array:
        """Run the blocks as one ``lax.scan`` over their parameters stacked on a leading layer axis, each block
        under the remat policy.

        A scan compiles one block and reuses its buffers layer after layer. Unrolled, XLA scheduled the layers'
        collectives across the whole program and kept many layers' context-parallel K/V gathers alive at once: on
        the example A14B job the peak grew by gigabytes per layer even with full remat (docs/benchmarks.md).
        Stacking happens inside the step, so checkpoints and the optimizer keep diffusers' per-block layout; the
        cost is one copy of this device's shard of the block weights (and gradients).
        """
        graphdef = nnx.graphdef(self.blocks[0])
        for i, b in enumerate(self.blocks):
            if nnx.graphdef(b) != graphdef:
                raise ValueError(
                    f"block {i} differs from block 0 (attention or AdaLN function): the scan runs one "
                    "block structure for every layer; set them through set_attention_fn/set_adaln_fn"
                )
        stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *(nnx.state(b) for b in self.blocks))
        if self.block_sharding is not None:
            stacked = jax.tree_util.tree_map_with_path(self._keep_layer_sharding, stacked)

        def block(x: jax.Array, state: nnx.State, *block_args: object) -> jax.Array:
            return nnx.merge(graphdef, state)(x, *block_args)

        if self.remat != "none":
            block = jax.checkpoint(block, policy=REMAT_POLICIES[self.remat])

        def body(x: jax.Array, state: nnx.State) -> tuple[jax.Array, None]:
            return block(x, state, *args), None

        return jax.lax.scan(body, x_bsd, stacked)[0]

    def _keep_layer_sharding(self, path: tuple[Any, ...], stacked: jax.Array) -> jax.Array:
        name = ".".join(str(part.key) for part in path if isinstance(part, jax.tree_util.DictKey))
        sharding = self.block_sharding(name, jax.ShapeDtypeStruct(stacked.shape[1:], stacked.dtype))
        if sharding is None:
            return stacked
        layer_axis = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
        return jax.lax.with_sharding_constraint(stacked, layer_axis)

    def __call__(
        self, hidden_states_bcthw: jax.Array, timestep: jax.Array, encoder_hidden_states_bld: jax.Array
    ) -> jax.Array:
        """Predict the flow-matching velocity.

        Args:
            hidden_states_bcthw: [B, in_channels, T', H', W'] latents (I2V: noise ‖ mask ‖ condition).
            timestep: float [B], or [B, S] per-token timesteps (S = T'·H'·W' / patch volume; Wan 2.2 TI2V).
            encoder_hidden_states_bld: [B, L, text_dim] text-encoder states (unmasked, zero-padded).

        Returns:
            [B, out_channels, T', H', W'] in ``compute_dtype``.
        """
        batch = hidden_states_bcthw.shape[0]
        grid = self._grid(hidden_states_bcthw.shape)
        seq = math.prod(grid)
        timestep = _check_timestep(jnp.asarray(timestep), batch, seq)
        if encoder_hidden_states_bld.ndim != 3 or encoder_hidden_states_bld.shape[-1] != self.variant.text_dim:
            raise ValueError(
                f"encoder_hidden_states must be [B, L, {self.variant.text_dim}], got {encoder_hidden_states_bld.shape}"
            )

        # 1. Patch & position embedding
        rope = rope_cos_sin(grid, self.variant.head_dim, self.variant.rope_max_seq_len)
        x = self.patch_embedding(jnp.moveaxis(hidden_states_bcthw.astype(FP32), 1, -1))
        x_bsd = x.reshape(batch, seq, -1).astype(self.compute_dtype)

        # 2. Condition embeddings: temb f32 [B, D] | [B, S, D]; timestep_proj f32 [B, 1|S, 6, D]
        temb, timestep_proj, context = self.condition_embedder(timestep, encoder_hidden_states_bld)
        context_bkd = context.astype(self.compute_dtype)

        # 3. Transformer blocks
        x_bsd = self._run_blocks(x_bsd, context_bkd, timestep_proj, rope)

        # 4. Output norm & projection
        out = self._output(x_bsd, temb)

        # 5. Unpatchify: [B, S, pt·ph·pw·C] → [B, C, T'·pt... ] with (pt, ph, pw, C) as diffusers lays them out
        pt, ph, pw = self.variant.patch_size
        out = out.reshape(batch, *grid, pt, ph, pw, -1)
        out = jnp.transpose(out, (0, 7, 1, 4, 2, 5, 3, 6))
        return out.reshape(batch, -1, grid[0] * pt, grid[1] * ph, grid[2] * pw)

    def _output(self, x_bsd: jax.Array, temb: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """The output modulated norm (per sample, token or segment, like ``temb``) and projection."""
        temb = temb[:, None] if temb.ndim == 2 else temb
        table = self.scale_shift_table[...]
        shift, scale = table[:, 0] + temb, table[:, 1] + temb
        extra = () if segment_ids is None else (segment_ids,)
        if self.adaln_fn is not None:
            x_bsd = self.adaln_fn(x_bsd, scale, shift, *extra)
        else:
            x_bsd = _modulated_layer_norm(x_bsd, scale, shift, *extra, eps=self.variant.eps, impl=self.adaln_impl)
        return self.proj_out(x_bsd)

    def forward_packed(
        self,
        patches_bnqc: jax.Array,
        positions_bn3: jax.Array,
        segment_ids_bn: jax.Array,
        timestep: jax.Array,
        encoder_hidden_states_bgld: jax.Array,
        *,
        per_token: bool = False,
        max_segment_tokens: int = 0,
    ) -> jax.Array:
        """Predict the velocity of packed rows: several samples of any shapes per row (docs/architecture.md,
        "Packed sequences"), each attending only to itself and to its own text.

        Args:
            patches_bnqc: [B, N, Q, C_in] each token's latent patch, Q = pt·ph·pw positions in (pt, ph, pw) order
                (``backends.packing.patchify``); the patch embedding is the convolution's kernel as one matmul.
            positions_bn3: int32 [B, N, 3] the token's (t, h, w) in its own segment's grid (3-D RoPE).
            segment_ids_bn: int32 [B, N] non-decreasing; G segments per row, padding one of them.
            timestep: float [B, G] one per segment, or with ``per_token`` [B, N] (TI2V's clean first frames).
            encoder_hidden_states_bgld: [B, G, L, text_dim] each segment's text-encoder states.
            per_token: timesteps (and so the modulation) are per token rather than per segment.
            max_segment_tokens: static bound on a segment's tokens (shrinks the splash grid; 0: none).

        Returns:
            [B, N, Q, C_out] in ``compute_dtype``: the velocity of each token's patch.
        """
        b, n, q, c = patches_bnqc.shape
        groups, text_len = encoder_hidden_states_bgld.shape[1:3]
        if c != self.variant.in_channels or q != math.prod(self.variant.patch_size):
            raise ValueError(
                f"patches must be [B, N, {math.prod(self.variant.patch_size)}, {self.variant.in_channels}] for "
                f"{self.variant.name}, got {list(patches_bnqc.shape)}"
            )
        expected = (b, n) if per_token else (b, groups)
        if timestep.shape != expected:
            raise ValueError(f"timestep must be {list(expected)} ({'per token' if per_token else 'per segment'}), "
                             f"got {list(timestep.shape)}")  # fmt: skip
        text_ids = jnp.broadcast_to(jnp.repeat(jnp.arange(groups, dtype=jnp.int32), text_len), (b, groups * text_len))
        packing = Packing(
            segment_ids=None if per_token else segment_ids_bn,
            self_attention=Segments(segment_ids_bn, segment_ids_bn, max_segment_tokens),
            cross_attention=Segments(segment_ids_bn, text_ids, max_segment_tokens),
        )

        # 1. Patch & position embedding
        kernel = self.patch_embedding.kernel[...].reshape(q * c, -1)
        x = patches_bnqc.astype(FP32).reshape(b, n, q * c) @ kernel + self.patch_embedding.bias[...]
        x_bsd = x.astype(self.compute_dtype)
        rope = rope_cos_sin_at(positions_bn3, self.variant.head_dim, self.variant.rope_max_seq_len)

        # 2. Condition embeddings, per segment (or per token); each segment's text side by side
        text = encoder_hidden_states_bgld.reshape(b, groups * text_len, -1)
        temb, timestep_proj, context = self.condition_embedder(timestep.astype(FP32), text)
        context_bkd = context.astype(self.compute_dtype)

        # 3. Transformer blocks
        x_bsd = self._run_blocks(x_bsd, context_bkd, timestep_proj, rope, packing)

        # 4. Output norm & projection, per token patch
        return self._output(x_bsd, temb, packing.segment_ids).reshape(b, n, q, -1)


def _check_timestep(timestep: jax.Array, batch: int, seq: int) -> jax.Array:
    if timestep.shape not in ((batch,), (batch, seq)):
        raise ValueError(
            f"timestep must be [B]={[batch]} or per-token [B, S]={[batch, seq]}, got {list(timestep.shape)}"
        )
    return timestep.astype(FP32)


def abstract_model(
    variant: WanVariant, *, lora: LoraSpec | None = None, **model_kwargs: object
) -> WanTransformer3DModel:
    """The model with ``jax.ShapeDtypeStruct`` values: shapes and dtypes only, no memory (any size, even A14B).

    ``lora``: with LoRA adapters (``model.lora_jax``). ``model_kwargs`` are the constructor's keyword arguments other
    than ``rngs``.
    """
    return nnx.eval_shape(lambda: _with_lora(WanTransformer3DModel(variant, rngs=nnx.Rngs(0), **model_kwargs), lora, 0))


def _with_lora(model: WanTransformer3DModel, lora: LoraSpec | None, seed: int) -> WanTransformer3DModel:
    if lora is None:
        return model
    from wanloom_trainer.model.lora_jax import add_lora

    return add_lora(model, lora, seed=seed)


def state_shardings(abstract: nnx.Module, shardings: ShardingSpec) -> nnx.State:
    """The abstract model's state with each parameter replaced by its resolved ``Sharding`` (or None)."""
    state = nnx.state(abstract)
    flat = [
        (path, sharding_for(shardings, param_name(path), var.get_value())) for path, var in nnx.to_flat_state(state)
    ]
    return nnx.from_flat_state(flat)


def init_model(
    variant: WanVariant,
    *,
    seed: int = 0,
    shardings: ShardingSpec = None,
    lora: LoraSpec | None = None,
    lora_seed: int = 0,
    **model_kwargs: object,
) -> WanTransformer3DModel:
    """Randomly initialised model whose parameters are created already sharded (``init`` runs under ``jit`` with
    ``out_shardings``), so no device or host ever holds the whole model when ``shardings`` shards it.

    Args:
        variant: architecture.
        seed: initialisation seed.
        shardings: ``ShardingSpec`` (rule ``(name, abstract) -> Sharding | None`` or mapping name → Sharding);
            None places everything on the default device.
        lora, lora_seed: LoRA adapters (``model.lora_jax``) and the seed of their initial values.
        model_kwargs: the constructor's other keyword arguments (param_dtype, compute_dtype, remat, ...).
    """
    graphdef, abstract_state = nnx.split(abstract_model(variant, lora=lora, **model_kwargs))
    out_shardings = None if shardings is None else state_shardings(nnx.merge(graphdef, abstract_state), shardings)

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def _init() -> nnx.State:
        model = WanTransformer3DModel(variant, rngs=nnx.Rngs(seed), **model_kwargs)
        return nnx.state(_with_lora(model, lora, lora_seed))

    return nnx.merge(graphdef, _init())


def with_lora(
    model: WanTransformer3DModel, lora: LoraSpec, *, seed: int, shardings: ShardingSpec = None
) -> WanTransformer3DModel:
    """A loaded model with LoRA adapters added (their initial values from ``seed``), every parameter placed by
    ``shardings``: the base's arrays pass through the jit unchanged."""
    graphdef, state = nnx.split(model)
    target_graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _with_lora(nnx.merge(graphdef, state), lora, seed)))
    out_shardings = None if shardings is None else state_shardings(nnx.merge(target_graphdef, abstract), shardings)

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def _add(state: nnx.State) -> nnx.State:
        return nnx.state(_with_lora(nnx.merge(graphdef, state), lora, seed))

    return nnx.merge(target_graphdef, _add(state))
