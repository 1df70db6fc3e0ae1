"""Low-rank adapters (LoRA) on the JAX model, the same adapters as ``model.lora_torch``.

``add_lora(model, lora, seed=...)`` turns each targeted ``nnx.Linear`` of every block (``spec.lora.targets``, by
diffusers name) into a ``LoRALinear`` in place: the same module (its ``kernel`` and ``bias`` keep their names, so the
base loads and shards as before) with two ``nnx.LoRAParam`` float32 matrices, ``lora_a`` [in, r] (uniform in
±1/√in, PEFT's Kaiming-uniform bound) and ``lora_b`` [r, out] (zeros). Forward:

    y = Linear(x) + (alpha / r) · (x·lora_a)·lora_b        (in the Linear's compute dtype)

The trainer splits the model with ``nnx.split(model, nnx.LoRAParam, nnx.Param)``: adapters (trained, in the
optimizer and the checkpoint) and the frozen base. Their diffusers names are ``…to_q.lora_A.weight`` = lora_aᵀ and
``…to_q.lora_B.weight`` = lora_bᵀ (``model.load.diffusers_key``). Call ``add_lora`` inside the function that builds
the model under ``nnx.eval_shape`` or ``jax.jit`` (the adapters' initial values are traced from ``seed``).

The JAX trainer applies no adapter dropout (``spec.lora.dropout`` must be 0 on this backend: validation says so).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from wanloom_api.trainingjob import LoraSpec

FP32 = jnp.float32


class LoRALinear(nnx.Linear):
    """``nnx.Linear`` plus a float32 low-rank update (module docstring); made by ``add_lora``, not constructed."""

    lora_a: nnx.LoRAParam
    lora_b: nnx.LoRAParam
    lora_scale: float

    def __call__(self, inputs: jax.Array, out_sharding: object = None) -> jax.Array:
        y = super().__call__(inputs, out_sharding=out_sharding)
        dtype = y.dtype  # the compute dtype: float32 copies of long activations would dominate a block's memory
        update = (inputs.astype(dtype) @ self.lora_a[...].astype(dtype)) @ self.lora_b[...].astype(dtype)
        return y + (self.lora_scale * update).astype(dtype)


def _submodule(block: nnx.Module, target: str) -> object:
    """The module a diffusers-named target (``attn1.to_out.0``) names within one block."""
    module: object = block
    for part in target.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def add_lora(model: nnx.Module, lora: LoraSpec, *, seed: int) -> nnx.Module:
    """Give ``model``'s targeted linears adapters, in place (module docstring); returns ``model``.

    Raises:
        ValueError: a target that names no linear layer of a block.
    """
    key = jax.random.key(seed)
    for i, block in enumerate(model.blocks):
        for j, target in enumerate(lora.targets):
            try:
                linear = _submodule(block, target)
            except (AttributeError, IndexError):
                linear = None
            if not isinstance(linear, nnx.Linear):
                raise ValueError(f"spec.lora.targets: {target!r} is not a linear layer of blocks.{i}")
            d_in, d_out = linear.in_features, linear.out_features
            bound = 1.0 / d_in**0.5
            a = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, i), j), (d_in, lora.rank), FP32,
                                   -bound, bound)  # fmt: skip
            linear.__class__ = LoRALinear
            linear.lora_a = nnx.LoRAParam(a)
            linear.lora_b = nnx.LoRAParam(jnp.zeros((lora.rank, d_out), FP32))
            linear.lora_scale = lora.scale
    return model
