"""The JAX Wan VAE and umT5 compiled for one TPU v7x device on this host (libtpu, no TPU): memory and a roofline.

    PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/encoders_tpu_compile.py [--cases NAME ...] [--json]

Each case is the data-preparation program (``model/encoders/vae_jax.py`` encode or decode,
``model/encoders/umt5_jax.py`` encode) at
the real models' sizes, bfloat16, weights replicated, compiled ahead of time for one device of a tpu7x 2x2x1 host
(a TensorCore: 96 GiB of HBM). The compiled executable's memory analysis says whether it fits; its cost analysis
(XLA's FLOP and byte estimates) gives a roofline time per item against one device's share of the chip's peaks
(Google Cloud's TPU7x table: 2,307 bf16 TFLOP/s and 7,380 GB/s per chip, two devices per chip), and from it an
upper bound on clips (or captions) per hour per 4-chip host. The VAE runs its clip as a loop over 4-frame chunks
and XLA counts a loop's body once, so a VAE case also compiles its first chunk alone and counts the clip as the
first chunk plus one body per later chunk. Compiling the VAE at 480p x 81 takes ~10 minutes on a 2-core CPU: pick
cases with --cases, and --batch to compile a program for several items (the largest that fits is the batch
the data-preparation encoders would pick on that device).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from wanloom_trainer.model.encoders import umt5_jax, vae_jax

PEAK_FLOPS_PER_DEVICE = 2307e12 / 2
HBM_BYTES_PER_SECOND_PER_DEVICE = 7380e9 / 2
HBM_PER_DEVICE = 96 * 2**30
DEVICES_PER_HOST = 8
WAN21 = vae_jax.VaeConfig(96, 96, 16, (1, 2, 4, 4), 2, (), (False, True, True), False, None, (0.0,) * 16,
                          (1.0,) * 16, 4, 8)  # fmt: skip
WAN22 = vae_jax.VaeConfig(160, 256, 48, (1, 2, 4, 4), 2, (), (False, True, True), True, 2, (0.0,) * 48,
                          (1.0,) * 48, 4, 16)  # fmt: skip
UMT5_XXL = umt5_jax.TextConfig(4096, 64, 64, 24, 32, 128, 1e-6, "gelu_new", True)
UMT5_VOCAB, UMT5_FF = 256_384, 10_240


@dataclass(frozen=True)
class Case:
    """A program to compile; for the VAE also its first chunk alone and how often the chunk loop runs, because XLA's
    cost analysis counts a loop's body once: the clip's cost is first + loops x (program - first)."""

    lower: Callable[[Any, int], Any]  # (device, batch)
    first: Callable[[Any, int], Any] | None = None
    loops: int = 0


def _vae_case(cfg: vae_jax.VaeConfig, program: str, frames: int, height: int, width: int) -> Case:
    latent_frames = (frames - 1) // cfg.scale_factor_temporal + 1

    def lower(device: Any, batch: int, frames: int = frames, latent_frames: int = latent_frames) -> Any:
        put = SingleDeviceSharding(device)
        params = jax.eval_shape(lambda: vae_jax.random_params(cfg, 0, in_channels=3))
        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=put), params)
        if program == "encode":
            x = jax.ShapeDtypeStruct((batch, frames, height, width, 3), jnp.bfloat16, sharding=put)
            return jax.jit(lambda p, x: vae_jax.encode(p, cfg, x)).lower(params, x)
        s = cfg.scale_factor_spatial
        z = jax.ShapeDtypeStruct((batch, latent_frames, height // s, width // s, cfg.z_dim), jnp.bfloat16,
                                 sharding=put)  # fmt: skip
        return jax.jit(lambda p, z: vae_jax.decode(p, cfg, z)).lower(params, z)

    return Case(lower, lambda device, batch: lower(device, batch, 1, 1), latent_frames - 1)


def umt5_xxl_shapes() -> dict[str, tuple[int, ...]]:
    """The umT5-XXL encoder's tensors as the checkpoint names them (the umt5_jax layout)."""
    c = UMT5_XXL
    shapes = {"shared.weight": (UMT5_VOCAB, c.d_model), "encoder.final_layer_norm.weight": (c.d_model,)}
    for i in range(c.num_layers):
        block = f"encoder.block.{i}.layer"
        attn = f"{block}.0.SelfAttention"
        shapes |= {f"{attn}.{n}.weight": (c.d_model, c.num_heads * c.d_kv) for n in ("q", "k", "v")}
        shapes |= {f"{attn}.o.weight": (c.num_heads * c.d_kv, c.d_model),
                   f"{attn}.relative_attention_bias.weight": (c.num_buckets, c.num_heads),
                   f"{block}.0.layer_norm.weight": (c.d_model,), f"{block}.1.layer_norm.weight": (c.d_model,),
                   f"{block}.1.DenseReluDense.wi_0.weight": (c.d_model, UMT5_FF),
                   f"{block}.1.DenseReluDense.wi_1.weight": (c.d_model, UMT5_FF),
                   f"{block}.1.DenseReluDense.wo.weight": (UMT5_FF, c.d_model)}  # fmt: skip
    return shapes


