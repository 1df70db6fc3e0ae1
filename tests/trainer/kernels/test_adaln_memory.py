"""Bytes saved for backward by the fused AdaLN vs the eager chain (torch saved-tensor hooks, JAX VJP residuals).

Target of issue 8: at least 60% less. It holds for the saved total with bf16 activations and per-sample modulation
(Wan 14B; 75% here). With per-token fp32 modulation (TI2V-5B) the fused op must keep the caller's [B, N, D] scale
itself, so the total saving is 50%; the memory the op adds on top of its inputs drops by > 99% in every case.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import pytest
import torch

from wanloom_trainer.kernels import adaln_jax, adaln_torch
from wanloom_trainer.kernels.adaln_memory import SavedBytes, residual_bytes_jax, saved_bytes_torch

B, N, D = 2, 64, 256
CASES = list(itertools.product(("bf16", "f32"), ("sample", "token")))


def _torch_inputs(dtype: str, mod: str) -> list[torch.Tensor]:
    shape = (B, N, D) if mod == "token" else (B, D)
    x = torch.randn(B, N, D, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    return [t.requires_grad_() for t in (x, torch.randn(shape), torch.randn(shape))]


def _jax_inputs(dtype: str, mod: str) -> list[jnp.ndarray]:
    shape = (B, N, D) if mod == "token" else (B, D)
    x = jnp.linspace(-2, 2, B * N * D).reshape(B, N, D).astype(jnp.bfloat16 if dtype == "bf16" else jnp.float32)
    return [x, jnp.full(shape, 0.1), jnp.full(shape, 0.2)]


def _measure(framework: str, dtype: str, mod: str) -> tuple[SavedBytes, SavedBytes, list]:
    if framework == "torch":
        args, measure, entry = _torch_inputs(dtype, mod), saved_bytes_torch, adaln_torch
    else:
        args, measure, entry = _jax_inputs(dtype, mod), residual_bytes_jax, adaln_jax
    eager = measure(lambda *a: entry(*a, impl="reference"), *args)
    fused = measure(lambda *a: entry(*a, impl="fused"), *args)
    return eager, fused, args


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_fused_saves_at_least_60_percent_for_bf16_per_sample(framework: str) -> None:
    eager, fused, _ = _measure(framework, "bf16", "sample")
    total_saving, _ = fused.saving_vs(eager)
    assert eager.total >= 8 * B * N * D  # fp32 copy of x plus fp32 x̂: the eager chain's two big residuals
    assert total_saving >= 0.60, f"{framework}: saved {total_saving:.1%} (eager {eager}, fused {fused})"


@pytest.mark.parametrize(("framework", "dtype", "mod"), [(f, *c) for f in ("torch", "jax") for c in CASES])
def test_fused_saves_exactly_its_residuals(framework: str, dtype: str, mod: str) -> None:
    eager, fused, (x, scale, _) = _measure(framework, dtype, mod)
    if framework == "jax":  # Pallas recomputes the row statistics instead of saving them
        x_bytes, scale_bytes, stats = x.nbytes, scale.nbytes, 0
    else:  # fp32 mean and rstd per row
        x_bytes, scale_bytes, stats = x.nelement() * x.element_size(), scale.nelement() * 4, 2 * 4 * B * N
    assert fused.total == x_bytes + scale_bytes + stats
    assert fused.new == stats
    _, new_saving = fused.saving_vs(eager)
    assert new_saving >= 0.99
    assert fused.total < eager.total
