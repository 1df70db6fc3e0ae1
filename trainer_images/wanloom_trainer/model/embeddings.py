"""Timestep and text conditioning of the Wan transformer (diffusers ``WanTimeTextImageEmbedding``).

Everything here keeps float32 parameters and computes in float32: timesteps are flow-matching σ·1000, and the
modulation tables derived from them must not be rounded to bf16 (see docs on timestep precision in wan-model.md).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

FP32 = jnp.float32
# The time path runs at full fp32 precision on TPU too (whose default fp32 matmul rounds inputs to bf16): the
# modulation tables it feeds scale every residual branch.
HIGHEST = jax.lax.Precision.HIGHEST


def timestep_sinusoid(timesteps: jnp.ndarray, dim: int, max_period: float = 10000.0) -> jnp.ndarray:
    """Sinusoidal timestep features in ``[cos | sin]`` order (diffusers ``flip_sin_to_cos=True``, shift 0).

    Args:
        timesteps: float [...] of (possibly fractional) timesteps in [0, 1000].
        dim: number of features (``freq_dim``).

    Returns:
        float32 [..., dim].
    """
    half = dim // 2
    exponent = (-math.log(max_period) * jnp.arange(half, dtype=FP32)) / half
    angles = timesteps.astype(FP32)[..., None] * jnp.exp(exponent)
    features = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)
    if dim % 2:
        features = jnp.pad(features, [(0, 0)] * (features.ndim - 1) + [(0, 1)])
    return features


class TimestepEmbedding(nnx.Module):
    """Two-layer SiLU MLP: ``linear_1`` → SiLU → ``linear_2`` (diffusers naming)."""

    def __init__(self, in_features: int, dim: int, *, rngs: nnx.Rngs) -> None:
        kw = {"dtype": FP32, "param_dtype": FP32, "precision": HIGHEST, "rngs": rngs}
        self.linear_1 = nnx.Linear(in_features, dim, **kw)
        self.linear_2 = nnx.Linear(dim, dim, **kw)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return self.linear_2(jax.nn.silu(self.linear_1(x)))


class TextProjection(nnx.Module):
    """Two-layer GELU-tanh MLP from the text encoder width to the model width (diffusers
    ``PixArtAlphaTextProjection``: ``linear_1`` → GELU(tanh) → ``linear_2``)."""

    def __init__(self, in_features: int, dim: int, *, rngs: nnx.Rngs) -> None:
        self.linear_1 = nnx.Linear(in_features, dim, dtype=FP32, param_dtype=FP32, rngs=rngs)
        self.linear_2 = nnx.Linear(dim, dim, dtype=FP32, param_dtype=FP32, rngs=rngs)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return self.linear_2(jax.nn.gelu(self.linear_1(x), approximate=True))


class WanTimeTextEmbedding(nnx.Module):
    """Timestep → (temb, per-block modulation input); text context → model width.

    Attribute names match the checkpoint's ``condition_embedder.*`` keys.
    """

    def __init__(self, dim: int, freq_dim: int, text_dim: int, *, rngs: nnx.Rngs) -> None:
        self.freq_dim = freq_dim
        self.time_embedder = TimestepEmbedding(freq_dim, dim, rngs=rngs)
        self.time_proj = nnx.Linear(dim, 6 * dim, dtype=FP32, param_dtype=FP32, precision=HIGHEST, rngs=rngs)
        self.text_embedder = TextProjection(text_dim, dim, rngs=rngs)

    def __call__(self, timestep: jnp.ndarray, context_bld: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
        """Embed timesteps and text.

        Args:
            timestep: float [B] (one timestep per sample) or [B, S] (per-token timesteps, Wan 2.2 TI2V).
            context_bld: [B, L, text_dim] text-encoder states.

        Returns:
            temb: float32 [B, D] or [B, S, D], input of the output modulation.
            timestep_proj: float32 [B, 1, 6, D] or [B, S, 6, D], added to every block's ``scale_shift_table``.
            context: float32 [B, L, D] projected text.
        """
        temb = self.time_embedder(timestep_sinusoid(timestep, self.freq_dim))
        timestep_proj = self.time_proj(jax.nn.silu(temb))
        timestep_proj = timestep_proj.reshape(*timestep_proj.shape[:-1], 6, -1)
        if timestep.ndim == 1:
            # One modulation per sample: a singleton token axis lets blocks broadcast it over the sequence.
            timestep_proj = timestep_proj[:, None]
        context = self.text_embedder(context_bld.astype(FP32))
        return temb, timestep_proj, context
