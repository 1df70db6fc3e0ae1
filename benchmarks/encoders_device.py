"""The JAX Wan VAE and umT5 on an accelerator (TPU or GPU): parity with the CPU, then throughput at real sizes.

    PYTHONPATH=operator:trainer_images python benchmarks/encoders_device.py [--parity] [--throughput] [--json]

Parity: the same small random models (Wan 2.1 and Wan 2.2 VAE layouts, a 3-layer umT5) on odd shapes, run on the
first accelerator and on the CPU; float32 at the highest matmul precision (a TPU's default rounds float32 matmuls
through bfloat16) must agree within 1e-4 relative, and the bfloat16 error is printed. The CPU path is the one the
test suite holds against diffusers and transformers (tests/trainer/model/), so this closes the chain on the device.

Throughput: Wan 2.1's VAE (the A14B models') encoding 81 x 480 x 832 clips and umT5-XXL encoding 512-token captions,
random bfloat16 weights replicated on every local device, each device a batch of its own; items per hour for the
host beside the roofline of the same program (encoders_tpu_compile.py's peaks for tpu7x; on a GPU the figure is
printed without a roofline).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from encoders_tpu_compile import UMT5_XXL, WAN21, WAN22, umt5_xxl_shapes
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from wanloom_trainer.model.encoders import umt5_jax, vae_jax

SMALL_TEXT = umt5_jax.TextConfig(48, 4, 12, 3, 32, 20, 1e-6, "gelu_new", True)
CLIPS = {"vae2.1 encode 81x480x832": (WAN21, (81, 480, 832)), "vae2.2 encode 81x704x1280": (WAN22, (81, 704, 1280))}
CAPTION_TOKENS = 512


def _rel(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / np.abs(want).max())


def _small_text_params(seed: int) -> dict[str, np.ndarray]:
    rng, c = np.random.default_rng(seed), SMALL_TEXT
    inner, ff = c.num_heads * c.d_kv, 96
    shapes = {"shared.weight": (300, c.d_model), "encoder.final_layer_norm.weight": (c.d_model,)}
    for i in range(c.num_layers):
        block = f"encoder.block.{i}.layer"
        shapes |= {f"{block}.0.SelfAttention.{n}.weight": (c.d_model, inner) for n in "qkv"}
        shapes |= {f"{block}.0.SelfAttention.o.weight": (inner, c.d_model),
                   f"{block}.0.SelfAttention.relative_attention_bias.weight": (c.num_buckets, c.num_heads),
                   f"{block}.0.layer_norm.weight": (c.d_model,), f"{block}.1.layer_norm.weight": (c.d_model,),
                   f"{block}.1.DenseReluDense.wi_0.weight": (c.d_model, ff),
                   f"{block}.1.DenseReluDense.wi_1.weight": (c.d_model, ff),
                   f"{block}.1.DenseReluDense.wo.weight": (ff, c.d_model)}  # fmt: skip
    return {k: (rng.standard_normal(v) / np.sqrt(v[0])).astype(np.float32) for k, v in shapes.items()}


def _on(device: Any, fn: Callable[..., Any], *args: Any) -> Any:
    return np.asarray(jax.jit(fn)(*jax.device_put(args, device)))


def parity() -> list[dict[str, Any]]:
    accel, cpu = jax.devices()[0], jax.devices("cpu")[0]
    rows = []
    small21 = vae_jax.VaeConfig(16, 16, 4, (1, 2, 2, 2), 1, (), (False, True, True), False, None, (0.0,) * 4,
                                (1.0,) * 4, 4, 8)  # fmt: skip
    small22 = vae_jax.VaeConfig(8, 12, 6, (1, 2, 2, 2), 2, (), (False, True, True), True, 2, (0.0,) * 6,
                                (1.0,) * 6, 4, 16)  # fmt: skip
    for name, cfg, shape in (("vae2.1 17x272x480", small21, (1, 17, 272, 480, 3)),
                             ("vae2.1 image 1x96x160", small21, (2, 1, 96, 160, 3)),
                             ("vae2.2 9x96x160", small22, (1, 9, 96, 160, 3))):  # fmt: skip
        params = vae_jax.random_params(cfg, 0, in_channels=3)
        x = np.random.default_rng(1).uniform(-1, 1, shape).astype(np.float32)
        encode = lambda p, x, cfg=cfg: vae_jax.encode(p, cfg, x)
        decode = lambda p, z, cfg=cfg: vae_jax.decode(p, cfg, z)
        want_z = _on(cpu, encode, params, x)
        want_x = _on(cpu, decode, params, want_z)
        with jax.default_matmul_precision("highest"):
            got_z, got_x = _on(accel, encode, params, x), _on(accel, decode, params, want_z)
        bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
        rows.append({"case": name, "latents_f32": _rel(got_z, want_z), "frames_f32": _rel(got_x, want_x),
                     "latents_bf16": _rel(_on(accel, encode, bf16, x.astype(jnp.bfloat16)), want_z)})  # fmt: skip
    params = _small_text_params(0)
    ids = np.random.default_rng(2).integers(2, 300, (3, 77)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 40:], mask[2, 5:] = 0, 0
    text = lambda p, i, m: umt5_jax.encode(p, SMALL_TEXT, i, m)
    want = _on(cpu, text, params, ids, mask)
    with jax.default_matmul_precision("highest"):
        got = _on(accel, text, params, ids, mask)
    real = mask.astype(bool)
    rows.append({"case": "umt5 3x77 tokens", "hidden_f32": _rel(got[real], want[real])})
    for row in rows:
        row["ok"] = all(v <= 1e-4 for k, v in row.items() if k.endswith("_f32"))
    return rows


def _timed(fn: Callable[[], Any], repeats: int = 3) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn())
    return (time.perf_counter() - start) / repeats


def throughput(per_device_clips: int, per_device_captions: int) -> list[dict[str, Any]]:
    devices = jax.local_devices()
    mesh = Mesh(np.array(devices), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    n = len(devices)
    rows = []
    for name, (cfg, (frames, h, w)) in CLIPS.items():
        params = jax.device_put(jax.tree.map(lambda a: a.astype(jnp.bfloat16), vae_jax.random_params(cfg, 0)),
                                replicated)  # fmt: skip
        x = jax.device_put(jnp.zeros((n * per_device_clips, frames, h, w, 3), jnp.bfloat16), split)
        fn = jax.jit(lambda p, x, cfg=cfg: vae_jax.encode(p, cfg, x))
        seconds = _timed(lambda fn=fn, params=params, x=x: fn(params, x))
        rows.append({"case": name, "devices": n, "batch": int(x.shape[0]), "seconds": round(seconds, 3),
                     "per_host_hour": round(3600 * x.shape[0] / seconds)})  # fmt: skip
        del params, x
    keys = jax.random.split(jax.random.key(0), len(umt5_xxl_shapes()))
    params = {name: jax.jit(lambda k, s=shape: (jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16),
                            out_shardings=replicated)(key)
              for key, (name, shape) in zip(keys, umt5_xxl_shapes().items(), strict=True)}  # fmt: skip
    ids = jax.device_put(jnp.ones((n * per_device_captions, CAPTION_TOKENS), jnp.int32), split)
    fn = jax.jit(lambda p, i: umt5_jax.encode(p, UMT5_XXL, i, i))
    seconds = _timed(lambda: fn(params, ids))
    rows.append({"case": f"umt5-xxl {CAPTION_TOKENS} tokens", "devices": n, "batch": int(ids.shape[0]),
                 "seconds": round(seconds, 3), "per_host_hour": round(3600 * ids.shape[0] / seconds)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parity", action="store_true")
    parser.add_argument("--throughput", action="store_true")
    parser.add_argument("--clips-per-device", type=int, default=1)
    parser.add_argument("--captions-per-device", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    print("devices:", jax.devices(), flush=True)
    rows = parity() if args.parity or not args.throughput else []
    if args.throughput or not args.parity:
        rows += throughput(args.clips_per_device, args.captions_per_device)
    for row in rows:
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if not all(row.get("ok", True) for row in rows):
        raise SystemExit("encoders_device: the accelerator's float32 results differ from the CPU's by more than 1e-4")


if __name__ == "__main__":
    main()
