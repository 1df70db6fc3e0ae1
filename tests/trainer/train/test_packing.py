"""Packed micro-batches: several samples of different shapes in one row give the loss and gradients of the same
samples run one by one (the parity the SPMD packer relies on), for the three model layouts.

Tolerance: float32 throughout; packed and unpacked runs differ only in summation order (attention over a masked
row vs the sample alone, segment sums vs per-sample means), so values agree to ~1e-6 relative and gradients to
~1e-5 of their largest entry; the bounds below leave a factor of ~5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wanloom_trainer.backends.interface import RankRows
from wanloom_trainer.backends.jax.step import flow_matching_loss, packed_flow_matching_loss
from wanloom_trainer.backends.objective import batch_noise
from wanloom_trainer.backends.packing import grid_positions, pack_rows, patchify
from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.model.wan_jax import init_model

# (latent T', H', W') of the samples: an image, clips of two sizes, another image; two rows of 64 tokens.
SHAPES = [(1, 8, 8), (3, 4, 8), (2, 8, 4), (1, 4, 4), (5, 4, 4)]
ROWS = [[0, 1], [2, 3, 4]]  # tokens: 16 + 24 (+24 padding), 16 + 4 + 20 (+24 padding)


def _sample(variant, i: int, shape: tuple[int, int, int], rng: np.random.Generator, clean: float | None) -> RankRows:
    latents = rng.standard_normal((1, variant.latent_channels, *shape)).astype(np.float32)
    cond = None
    if variant.condition_channels:
        cond = rng.standard_normal((1, variant.condition_channels, *shape)).astype(np.float32)
    return RankRows(
        sample_ids=np.array([i]),
        latents=latents,
        text=rng.standard_normal((1, variant.text_len, variant.text_dim)).astype(np.float32),
        noise=batch_noise(0, 0, [i], latents.shape[1:]),
        timesteps=np.array([100.0 + 180.0 * i], np.float32),
        weights=np.array([0.1 * (i + 1)], np.float32),
        condition=cond,
        clean_first_frame=None if clean is None else np.array([clean], np.float32),
    )


def _unpacked_batch(rows: RankRows) -> dict[str, jax.Array]:
    keys = ("latents", "text", "noise", "timesteps", "weights", "condition", "clean_first_frame")
    return {k: jnp.asarray(getattr(rows, k)) for k in keys if getattr(rows, k) is not None}


def _packed_batch(packed) -> dict[str, jax.Array]:
    keys = ("latents", "noise", "condition", "positions", "segment_ids", "text", "timesteps", "weights")
    batch = {k: jnp.asarray(getattr(packed, k)) for k in keys if getattr(packed, k) is not None}
    if packed.clean_first_frame is not None:
        batch["clean_first_frame"] = jnp.asarray(packed.clean_first_frame)
    return batch


def _max_rel(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant_name", "adaln", "attention"),
    [("tiny", "reference", "xla"), ("tiny-i2v", "reference", "xla"), ("tiny-ti2v", "reference", "xla"),
     ("tiny", "fused", "splash")],
)  # fmt: skip
def test_packed_rows_give_the_loss_and_gradients_of_the_samples_one_by_one(
    variant_name: str, adaln: str, attention: str
) -> None:
    variant = get_variant(variant_name)
    rng = np.random.default_rng(0)
    clean = [1.0, 0.0, 1.0, 0.0, 1.0] if variant.per_token_timesteps else [None] * 5
    samples = [_sample(variant, i, s, rng, clean[i]) for i, s in enumerate(SHAPES)]
    model = init_model(variant, seed=1, adaln_impl=adaln, attention_impl=attention)
    graphdef, params = nnx.split(model, nnx.Param)

    def unpacked(params):
        m = nnx.merge(graphdef, params)
        return sum(flow_matching_loss(m, _unpacked_batch(s))[0] for s in samples)

    packed_rows = pack_rows(
        [[samples[i] for i in row] for row in ROWS], row_tokens=64, groups=4, patch=variant.patch_size,
        max_segment_tokens=32,
    )  # fmt: skip
    batch = _packed_batch(packed_rows)

    def packed(params):
        return packed_flow_matching_loss(nnx.merge(graphdef, params), batch, max_segment_tokens=32)[0]

    want, want_grads = jax.jit(jax.value_and_grad(unpacked))(params)
    got, got_grads = jax.jit(jax.value_and_grad(packed))(params)
    np.testing.assert_allclose(got, want, rtol=5e-6)
    errors = jax.tree.map(_max_rel, got_grads, want_grads)
    worst = max(jax.tree.leaves(errors))
    assert worst < 5e-5, worst


def test_patchify_matches_the_patch_embedding_convolution() -> None:
    """The packed model embeds patches with the convolution's kernel as one matmul: same tokens as the conv."""
    variant = get_variant("tiny")
    model = init_model(variant, seed=0)
    x = np.random.default_rng(1).standard_normal((variant.in_channels, 3, 8, 6)).astype(np.float32)
    conv = model.patch_embedding(jnp.moveaxis(jnp.asarray(x)[None], 1, -1)).reshape(-1, variant.dim)
    kernel = model.patch_embedding.kernel[...].reshape(-1, variant.dim)
    tokens = patchify(x, variant.patch_size).reshape(len(conv), -1) @ kernel + model.patch_embedding.bias[...]
    np.testing.assert_allclose(tokens, conv, rtol=1e-5, atol=1e-6)
    assert grid_positions((3, 4, 3))[13].tolist() == [1, 0, 1]


def test_rows_that_do_not_fit_are_refused_naming_the_row() -> None:
    variant = get_variant("tiny")
    rng = np.random.default_rng(0)
    samples = [_sample(variant, i, s, rng, None) for i, s in enumerate(SHAPES)]
    with pytest.raises(ValueError, match=r"packed row 1: sample 1 \(24 tokens\) does not fit after 16 tokens"):
        pack_rows([[samples[0]], [samples[0], samples[1]]], row_tokens=32, groups=4, patch=(1, 2, 2),
                  max_segment_tokens=32)  # fmt: skip
    with pytest.raises(ValueError, match="packed row 0: 2 samples and padding need more than 2 segment slots"):
        pack_rows([[samples[0], samples[3]]], row_tokens=64, groups=2, patch=(1, 2, 2), max_segment_tokens=32)
