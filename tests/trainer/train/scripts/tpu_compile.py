"""The tiny two-expert step compiled ahead of time for TPU v7x topologies on this CPU host (libtpu, no TPU).

Mesh data x fsdp x context x tensor over the topology's devices (2 per chip), fused AdaLN and splash attention
lowered with Mosaic inside shard_map. Prints, per case, the number of Mosaic custom calls, the per-device bytes
from memory_analysis() and the compile time; a failure to partition raises and fails the script.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from tiny_job import tiny_config

from wanloom_trainer.backends.jax.backend import JaxBackend
from wanloom_trainer.config.train_config import ParallelConfig

# name: (topology, slices, data, fsdp, context, tensor)
CASES = {
    "2x2x1-data2-fsdp2-context2": ("tpu7x:2x2x1", 1, 2, 2, 2, 1),
    "2x2x1-fsdp2-context2-tensor2": ("tpu7x:2x2x1", 1, 1, 2, 2, 2),
    "2-slices-2x2x1-data2-fsdp4-context2": ("tpu7x:2x2x1", 2, 2, 4, 2, 1),
}
ROWS = 8  # global rows: a multiple of data x fsdp in every case


def compile_case(work: str, topology: str, slices: int, *degrees: int) -> dict:
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu", num_slices=slices).devices
    base = tiny_config(work, training={"checkpoint": {"uri": None}})
    model = dataclasses.replace(base.model, adaln="fused", attention="splash")
    config = dataclasses.replace(base, parallel=ParallelConfig(*degrees), model=model)
    backend = JaxBackend(config.backend_config, devices=devices)
    state = backend.abstract_state()
    params = backend.flat_state(state["params"], state["opt"])[0][0]
    rows = lambda *shape: jax.ShapeDtypeStruct((ROWS, *shape), jnp.float32, sharding=backend.shardings.batch_b)
    latent = (4, 3, 8, 8)  # 3 frames of 8x8 latents: 48 tokens, a multiple of context x tensor
    batch = {
        "latents": rows(*latent),
        "text": rows(16, 32),
        "noise": rows(*latent),
        "timesteps": rows(),
        "weights": rows(),
    }
    start = time.perf_counter()
    lowered = backend.step_fns.accumulate.lower(params, backend.abstract_frozen(), params, batch)
    compiled = lowered.compile()
    memory = compiled.memory_analysis()
    return {
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "mosaic_calls": lowered.as_text().count("tpu_custom_call"),
        "peak_bytes": memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes,
        "compile_s": time.perf_counter() - start,
    }


def unwrapped_error() -> str:
    """What a bare Mosaic kernel under a multi-device jit gives: the failure the shard_map wrappers avoid."""
    from jax.sharding import NamedSharding, PartitionSpec

    from wanloom_trainer.kernels.adaln_pallas import adaln_pallas

    devices = topologies.get_topology_desc(topology_name="tpu7x:2x2x1", platform="tpu").devices
    sharding = NamedSharding(jax.sharding.Mesh(devices, ("data",)), PartitionSpec("data"))
    x = jax.ShapeDtypeStruct((8, 256, 128), jnp.bfloat16, sharding=sharding)
    mod = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=sharding)
    try:
        jax.jit(lambda x, s, h: adaln_pallas(x, s, h, 1e-6, False)).lower(x, mod, mod).compile()
    except Exception as exc:  # the partitioner's error, whatever its type
        return f"{type(exc).__name__}: {exc}"[:300]
    return ""


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        report = {name: compile_case(work, *case) for name, case in CASES.items()}
    report["unwrapped_error"] = unwrapped_error()
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
