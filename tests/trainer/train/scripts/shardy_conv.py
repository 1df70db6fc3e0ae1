"""Minimal repro of the partitioner bug the JAX backend works around (``backend_jax.use_gspmd_for_sequence_sharding``).

The weight gradient of a stride = kernel 3D convolution (Wan's patch embedding) whose output is later split along
the token axis over a 2-device "context" axis, compared with the unsharded gradient, under Shardy and under GSPMD.
Prints {"shardy": max error, "gspmd": max error, "scale": max |gradient|}. Needs 4 host devices.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def error() -> tuple[float, float]:
    mesh = jax.make_mesh((2, 2), ("context", "tensor"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 4, 1, 8, 8)).astype(np.float32)
    w = rng.standard_normal((1, 2, 2, 4, 32)).astype(np.float32)
    wq = rng.standard_normal((32, 32)).astype(np.float32)

    def loss(w: jax.Array, x: jax.Array, spec: P) -> jax.Array:
        dims = ("NDHWC", "DHWIO", "NDHWC")
        y = jax.lax.conv_general_dilated(jnp.moveaxis(x, 1, -1), w, (1, 2, 2), "VALID", dimension_numbers=dims)
        q = (y.reshape(4, 16, 32) @ wq).reshape(4, 16, 2, 16)
        return jnp.sum(jnp.sin(jax.lax.with_sharding_constraint(q, NamedSharding(mesh, spec))))

    reference = jax.grad(loss)(w, x, P())
    sharded = jax.jit(jax.grad(loss), static_argnums=2)(w, x, P(None, "context", "tensor", None))
    return float(jnp.max(jnp.abs(sharded - reference))), float(jnp.max(jnp.abs(reference)))


if __name__ == "__main__":
    if sys.argv[1:] == ["one"]:
        print(json.dumps(error()))
        sys.exit(0)
    out = {}
    for name, flag in (("shardy", "1"), ("gspmd", "0")):
        env = {**__import__("os").environ, "JAX_USE_SHARDY_PARTITIONER": flag}
        proc = subprocess.run([sys.executable, __file__, "one"], env=env, capture_output=True, text=True, check=True)
        out[name], out["scale"] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(out))
