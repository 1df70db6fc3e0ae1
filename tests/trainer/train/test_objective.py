"""The flow-matching objective: shared numpy pieces, and the JAX loss against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from wanloom_trainer.backends.objective import (
    batch_noise,
    flow_matching_loss_np,
    noisy_latents_np,
    sample_noise,
    velocity_target_np,
)

SHAPE = (4, 3, 8, 8)


def test_noise_is_a_pure_function_of_seed_step_and_sample() -> None:
    a = sample_noise(1, 7, 42, SHAPE)
    assert a.dtype == np.float32 and a.shape == SHAPE
    np.testing.assert_array_equal(a, sample_noise(1, 7, 42, SHAPE))
    for other in (sample_noise(2, 7, 42, SHAPE), sample_noise(1, 8, 42, SHAPE), sample_noise(1, 7, 43, SHAPE)):
        assert not np.allclose(a, other)
    batch = batch_noise(1, 7, [42, -1, 43], SHAPE)
    np.testing.assert_array_equal(batch[0], a)
    np.testing.assert_array_equal(batch[1], 0.0)  # placeholder rows (id -1) carry no weight and get no draw
    assert abs(float(a.std()) - 1.0) < 0.1


def test_interpolation_endpoints_and_target() -> None:
    x0, eps = np.full((2, *SHAPE), 3.0, np.float32), np.full((2, *SHAPE), -1.0, np.float32)
    x_t = noisy_latents_np(x0, eps, np.array([0.0, 1000.0], np.float32))
    np.testing.assert_allclose(x_t[0], 3.0)  # σ = 0: clean
    np.testing.assert_allclose(x_t[1], -1.0)  # σ = 1: pure noise
    np.testing.assert_allclose(velocity_target_np(x0, eps), -4.0)


def _fake_model(xp):
    """A deterministic stand-in for the transformer: depends on x_t, t and the text in a known way."""

    def model(x_t, t, text):
        assert str(t.dtype) == "float32"  # timesteps are never rounded to bf16
        scale = (t / 1000.0).reshape((-1,) + (1,) * (x_t.ndim - 1))
        return 0.5 * x_t + scale + xp.mean(text, axis=(1, 2)).reshape(scale.shape)

    return model


def test_jax_loss_matches_the_numpy_reference() -> None:
    import jax.numpy as jnp

    from wanloom_trainer.backends.jax.step import flow_matching_loss

    rng = np.random.default_rng(0)
    b = 5
    x0 = rng.standard_normal((b, *SHAPE)).astype(np.float32)
    eps = batch_noise(0, 3, range(b), SHAPE)
    t = np.array([0.5, 250.0, 874.9, 875.0, 999.9], np.float32)
    text = rng.standard_normal((b, 6, 8)).astype(np.float32)
    weights = np.array([0.2, 0.2, 0.0, 0.2, 0.2], np.float32)  # row 2 is padding
    batch = {k: jnp.asarray(v) for k, v in dict(latents=x0, noise=eps, timesteps=t, text=text, weights=weights).items()}
    loss, per_sample = flow_matching_loss(_fake_model(jnp), batch)

    prediction = _fake_model(np)(noisy_latents_np(x0, eps, t), t, text)
    expected = flow_matching_loss_np(prediction, x0, eps, weights, num_samples=1)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    reference = np.mean((prediction - velocity_target_np(x0, eps)) ** 2, axis=(1, 2, 3, 4))
    np.testing.assert_allclose(np.asarray(per_sample), reference, rtol=1e-5)


def test_zero_weight_rows_do_not_contribute() -> None:
    import jax.numpy as jnp

    from wanloom_trainer.backends.jax.step import flow_matching_loss

    rng = np.random.default_rng(1)
    x0 = rng.standard_normal((3, *SHAPE)).astype(np.float32)
    base = dict(
        latents=x0,
        noise=batch_noise(0, 0, range(3), SHAPE),
        timesteps=np.array([100, 500, 900], np.float32),
        text=np.zeros((3, 2, 4), np.float32),
    )
    with_pad = {**base, "weights": np.array([0.5, 0.5, 0.0], np.float32)}
    garbage = {**with_pad, "latents": x0.copy()}
    garbage["latents"][2] = 1e6  # a padding row's content cannot matter
    a, _ = flow_matching_loss(_fake_model(jnp), {k: jnp.asarray(v) for k, v in with_pad.items()})
    b, _ = flow_matching_loss(_fake_model(jnp), {k: jnp.asarray(v) for k, v in garbage.items()})
    assert float(a) == float(b)


def test_clean_first_frames_are_a_pure_draw_that_skips_images_and_placeholders() -> None:
    from wanloom_trainer.backends.objective import clean_first_frames

    ids = list(range(4000))
    a = clean_first_frames(3, 5, ids, latent_frames=3, fraction=0.3)
    np.testing.assert_array_equal(a, clean_first_frames(3, 5, ids, latent_frames=3, fraction=0.3))
    assert not np.array_equal(a, clean_first_frames(3, 6, ids, latent_frames=3, fraction=0.3))
    # Binomial(4000, 0.3): σ = 29 samples; 4σ either side.
    assert abs(a.sum() - 1200) < 4 * 29
    assert not clean_first_frames(3, 5, ids, latent_frames=1, fraction=1.0).any()  # an image has no other frame
    np.testing.assert_array_equal(clean_first_frames(3, 5, [7, -1], latent_frames=2, fraction=1.0), [1.0, 0.0])


class _PerTokenModel:
    """A stand-in transformer with per-token timesteps: records what it is given, predicts from x_t and t."""

    def __init__(self, patch: tuple[int, int, int]) -> None:
        from types import SimpleNamespace

        self.variant = SimpleNamespace(patch_size=patch)
        self.seen: dict = {}

    def __call__(self, x_t, t, text):
        import jax.numpy as jnp

        self.seen.update(x_t=np.asarray(x_t), t=np.asarray(t))
        b, _, frames, h, w = x_t.shape
        t_grid = jnp.reshape(t, (b, 1, frames, h // 2, w // 2)).repeat(2, axis=3).repeat(2, axis=4)
        return 0.5 * x_t + t_grid / 1000.0 + jnp.mean(text, axis=(1, 2)).reshape((b, 1, 1, 1, 1))


def test_image_to_video_rows_keep_frame_zero_clean_and_out_of_the_loss() -> None:
    """Rows 0 and 2 train image-to-video: σ = 0 and t = 0 on latent frame 0, loss over frames 1..T'-1."""
    import jax.numpy as jnp

    from wanloom_trainer.backends.jax.step import flow_matching_loss
    from wanloom_trainer.backends.objective import frame_timesteps_np

    rng = np.random.default_rng(2)
    b, shape = 3, (4, 3, 8, 8)
    x0 = rng.standard_normal((b, *shape)).astype(np.float32)
    eps = batch_noise(0, 1, range(b), shape)
    t = np.array([700.0, 300.0, 999.0], np.float32)
    clean = np.array([1.0, 0.0, 1.0], np.float32)
    text = rng.standard_normal((b, 6, 8)).astype(np.float32)
    weights = np.array([0.5, 0.25, 0.25], np.float32)
    batch = dict(latents=x0, noise=eps, timesteps=t, text=text, weights=weights, clean_first_frame=clean)
    model = _PerTokenModel((1, 2, 2))
    loss, per_sample = flow_matching_loss(model, {k: jnp.asarray(v) for k, v in batch.items()})

    t_frames = frame_timesteps_np(t, clean, frames := shape[1])
    np.testing.assert_array_equal(t_frames[:, 0], [0.0, 300.0, 0.0])
    tokens_per_frame = (shape[2] // 2) * (shape[3] // 2)
    np.testing.assert_array_equal(model.seen["t"], np.repeat(t_frames, tokens_per_frame, axis=1))
    np.testing.assert_array_equal(model.seen["x_t"][[0, 2], :, 0], x0[[0, 2], :, 0])  # clean first frame
    x_t = noisy_latents_np(x0, eps, t_frames)
    np.testing.assert_allclose(model.seen["x_t"], x_t, rtol=1e-6, atol=1e-6)
    prediction = np.asarray(model(jnp.asarray(x_t), jnp.asarray(np.repeat(t_frames, tokens_per_frame, 1)), text))
    expected = flow_matching_loss_np(prediction, x0, eps, weights, num_samples=1, clean_first_frame=clean)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    whole = np.mean((prediction - velocity_target_np(x0, eps)) ** 2, axis=(1, 2, 3, 4))
    assert float(per_sample[1]) == pytest.approx(whole[1], rel=1e-5)  # the text-to-video row: every frame
    assert frames == 3 and abs(float(per_sample[0]) - whole[0]) > 1e-3  # frame 0 really left out


def test_image_to_video_loss_ignores_the_prediction_on_the_clean_frame() -> None:
    import jax.numpy as jnp

    from wanloom_trainer.backends.jax.step import flow_matching_loss

    rng = np.random.default_rng(3)
    b, shape = 2, (4, 2, 4, 4)
    batch = dict(
        latents=rng.standard_normal((b, *shape)).astype(np.float32),
        noise=batch_noise(0, 0, range(b), shape),
        timesteps=np.array([400.0, 600.0], np.float32),
        text=np.zeros((b, 2, 4), np.float32),
        weights=np.ones(b, np.float32),
        clean_first_frame=np.ones(b, np.float32),
    )
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    base = _PerTokenModel((1, 2, 2))

    def spoiled(x_t, t, text):
        return base(x_t, t, text).at[:, :, 0].set(1e6)

    spoiled.variant = base.variant
    assert float(flow_matching_loss(base, batch)[0]) == float(flow_matching_loss(spoiled, batch)[0])


def test_caption_dropout_is_a_pure_draw_that_skips_placeholders() -> None:
    from wanloom_trainer.backends.objective import caption_dropped

    ids = np.arange(4000)
    dropped = caption_dropped(7, 3, ids, 0.1)
    assert 0.08 < dropped.mean() < 0.12
    np.testing.assert_array_equal(dropped, caption_dropped(7, 3, ids, 0.1))  # a resumed step drops the same rows
    assert (dropped != caption_dropped(7, 4, ids, 0.1)).any()  # a new draw every step
    assert not caption_dropped(7, 3, [-1] * 100, 0.99).any()
    assert not caption_dropped(7, 3, ids, 0.0).any()


def test_dropped_rows_train_on_the_empty_prompt() -> None:
    from types import SimpleNamespace

    from wanloom_trainer.backends.objective import caption_dropped
    from wanloom_trainer.feed.inputs import rank_rows

    b, length, dim = 64, 5, 3
    rng = np.random.default_rng(0)
    batch = SimpleNamespace(
        sample_ids=np.arange(b), latents=rng.standard_normal((b, 4, 1, 2, 2), dtype=np.float32),
        text_embeds=rng.standard_normal((b, length, dim), dtype=np.float32), condition=None,
    )  # fmt: skip
    empty = np.zeros((length, dim), np.float32)
    empty[0] = 9.0
    rows = rank_rows(batch, np.full(b, 500.0), np.ones(b), seed=1, step=2, loss_weighting="none",
                     caption_dropout=0.5, empty_text=empty)  # fmt: skip
    dropped = caption_dropped(1, 2, np.arange(b), 0.5)
    assert 0 < dropped.sum() < b
    np.testing.assert_array_equal(rows.text[dropped], np.broadcast_to(empty, (dropped.sum(), length, dim)))
    np.testing.assert_array_equal(rows.text[~dropped], batch.text_embeds[~dropped])
    with pytest.raises(ValueError, match="empty-prompt embedding"):
        rank_rows(batch, np.full(b, 500.0), np.ones(b), seed=1, step=2, loss_weighting="none", caption_dropout=0.5)
