"""The NNX forward matches diffusers' WanTransformer3DModel in fp32 with the same (loaded) weights.

Shapes are deliberately not powers of two: 3 latent frames, a 6 × 10 latent (a 3 × 3 × 5 token grid), text
length 7, and a batch whose samples have different timesteps.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wanloom_trainer.model.load import load_diffusers_transformer

torch = pytest.importorskip("torch")

BATCH, FRAMES, HEIGHT, WIDTH, TEXT_LEN = 2, 3, 6, 10, 7
TOKENS = FRAMES * (HEIGHT // 2) * (WIDTH // 2)
FIRST_FRAME_TOKENS = (HEIGHT // 2) * (WIDTH // 2)
TOLERANCE = 1e-4


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def _per_sample_timesteps(generator: torch.Generator) -> torch.Tensor:
    return torch.tensor([999.0, 37.25])


def _per_token_timesteps(generator: torch.Generator) -> torch.Tensor:
    """TI2V: the condition frame's tokens are clean (t = 0); other tokens get varied fractional timesteps."""
    timestep = torch.rand(BATCH, TOKENS, generator=generator) * 1000.0
    timestep[:, :FIRST_FRAME_TOKENS] = 0.0
    return timestep


CASES = [
    pytest.param("tiny", _per_sample_timesteps, id="t2v"),
    pytest.param("tiny-ti2v", _per_token_timesteps, id="ti2v-per-token"),
    pytest.param("tiny-i2v", _per_sample_timesteps, id="i2v-condition-channels"),
]


def _forward_both(name: str, make_timestep, checkpoints, variants) -> tuple[np.ndarray, np.ndarray]:
    variant = variants[name]
    torch_model, folder = checkpoints[name]
    generator = torch.Generator().manual_seed(7)
    latents = torch.randn(BATCH, variant.in_channels, FRAMES, HEIGHT, WIDTH, generator=generator)
    text = torch.randn(BATCH, TEXT_LEN, variant.text_dim, generator=generator)
    timestep = make_timestep(generator)
    with torch.no_grad():
        want = torch_model(latents, timestep, text, return_dict=False)[0].numpy()

    model = load_diffusers_transformer(folder, variant)
    forward = nnx.jit(lambda m, x, t, c: m(x, t, c))
    got = forward(model, jnp.asarray(latents.numpy()), jnp.asarray(timestep.numpy()), jnp.asarray(text.numpy()))
    return np.asarray(got), want


@pytest.mark.parametrize(("name", "make_timestep"), CASES)
def test_forward_matches_diffusers_fp32(name, make_timestep, tiny_checkpoints, tiny_variants) -> None:
    got, want = _forward_both(name, make_timestep, tiny_checkpoints, tiny_variants)
    assert got.shape == want.shape == (BATCH, tiny_variants[name].out_channels, FRAMES, HEIGHT, WIDTH)
    assert got.dtype == np.float32
    error = relative_error(got, want)
    assert error <= TOLERANCE, f"{name}: relative error {error:.2e} > {TOLERANCE:.0e}"


def test_per_token_path_equals_per_sample_path_for_uniform_timesteps(tiny_checkpoints, tiny_variants) -> None:
    """[B, S] timesteps that are constant per sample must give the [B] result: the two branches agree."""
    _, folder = tiny_checkpoints["tiny-ti2v"]
    model = load_diffusers_transformer(folder, tiny_variants["tiny-ti2v"])
    rng = np.random.default_rng(0)
    latents = jnp.asarray(rng.standard_normal((BATCH, 4, FRAMES, HEIGHT, WIDTH)), jnp.float32)
    text = jnp.asarray(rng.standard_normal((BATCH, TEXT_LEN, 32)), jnp.float32)
    per_sample = jnp.asarray([412.5, 3.0], jnp.float32)
    per_token = jnp.repeat(per_sample[:, None], TOKENS, axis=1)
    forward = nnx.jit(lambda m, x, t, c: m(x, t, c))
    a, b = forward(model, latents, per_sample, text), forward(model, latents, per_token, text)
    assert relative_error(np.asarray(b), np.asarray(a)) < 1e-6