def _umt5_case(tokens: int) -> Case:
    def lower(device: Any, batch: int) -> Any:
        put = SingleDeviceSharding(device)
        params = {k: jax.ShapeDtypeStruct(v, jnp.bfloat16, sharding=put) for k, v in umt5_xxl_shapes().items()}
        ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=put)
        return jax.jit(lambda p, i, m: umt5_jax.encode(p, UMT5_XXL, i, m)).lower(params, ids, ids)

    return Case(lower)


CASES: dict[str, Case] = {
    "vae2.1-encode-81x480x832": _vae_case(WAN21, "encode", 81, 480, 832),
    "vae2.1-decode-81x480x832": _vae_case(WAN21, "decode", 81, 480, 832),
    "vae2.1-encode-121x704x1280": _vae_case(WAN21, "encode", 121, 704, 1280),
    "vae2.1-decode-121x704x1280": _vae_case(WAN21, "decode", 121, 704, 1280),
    "vae2.2-encode-121x704x1280": _vae_case(WAN22, "encode", 121, 704, 1280),
    "umt5-xxl-512-tokens": _umt5_case(512),
}


def _cost(compiled: Any) -> tuple[float, float]:
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0]
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def run(name: str, device: Any, batch: int = 1) -> dict[str, Any]:
    case = CASES[name]
    start = time.perf_counter()
    compiled = case.lower(device, batch).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    flops, moved = _cost(compiled)
    if case.first is not None:
        first_flops, first_moved = _cost(case.first(device, batch).compile())
        flops = first_flops + case.loops * (flops - first_flops)
        moved = first_moved + case.loops * (moved - first_moved)
    hbm = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
    bound = max(flops / PEAK_FLOPS_PER_DEVICE, moved / HBM_BYTES_PER_SECOND_PER_DEVICE)
    return {
        "case": name,
        "batch": batch,
        "compile_seconds": round(seconds, 1),
        "hbm_gib": round(hbm / 2**30, 2),
        "fits": hbm <= HBM_PER_DEVICE,
        "tflop": round(flops / 1e12, 2),
        "tb_accessed": round(moved / 1e12, 3),
        "roofline_seconds": round(bound / batch, 4),  # per item
        "per_host_hour_upper_bound": round(3600 / bound * batch * DEVICES_PER_HOST) if bound else None,
    }


def main() -> None:
    from jax.experimental import topologies

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["vae2.1-encode-81x480x832"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="items per program (each compiled)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    device = topologies.get_topology_desc(topology_name="tpu7x:2x2x1", platform="tpu").devices[0]
    for name, batch in itertools.product(args.cases, args.batch):
        result = run(name, device, batch)
        print(json.dumps(result) if args.json else "  ".join(f"{k}={v}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
