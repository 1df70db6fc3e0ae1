"""Fused AdaLN kernels: compiled resource use, correctness, bytes saved for backward, and (on a device) timings.

    PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/adaln_kernels.py --aot sm_90,sm_100 [--json]
    PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/adaln_kernels.py            # any machine
    PYTHONPATH=operator:trainer_images python benchmarks/adaln_kernels.py --gpu-only           # on a GPU

Sections, each printed as a table of ratios measured side by side in one run:
0. ``--aot``: every Triton kernel the launchers can start (forward, both backward kernels, the segment sum; bf16,
   fp16 and fp32 x; per-sample, per-token and per-segment modulation) compiled for sm_90/sm_100 with Triton's own
   ptxas at D in {1536, 3072, 5120}: registers, spills, shared memory, occupancy. No GPU needed; nothing else runs.
1. Correctness of both kernels against the plain references at small shapes (CPU: Triton and Pallas interpreters).
2. Bytes saved for backward, fused vs eager (torch saved-tensor hooks, JAX VJP residuals), measured at N = 64 and
   N = 128 and extended to N = 75,600 exactly (the bytes are affine in N).
3. GPU (PyTorch + Triton, B = 2): forward/backward time, bandwidth as a fraction of the HBM peak of the exact device
   name (bytes the fused kernels really move, partial buffers and row statistics included), speedup over eager,
   torch.compile and Liger-Kernel's LayerNorm followed by the eager modulation (when liger_kernel is installed).
   Inputs are hundreds of MB (L2 is 50-60 MB on H100/H200); do_bench flushes L2 between runs. The torch path never
   imports JAX.
4. TPU (JAX + Pallas): the same against XLA.
Sections 3 and 4 run only where the device exists; on CPU the script says that timings need a device.
Targets (GPU): forward >= 85% of HBM peak, backward >= 70%, forward >= 3x eager, backward >= 1.4x eager.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HBM_PEAK_BYTES_S = {  # by exact device name (torch.cuda.get_device_name / jax device_kind); vendor datasheets
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100 80GB HBM3": 3.35e12,
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA B200": 8.0e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    # TPU v7x: ~7.37 TB/s per chip shared by its 2 TensorCores, and JAX's device is one TensorCore.
    "TPU7x": 7.37e12 / 2,
}
WAN_TOKENS = 75_600  # Wan 2.2 A14B, 81 frames at 1280x720: 21 x 45 x 80 latent patches
AOT_DIMS = (1536, 3072, 5120)
AOT_DTYPES = ("bfloat16", "float16", "float32")


def _table(title: str, header: list[str], rows: list[list[object]]) -> None:
    print(f"\n## {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row) + " |")


# ------------------------------------------------------------------------------------------------ 1. correctness


def _torch_case(b: int, n: int, d: int, per_token: bool, dtype: Any, device: str):
    import torch

    gen = torch.Generator().manual_seed(0)
    mod = (b, n, d) if per_token else (b, d)
    tensors = [
        2 * torch.randn(b, n, d, generator=gen) + 0.5,
        0.3 * torch.randn(mod, generator=gen),
        torch.randn(mod, generator=gen),
        torch.randn(b, n, d, generator=gen),
    ]
    x, scale, shift, dy = (t.to(device) for t in tensors)
    return x.to(dtype).requires_grad_(), scale.requires_grad_(), shift.requires_grad_(), dy.to(dtype)


def _torch_error(b: int, n: int, d: int, per_token: bool, dtype: Any, device: str) -> float:
    import torch

    from wanloom_trainer.kernels import adaln_torch

    x, scale, shift, dy = _torch_case(b, n, d, per_token, dtype, device)
    outs = []
    for impl in ("fused", "reference"):
        y = adaln_torch(x, scale, shift, impl=impl)
        outs.append([y, *torch.autograd.grad(y, (x, scale, shift), dy)])
    return max(_rel(a.detach().double(), b.detach().double()) for a, b in zip(*outs, strict=True))


def _jax_error(b: int, n: int, d: int, per_token: bool, dtype: Any) -> float:
    import jax
    import jax.numpy as jnp

    from wanloom_trainer.kernels import adaln_jax

    keys = jax.random.split(jax.random.key(0), 4)
    mod = (b, n, d) if per_token else (b, d)
    x = (2 * jax.random.normal(keys[0], (b, n, d)) + 0.5).astype(dtype)
    args = (x, 0.3 * jax.random.normal(keys[1], mod), jax.random.normal(keys[2], mod))
    dy = jax.random.normal(keys[3], (b, n, d)).astype(dtype)
    outs = []
    for impl in ("fused", "reference"):
        y, pullback = jax.vjp(lambda *a, impl=impl: adaln_jax(*a, impl=impl), *args)
        outs.append([y, *pullback(dy)])
    return max(_rel(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)) for a, b in zip(*outs, strict=True))


def _rel(got, want) -> float:
    """max|got − want| / max(1, max|want|): the fp32 criterion of the tests (bf16 allows 2e-2 of max|want|)."""
    return float(abs(got - want).max() / max(1.0, float(abs(want).max())))


def correctness(device: str) -> None:
    import jax.numpy as jnp
    import torch

    rows = []
    for (b, n, d), per_token, name in [
        ((2, 33, 96), False, "bf16"),
        ((2, 33, 96), True, "f32"),
        ((1, 8, 5120), False, "f32"),
        ((1, 8, 3072), True, "bf16"),
    ]:
        tdt, jdt = (torch.bfloat16, jnp.bfloat16) if name == "bf16" else (torch.float32, jnp.float32)
        mod = "per token" if per_token else "per sample"
        rows.append(
            [
                f"[{b}, {n}, {d}]",
                mod,
                name,
                _torch_error(b, n, d, per_token, tdt, device),
                _jax_error(b, n, d, per_token, jdt),
            ]
        )
    _table(
        "Correctness: max error of y, dx, d_scale, d_shift vs the reference (tolerance f32 1e-5, bf16 2e-2)",
        ["x", "modulation", "x dtype", "Triton", "Pallas"],
        rows,
    )


# ---------------------------------------------------------------------------------------------------- 2. memory


MEMORY_CASES = [(5120, False, "bf16"), (5120, True, "bf16"), (3072, False, "bf16"), (3072, True, "bf16")]
MEMORY_CASES += [(5120, False, "f32"), (5120, True, "f32")]


def _saved(framework: str, impl: str, n: int, d: int, per_token: bool, dtype: str) -> Any:
    from wanloom_trainer.kernels.adaln_memory import residual_bytes_jax, saved_bytes_torch

    mod = (1, n, d) if per_token else (1, d)
    if framework == "torch":
        import torch

        from wanloom_trainer.kernels import adaln_torch

        x_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        args = _torch_case(1, n, d, per_token, x_dtype, "cuda" if torch.cuda.is_available() else "cpu")[:3]
        return saved_bytes_torch(lambda *a: adaln_torch(*a, impl=impl), *args)
    import jax.numpy as jnp

    from wanloom_trainer.kernels import adaln_jax

    x = jnp.ones((1, n, d), jnp.bfloat16 if dtype == "bf16" else jnp.float32)
    return residual_bytes_jax(lambda *a: adaln_jax(*a, impl=impl), x, jnp.ones(mod), jnp.ones(mod))


def _saved_at(framework: str, impl: str, n: int, d: int, per_token: bool, dtype: str) -> Any:
    """Bytes at sequence length n from measurements at N = 64 and 128 (saved bytes are affine in N)."""
    from wanloom_trainer.kernels.adaln_memory import SavedBytes

    small, large = (_saved(framework, impl, m, d, per_token, dtype) for m in (64, 128))
    extend = lambda a, b: round(a + (b - a) * (n - 64) / 64)
    return SavedBytes(extend(small.total, large.total), extend(small.new, large.new))


def memory(tokens: int) -> None:
    rows = []
    for framework in ("torch", "jax"):
        for d, per_token, dtype in MEMORY_CASES:
            eager, fused = (_saved_at(framework, impl, tokens, d, per_token, dtype) for impl in ("reference", "fused"))
            total_saving, new_saving = fused.saving_vs(eager)
            mod = "per token" if per_token else "per sample"
            mib = [f"{v / 2**20:.1f}" for v in (eager.total, fused.total, eager.new, fused.new)]
            rows.append(
                [framework, f"[1, {tokens}, {d}]", dtype, mod, *mib, f"{total_saving:.1%}", f"{new_saving:.2%}"]
            )
    _table(
        "Bytes saved for backward per AdaLN call, fp32 modulation (target: >= 60% less); "
        "'beyond inputs' leaves out saved tensors that are the call's own x/scale",
        [
            "framework",
            "x",
            "x dtype",
            "modulation",
            "eager MiB",
            "fused MiB",
            "eager beyond inputs",
            "fused beyond inputs",
            "saved",
            "saved beyond inputs",
        ],
        rows,
    )


# ------------------------------------------------------------------------------------------------ 3./4. timings


def _hbm_peak(device_name: str, override_tbps: float | None) -> float | None:
    """The HBM peak of this exact device name (None when unknown: pass --hbm-peak-tbps)."""
    if override_tbps:
        return override_tbps * 1e12
    return HBM_PEAK_BYTES_S.get(device_name)


def fused_traffic(b: int, n: int, d: int, per_token: bool, x_item: int, programs: int) -> tuple[int, int]:
    """HBM bytes the fused Triton kernels move (forward, backward), fp32 modulation, as launched.

    Forward: read x, write y, the modulation once per row block (per sample: once per tile) and the row statistics.
    Backward: the row kernel reads x, dy, the statistics and writes c1/c2; the column kernel reads x, dy, the four
    row vectors and writes dx and (per token) d_scale/d_shift or (per sample) the ``[P + B − 1, D]`` fp32 partials,
    which the segment sum reads back before writing ``[B, D]``.
    """
    elems, rows = b * n * d, b * n
    mod = 4 * (elems if per_token else b * d)
    forward = 2 * elems * x_item + 2 * mod + 8 * rows
    row_kernel = 2 * elems * x_item + mod + 16 * rows
    if per_token:
        column = 3 * elems * x_item + mod + 16 * rows + 2 * mod
        return forward, row_kernel + column
    partials = 2 * 4 * (programs + b - 1) * d
    column = 3 * elems * x_item + mod + 16 * rows + partials
    return forward, row_kernel + column + partials + 2 * mod


def _liger_adaln() -> Callable[..., Any] | None:
    """Liger-Kernel's fused LayerNorm (unit weight, zero bias) followed by the eager fp32 modulation, or None."""
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except ImportError:
        return None
    import torch

    def adaln(x, scale, shift):
        d = x.shape[-1]
        ones, zeros = torch.ones(d, device=x.device, dtype=x.dtype), torch.zeros(d, device=x.device, dtype=x.dtype)
        x_hat = LigerLayerNormFunction.apply(x, ones, zeros, 1e-6)
        if scale.dim() == 2:
            scale, shift = scale[:, None], shift[:, None]
        return (x_hat.float() * (1 + scale) + shift).to(x.dtype)

    return adaln


