"""Fused AdaLN kernels: correctness, bytes saved for backward, and (on a device) timings at Wan shapes.

    PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/adaln_kernels.py            # any machine
    PYTHONPATH=operator:trainer_images python benchmarks/adaln_kernels.py --dims 5120 3072 --tokens 16384 75600

Sections, each printed as a table of ratios measured side by side in one run:
1. Correctness of both kernels against the plain references at small shapes (CPU: Triton and Pallas interpreters).
2. Bytes saved for backward, fused vs eager (torch saved-tensor hooks, JAX VJP residuals), measured at N = 64 and
   N = 128 and extended to N = 75,600 exactly (the bytes are affine in N).
3. GPU (PyTorch + Triton): forward/backward time, effective bandwidth as a fraction of HBM peak, speedup over eager
   and over torch.compile. Inputs are hundreds of MB (L2 is 50 MB on H100/H200); do_bench flushes L2 between runs.
4. TPU (JAX + Pallas): the same against XLA.
Sections 3 and 4 run only where the device exists; on CPU the script says that timings need a device.
Targets (GPU): forward >= 85% of HBM peak, backward >= 70%, forward >= 3x eager.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available():  # Triton kernels are built at import: choose the interpreter first
    os.environ.setdefault("TRITON_INTERPRET", "1")

import jax
import jax.numpy as jnp

from wanloom_trainer.kernels import adaln_jax, adaln_torch
from wanloom_trainer.kernels.adaln_memory import SavedBytes, residual_bytes_jax, saved_bytes_torch

HBM_PEAK_BYTES_S = {  # by substring of the device name, most specific first
    "H200": 4.8e12,
    "H100": 3.35e12,
    "B200": 8.0e12,
    "A100": 2.0e12,
    "L40S": 0.864e12,
    "TPU7x": 7.37e12,
    "TPU v7": 7.37e12,
    "TPU v6": 1.64e12,
    "TPU v5p": 2.765e12,
    "TPU v5": 0.819e12,
}
WAN_TOKENS = 75_600  # Wan 2.2 A14B, 81 frames at 1280x720: 21 x 45 x 80 latent patches


def _table(title: str, header: list[str], rows: list[list[object]]) -> None:
    print(f"\n## {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row) + " |")


# ------------------------------------------------------------------------------------------------ 1. correctness


def _torch_case(b: int, n: int, d: int, per_token: bool, dtype: torch.dtype, device: str):
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


def _torch_error(b: int, n: int, d: int, per_token: bool, dtype: torch.dtype, device: str) -> float:
    x, scale, shift, dy = _torch_case(b, n, d, per_token, dtype, device)
    outs = []
    for impl in ("fused", "reference"):
        y = adaln_torch(x, scale, shift, impl=impl)
        outs.append([y, *torch.autograd.grad(y, (x, scale, shift), dy)])
    return max(_rel(a.detach().double(), b.detach().double()) for a, b in zip(*outs, strict=True))


def _jax_error(b: int, n: int, d: int, per_token: bool, dtype: jnp.dtype) -> float:
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


def _saved(framework: str, impl: str, n: int, d: int, per_token: bool, dtype: str) -> SavedBytes:
    mod = (1, n, d) if per_token else (1, d)
    if framework == "torch":
        x_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        args = _torch_case(1, n, d, per_token, x_dtype, "cuda" if torch.cuda.is_available() else "cpu")[:3]
        return saved_bytes_torch(lambda *a: adaln_torch(*a, impl=impl), *args)
    x = jnp.ones((1, n, d), jnp.bfloat16 if dtype == "bf16" else jnp.float32)
    return residual_bytes_jax(lambda *a: adaln_jax(*a, impl=impl), x, jnp.ones(mod), jnp.ones(mod))


def _saved_at(framework: str, impl: str, n: int, d: int, per_token: bool, dtype: str) -> SavedBytes:
    """Bytes at sequence length n from measurements at N = 64 and 128 (saved bytes are affine in N)."""
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
    if override_tbps:
        return override_tbps * 1e12
    return next((peak for key, peak in HBM_PEAK_BYTES_S.items() if key in device_name), None)


def _traffic(n: int, d: int, per_token: bool, x_item: int, stats: bool) -> tuple[int, int]:
    """Minimal HBM bytes (forward, backward) of one fused call, B = 1, fp32 modulation, column sums kept on chip."""
    elems = n * d
    mod = 4 * (elems if per_token else d)
    row_stats = 8 * n if stats else 0
    forward = 2 * elems * x_item + 2 * mod + row_stats  # read x, scale, shift; write y (and mean, rstd)
    backward = 3 * elems * x_item + 3 * mod + row_stats  # read x, dy, scale (and stats); write dx, d_scale, d_shift
    return forward, backward


def _gpu_row(d: int, n: int, per_token: bool, peak: float | None) -> list[object]:
    import triton.testing

    from wanloom_trainer.kernels.adaln_ref_torch import adaln_reference_torch

    x, scale, shift, dy = _torch_case(1, n, d, per_token, torch.bfloat16, "cuda")
    impls = {
        "fused": lambda *a: adaln_torch(*a, impl="fused"),
        "eager": adaln_reference_torch,
        "compile": torch.compile(adaln_reference_torch),
    }
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
    fwd_bytes, bwd_bytes = _traffic(n, d, per_token, 2, stats=True)
    (f_ms, b_ms), (ef, eb), (cf, cb) = times["fused"], times["eager"], times["compile"]
    frac = lambda nbytes, ms: f"{nbytes / (ms * 1e-3) / peak:.0%}" if peak else "n/a"
    return [
        d,
        n,
        "per token" if per_token else "per sample",
        f"{f_ms:.3f}",
        frac(fwd_bytes, f_ms),
        ef / f_ms,
        cf / f_ms,
        f"{b_ms:.3f}",
        frac(bwd_bytes, b_ms),
        eb / b_ms,
        cb / b_ms,
    ]


def gpu_timings(dims: list[int], tokens: list[int], peak_override: float | None) -> None:
    name = torch.cuda.get_device_name()
    peak = _hbm_peak(name, peak_override)
    rows = [_gpu_row(d, n, per_token, peak) for d in dims for n in tokens for per_token in (False, True)]
    _table(
        f"GPU timings, bf16 x, fp32 modulation, B = 1 ({name}, HBM peak "
        f"{peak / 1e12 if peak else 'unknown'} TB/s; targets fwd >= 85%, bwd >= 70%, fwd >= 3x eager)",
        [
            "D",
            "N",
            "modulation",
            "fwd ms",
            "fwd %HBM",
            "fwd x eager",
            "fwd x compile",
            "bwd ms",
            "bwd %HBM",
            "bwd x eager",
            "bwd x compile",
        ],
        rows,
    )


def _time_jax(fn: Callable[..., object], *args: object, reps: int = 20) -> float:
    """Median wall milliseconds of a jitted call (after a compile-and-warm-up call)."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _tpu_row(d: int, n: int, per_token: bool, peak: float | None) -> list[object]:
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
    fwd_bytes, bwd_bytes = _traffic(n, d, per_token, 2, stats=False)
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


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[5120, 3072], help="model widths D to time")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16_384, WAN_TOKENS], help="sequence lengths N")
    parser.add_argument("--hbm-peak-tbps", type=float, default=None, help="override the device's HBM peak (TB/s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"# Fused AdaLN kernels: torch {torch.__version__} ({device}), jax {jax.__version__} "
        f"({jax.default_backend()}), TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
    )
    correctness(device)
    memory(WAN_TOKENS)
    command = "PYTHONPATH=operator:trainer_images python benchmarks/adaln_kernels.py"
    if device == "cuda":
        gpu_timings(args.dims, args.tokens, args.hbm_peak_tbps)
    else:
        print(f"\nGPU timings: no CUDA device here, so none were measured; timings need a device: `{command}`")
    if jax.default_backend() == "tpu":
        tpu_timings(args.dims, args.tokens, args.hbm_peak_tbps)
    else:
        print(f"TPU timings: JAX backend is {jax.default_backend()}, not TPU; timings need a device: `{command}`")


if __name__ == "__main__":
    main()
