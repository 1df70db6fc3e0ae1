"""Two optimizer steps of the tiny two-expert model on one device and on 8 CPU devices with several meshes.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (test_sharded_step.py does). Prints, per mesh, the
largest differences from the single-device run in losses, gradient norms, parameters and optimizer moments,
plus the sharding evidence (parameters and moments actually split over fsdp/tensor).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile

import jax
import numpy as np
from tiny_job import tiny_config

from wanloom_trainer.backends.interface import RankRows, Slot, StepInputs
from wanloom_trainer.backends.jax.backend import JaxBackend
from wanloom_trainer.backends.objective import batch_noise
from wanloom_trainer.config.train_config import ParallelConfig

# name: (mesh degrees, AdaLN kernel); context meshes last: they switch the process to GSPMD. The fused AdaLN is the
# Pallas kernel inside shard_map (interpreted on CPU), compared with the single-device run of the plain jnp chain.
MESHES = {
    "data2-fsdp4": ((2, 4, 1, 1), "reference"),
    "fused-data2-fsdp4": ((2, 4, 1, 1), "fused"),
    "fsdp2-context2-tensor2": ((1, 2, 2, 2), "reference"),
    "fused-fsdp2-context2-tensor2": ((1, 2, 2, 2), "fused"),
}
ROWS = 8  # global rows per slot: divisible by every mesh's data x fsdp


def global_rows(seed: int, shape: tuple[int, int, int], expert_step: int) -> RankRows:
    rng = np.random.default_rng(seed)
    ids = np.arange(ROWS) + 100 * seed
    latents = rng.standard_normal((ROWS, 4, *shape)).astype(np.float32)
    return RankRows(
        sample_ids=ids,
        latents=latents,
        text=rng.standard_normal((ROWS, 16, 32)).astype(np.float32),
        noise=batch_noise(0, expert_step, ids, latents.shape[1:]),
        timesteps=rng.uniform(0, 1000, ROWS).astype(np.float32),
        weights=np.full(ROWS, 1.0 / (2 * ROWS), np.float32),
    )


def split(rows: RankRows, ranks: int) -> dict[int, RankRows]:
    b = ROWS // ranks
    fields = ("sample_ids", "latents", "text", "noise", "timesteps", "weights")
    return {r: RankRows(*(getattr(rows, f)[r * b : (r + 1) * b] for f in fields)) for r in range(ranks)}


def steps(backend: JaxBackend, ranks: int) -> tuple[list[dict], object]:
    state = backend.init_state()
    outs = []
    for step in range(2):
        # Slot 0: images (16 tokens) through the high-noise expert; slot 1: 3-frame clips (12 tokens), low noise.
        slots = [
            Slot(0, split(global_rows(10 * step + 1, (1, 8, 8), step), ranks)),
            Slot(1, split(global_rows(10 * step + 2, (3, 4, 4), step), ranks)),
        ]
        inputs = StepInputs(step, slots, 2 * ROWS, (ROWS, ROWS), (1e-2, 1e-2))
        state, out = backend.train_step(state, inputs)
        outs.append({"loss": [e.loss_sum for e in out.experts], "grad_norm": [e.grad_norm for e in out.experts]})
    return outs, jax.tree.map(np.asarray, state)


def max_diff(a: object, b: object) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def split_params(state: object) -> int:
    """Parameters (and moments) whose sharding splits them: proof that the state is not replicated."""
    return sum(
        1 for x in jax.tree.leaves(state) if len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated
    )


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    with tempfile.TemporaryDirectory() as work:
        # eps large enough that Adam's first update g/(|g|+eps) is a smooth function of g (no sign flips of ~0
        # gradients), so a float-rounding difference cannot be amplified into an lr-sized parameter difference.
        base = tiny_config(work, optimizer={"eps": 1e-2, "warmupSteps": 0}, training={"checkpoint": {"uri": None}})
        single = JaxBackend(base.backend_config, devices=jax.devices()[:1])
        ref_outs, ref_state = steps(single, 1)
        report = {}
        for name, (shape, adaln) in MESHES.items():
            model = dataclasses.replace(base.model, adaln=adaln)
            config = dataclasses.replace(base, parallel=ParallelConfig(*shape), model=model)
            backend = JaxBackend(config.backend_config)
            state_live = backend.init_state()
            outs, state = steps(backend, config.parallel.batch_ranks)
            pairs = list(zip(outs, ref_outs, strict=True))
            report[name] = {
                "loss": max(abs(a - b) for o, r in pairs for a, b in zip(o["loss"], r["loss"], strict=True)),
                "grad_norm": max(
                    abs(a - b) / b for o, r in pairs for a, b in zip(o["grad_norm"], r["grad_norm"], strict=True)
                ),
                "params": max_diff(state.params, ref_state.params),
                "opt": max_diff(state.opt, ref_state.opt),
                "split_leaves": split_params(state_live),
                "local_ranks": list(backend.local_ranks(config.parallel.batch_ranks)),
            }
        report["reference_loss"] = ref_outs[-1]["loss"]
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
