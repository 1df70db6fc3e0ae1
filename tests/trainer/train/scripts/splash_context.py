"""Context-parallel attention (``parallel.context_attention``) against plain XLA attention on one device.

Cores: XLA attention and the Pallas splash kernel (the TPU path, run by the Pallas interpreter here), each inside
the mesh-aware wrapper on a (data 1, fsdp 2, context 2, tensor 1) mesh of 4 CPU devices; self-attention with the
sequence split over context, and cross-attention to unsplit text. Prints the largest output and gradient errors.
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from wanloom_trainer.config.train_config import ParallelConfig
from wanloom_trainer.model.attention import splash_attention, xla_attention
from wanloom_trainer.parallel.context_attention import context_parallel_attention
from wanloom_trainer.parallel.mesh_jax import ShardingConfig, build_mesh


def errors(core, shardings: ShardingConfig, cross: bool) -> tuple[float, float]:
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 32, 2, 16)), jnp.float32)
    kv_len = 12 if cross else 32
    k = jnp.asarray(rng.standard_normal((2, kv_len, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, kv_len, 2, 16)), jnp.float32)
    wrapped = context_parallel_attention(core, shardings, cross=cross)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))

    out, ref = jax.jit(wrapped)(q, k, v), xla_attention(q, k, v)
    grads = jax.jit(jax.grad(loss(wrapped), argnums=(0, 1, 2)))(q, k, v)
    ref_grads = jax.grad(loss(xla_attention), argnums=(0, 1, 2))(q, k, v)
    grad_err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads, ref_grads, strict=True))
    return float(jnp.max(jnp.abs(out - ref))), grad_err


def main() -> None:
    shardings = ShardingConfig(build_mesh(ParallelConfig(1, 2, 2, 1)))
    splash = functools.partial(splash_attention, interpret=True, block_q=128, block_kv=128)
    report = {
        f"{name}-{'cross' if cross else 'self'}": errors(core, shardings, cross)
        for name, core in (("xla", xla_attention), ("splash", splash))
        for cross in (False, True)
    }
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
