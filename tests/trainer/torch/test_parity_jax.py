"""Cross-backend parity: identical weights (diffusers save_pretrained -> both loaders), batch, timesteps and noise
give the same loss and gradients in the PyTorch and JAX steps (fp32), and the same one-step update through both
backends (``TorchBackend.train_step`` vs ``JaxBackend.train_step``).

Shapes are deliberately odd (3 latent frames, a 6 x 10 latent, text length 7) and samples carry different
timesteps, loss weights and one zero-weight padding row.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from wanloom_trainer.backends.jax import step as step_jax  # noqa: E402
from wanloom_trainer.backends.objective import batch_noise  # noqa: E402
from wanloom_trainer.backends.torch.step import flow_matching_loss  # noqa: E402
from wanloom_trainer.model.load import diffusers_key, load_diffusers_transformer  # noqa: E402
from wanloom_trainer.model.params import param_name  # noqa: E402
from wanloom_trainer.model.wan_torch import build_expert  # noqa: E402

LOSS_TOL, GRAD_TOL = 2e-6, 2e-5
LATENT = (3, 6, 10)


def _save_expert(variant, seed: int, folder) -> None:
    model = build_expert(variant, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for p in model.parameters():  # off the init: norm weights != 1, biases != 0
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)


def _batch(variant, ids: list[int], timesteps: list[float], weights: list[float], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shape = (variant.in_channels, *LATENT)
    return {
        "latents": rng.standard_normal((len(ids), *shape), dtype=np.float32),
        "text": rng.standard_normal((len(ids), 7, variant.text_dim), dtype=np.float32),
        "noise": batch_noise(seed, 3, ids, shape),
        "timesteps": np.asarray(timesteps, np.float32),
        "weights": np.asarray(weights, np.float32),
    }


def _torch_loss_and_grads(folder, variant, batch) -> tuple[float, dict[str, np.ndarray]]:
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(folder)
    loss, _ = flow_matching_loss(model, **{k: torch.from_numpy(v) for k, v in batch.items()})
    loss.backward()
    return float(loss.detach()), {k: p.grad.numpy() for k, p in model.named_parameters()}


def _jax_loss_and_grads(folder, variant, batch) -> tuple[float, dict[str, np.ndarray]]:
    model = load_diffusers_transformer(folder, variant)
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
    (loss, _), grads = nnx.value_and_grad(step_jax.flow_matching_loss, has_aux=True)(model, jbatch)
    return float(loss), {param_name(path): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)}


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


CASES = [
    pytest.param({}, [999.0, 500.5, 0.25], [0.5, 0.25, 0.0], id="tiny-three-timesteps-and-padding"),
    pytest.param({"num_layers": 3, "ffn_dim": 40}, [875.0, 874.9], [1.0, 2.0], id="3-layers-ffn40-boundary"),
]


@pytest.mark.parametrize(("overrides", "timesteps", "weights"), CASES)
def test_step_loss_and_every_gradient_match_jax(tiny, tmp_path, overrides, timesteps, weights) -> None:
    variant = dataclasses.replace(tiny, **overrides)
    _save_expert(variant, 0, tmp_path)
    batch = _batch(variant, list(range(len(timesteps))), timesteps, weights)
    torch_loss, torch_grads = _torch_loss_and_grads(tmp_path, variant, batch)
    jax_loss, jax_grads = _jax_loss_and_grads(tmp_path, variant, batch)
    assert abs(torch_loss - jax_loss) <= LOSS_TOL * abs(jax_loss)
    assert len(jax_grads) == len(torch_grads)
    for name, grad in jax_grads.items():
        key, to_jax_layout = diffusers_key(name, grad.ndim)
        error = _relative(to_jax_layout(torch_grads[key]), grad)
        assert error <= GRAD_TOL, f"{name}: relative gradient error {error:.2e}"