def _gpu_row(b: int, d: int, n: int, per_token: bool, peak: float | None) -> dict[str, Any]:
    import torch
    import triton.testing

    from wanloom_trainer.kernels import adaln_torch
    from wanloom_trainer.kernels.adaln_ref_torch import adaln_reference_torch
    from wanloom_trainer.kernels.adaln_triton import default_num_programs

    x, scale, shift, dy = _torch_case(b, n, d, per_token, torch.bfloat16, "cuda")
    impls = {
        "fused": lambda *a: adaln_torch(*a, impl="fused"),
        "eager": adaln_reference_torch,
        "compile": torch.compile(adaln_reference_torch),
    }
    liger = _liger_adaln()
    if liger is not None:
        impls["liger"] = liger
    times = {}
    for name, fn in impls.items():
        forward = triton.testing.do_bench(lambda fn=fn: fn(x, scale, shift), warmup=25, rep=200, return_mode="median")
        y = fn(x, scale, shift)
        backward = triton.testing.do_bench(
            lambda y=y: torch.autograd.grad(y, (x, scale, shift), dy, retain_graph=True),
            warmup=25,
            rep=200,
            return_mode="median",
        )
        times[name] = (forward, backward)
    programs = min(b * n, default_num_programs(x.device, d))
    fwd_bytes, bwd_bytes = fused_traffic(b, n, d, per_token, 2, programs)
    f_ms, b_ms = times["fused"]
    row = {
        "B": b, "D": d, "N": n, "modulation": "per token" if per_token else "per sample",
        "fwd_ms": f_ms, "fwd_hbm": fwd_bytes / (f_ms * 1e-3) / peak if peak else None,
        "bwd_ms": b_ms, "bwd_hbm": bwd_bytes / (b_ms * 1e-3) / peak if peak else None,
    }  # fmt: skip
    for name, (ef, eb) in times.items():
        if name != "fused":
            row[f"fwd_x_{name}"], row[f"bwd_x_{name}"] = ef / f_ms, eb / b_ms
    return row


def gpu_timings(dims: list[int], tokens: list[int], batch: int, peak_override: float | None) -> list[dict]:
    import torch

    name = torch.cuda.get_device_name()
    peak = _hbm_peak(name, peak_override)
    rows = [_gpu_row(batch, d, n, per_token, peak) for d in dims for n in tokens for per_token in (False, True)]
    header = list(rows[0])
    pct = lambda v: "n/a" if v is None else f"{v:.0%}"
    cells = [[pct(r[k]) if k.endswith("_hbm") else r[k] for k in header] for r in rows]
    _table(
        f"GPU timings, bf16 x, fp32 modulation ({name}, HBM peak {peak / 1e12 if peak else 'unknown'} TB/s; "
        "targets fwd >= 85%, bwd >= 70%, fwd >= 3x eager, bwd >= 1.4x eager)",
        header,
        cells,
    )
    return rows


def train_step_timing(steps: int = 10) -> dict[str, float]:
    """Median ms of one bf16 forward+backward+AdamW step of a small Wan (Wan 2.1 1.3B widths, 4 layers, 8,190
    tokens) on the GPU, with the fused Triton AdaLN and with diffusers' eager chain; same weights and inputs."""
    import torch
    from diffusers import WanTransformer3DModel

    from wanloom_trainer.model.wan_torch import use_fused_adaln

    def model() -> Any:
        torch.manual_seed(0)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
            text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=4, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
        ).to("cuda", torch.bfloat16)  # fmt: skip

    gen = torch.Generator(device="cuda").manual_seed(0)
    latents = torch.randn(1, 16, 13, 30, 42, device="cuda", dtype=torch.bfloat16, generator=gen)  # 13x15x21 tokens
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    t = torch.tensor([500.0], device="cuda")
    out = {}
    for impl in ("reference", "fused"):
        net = model() if impl == "reference" else use_fused_adaln(model())
        opt = torch.optim.AdamW(net.parameters(), lr=1e-5)
        samples = []
        for i in range(steps + 3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            pred = net(latents, t, text, return_dict=False)[0]
            pred.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= 3:
                samples.append((time.perf_counter() - start) * 1e3)
        out[impl] = statistics.median(samples)
        del net, opt
        torch.cuda.empty_cache()
    _table(
        "Small Wan training step (4 layers, D 1536, 8,190 tokens, bf16, AdamW)",
        ["reference ms", "fused ms", "speed-up"],
        [[out["reference"], out["fused"], out["reference"] / out["fused"]]],
    )
    return out


def _time_jax(fn: Callable[..., object], *args: object, reps: int = 20) -> float:
    """Median wall milliseconds of a jitted call (after a compile-and-warm-up call)."""
    import jax

    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _tpu_row(d: int, n: int, per_token: bool, peak: float | None) -> list[object]:
    import jax
    import jax.numpy as jnp

    from wanloom_trainer.kernels.adaln_pallas import adaln_backward, adaln_forward, adaln_pallas
    from wanloom_trainer.kernels.adaln_ref_jax import adaln_reference_jax

    keys = jax.random.split(jax.random.key(0), 4)
    mod = (1, n, d) if per_token else (1, d)
    x = jax.random.normal(keys[0], (1, n, d), jnp.bfloat16)
    scale, shift = 0.3 * jax.random.normal(keys[1], mod), jax.random.normal(keys[2], mod)
    dy = jax.random.normal(keys[3], (1, n, d), jnp.bfloat16)
    both = lambda f: jax.jit(lambda *a: jax.vjp(f, *a[:3])[1](a[3]))
    fused_f = _time_jax(jax.jit(lambda *a: adaln_forward(*a, interpret=False)), x, scale, shift)
    fused_b = _time_jax(jax.jit(lambda *a: adaln_backward(*a, interpret=False)), dy, x, scale)
    fused_fb = _time_jax(both(lambda *a: adaln_pallas(*a, interpret=False)), x, scale, shift, dy)
    xla_f = _time_jax(jax.jit(adaln_reference_jax), x, scale, shift)
    xla_fb = _time_jax(both(adaln_reference_jax), x, scale, shift, dy)
    mod = 4 * (n * d if per_token else d)  # read x (and dy), the modulation; write y (dx, d_scale, d_shift)
    fwd_bytes, bwd_bytes = 4 * n * d + 2 * mod, 6 * n * d + 3 * mod
    frac = lambda nbytes, ms: f"{nbytes / (ms * 1e-3) / peak:.0%}" if peak else "n/a"
    return [
        d,
        n,
        "per token" if per_token else "per sample",
        f"{fused_f:.3f}",
        frac(fwd_bytes, fused_f),
        xla_f / fused_f,
        f"{fused_b:.3f}",
        frac(bwd_bytes, fused_b),
        f"{fused_fb:.3f}",
        xla_fb / fused_fb,
    ]


def tpu_timings(dims: list[int], tokens: list[int], peak_override: float | None) -> None:
    import jax

    name = jax.devices()[0].device_kind
    peak = _hbm_peak(name, peak_override)
    rows = [_tpu_row(d, n, per_token, peak) for d in dims for n in tokens for per_token in (False, True)]
    _table(
        f"TPU timings, bf16 x, fp32 modulation, B = 1 ({name}, HBM peak "
        f"{peak / 1e12 if peak else 'unknown'} TB/s per device)",
        [
            "D",
            "N",
            "modulation",
            "fwd ms",
            "fwd %HBM",
            "fwd x XLA",
            "bwd ms",
            "bwd %HBM",
            "fwd+bwd ms",
            "fwd+bwd x XLA",
        ],
        rows,
    )


# ---------------------------------------------------------------------------------------------------------- main


def aot_report(targets: list[str]) -> list[dict[str, Any]]:
    """Compile every launchable kernel variant for each target; one dict per compiled kernel."""
    from wanloom_trainer.kernels.adaln_triton import MODULATIONS, aot_variants
    from wanloom_trainer.kernels.triton_aot import compile_kernel

    rows = []
    for target, d, dtype, modulation in itertools.product(targets, AOT_DIMS, AOT_DTYPES, MODULATIONS):
        for name, fn, signature, constexprs, launch in aot_variants(d, dtype, modulation):
            compiled = compile_kernel(fn, signature, constexprs, target, launch.num_warps, launch.num_stages)
            rows.append(
                {"target": target, "D": d, "pass": name, "dtype": dtype, "modulation": modulation,
                 "block": f"{launch.block_r}x{launch.block_d}", **compiled.as_dict()}
            )  # fmt: skip
    return rows


def _print_aot(rows: list[dict[str, Any]]) -> None:
    keys = ["target", "D", "pass", "dtype", "modulation", "block", "num_warps", "registers", "spill_bytes"]
    keys += ["shared_bytes", "occupancy"]
    _table("Triton kernels compiled offline (Triton's ptxas; registers per thread, spills in bytes)", keys,
           [[r[k] for k in keys] for r in rows])  # fmt: skip


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--aot", default=None, help="compile for these targets only, e.g. sm_90,sm_100")
    parser.add_argument("--json", action="store_true", help="with --aot: print the report as one JSON list")
    parser.add_argument("--gpu-only", action="store_true", help="skip the CPU sections and JAX (device runs)")
    parser.add_argument("--dims", type=int, nargs="+", default=[5120, 3072], help="model widths D to time")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16_384, 65_536, WAN_TOKENS], help="sequence lengths")
    parser.add_argument("--batch", type=int, default=2, help="samples per call B (> 1 exercises the segments)")
    parser.add_argument("--hbm-peak-tbps", type=float, default=None, help="override the device's HBM peak (TB/s)")
    parser.add_argument("--train-step", action="store_true", help="also time a small Wan training step (GPU)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.aot:
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit("--aot compiles the kernels: unset TRITON_INTERPRET")
        rows = aot_report(args.aot.split(","))
        print(json.dumps(rows, indent=1)) if args.json else _print_aot(rows)
        spilled = [r for r in rows if r["spill_bytes"]]
        sys.exit(f"{len(spilled)} kernel(s) spill registers" if spilled else 0)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # Triton kernels are built at import: choose the interpreter first
        os.environ.setdefault("TRITON_INTERPRET", "1")
    print(f"# Fused AdaLN kernels: torch {torch.__version__} ({device}), "
          f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")  # fmt: skip
    command = "PYTHONPATH=operator:trainer_images python benchmarks/adaln_kernels.py"
    if not args.gpu_only:
        correctness(device)
        memory(WAN_TOKENS)
    if device == "cuda":
        gpu_timings(args.dims, args.tokens, args.batch, args.hbm_peak_tbps)
        if args.train_step:
            train_step_timing()
    else:
        print(f"\nGPU timings: no CUDA device here, so none were measured; timings need a device: `{command}`")
    if args.gpu_only:
        return
    import jax

    if jax.default_backend() == "tpu":
        tpu_timings(args.dims, args.tokens, args.hbm_peak_tbps)
    else:
        print(f"TPU timings: JAX backend is {jax.default_backend()}, not TPU; timings need a device: `{command}`")


if __name__ == "__main__":
    main()
