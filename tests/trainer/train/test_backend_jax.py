"""The JAX backend's step on one device: masked per-expert updates, gradient accumulation, padding, checkpoints.

One backend (tiny two-expert model) is shared by the module so the step programs compile once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from wanloom_trainer.backends.interface import RankRows, Slot, StepInputs  # noqa: E402
from wanloom_trainer.backends.objective import batch_noise  # noqa: E402

SHAPE = (1, 8, 8)  # latent (T', H', W') of a 64x64 image: 16 tokens


def rows(seed: int, n: int, weights: list[float] | None = None, ids_from: int = 0) -> RankRows:
    rng = np.random.default_rng(seed)
    ids = np.arange(ids_from, ids_from + n)
    latents = rng.standard_normal((n, 4, *SHAPE)).astype(np.float32)
    return RankRows(
        sample_ids=ids,
        latents=latents,
        text=rng.standard_normal((n, 16, 32)).astype(np.float32),
        noise=batch_noise(0, 0, ids, latents.shape[1:]),
        timesteps=rng.uniform(0, 1000, n).astype(np.float32),
        weights=np.asarray(weights if weights is not None else [1.0 / n] * n, np.float32),
    )


def take(r: RankRows, idx: slice) -> RankRows:
    return RankRows(*(getattr(r, f)[idx] for f in ("sample_ids", "latents", "text", "noise", "timesteps", "weights")))


def inputs(slots: list[Slot], samples: tuple[int, int], lr: float = 1e-3) -> StepInputs:
    return StepInputs(step=0, slots=slots, num_samples=sum(samples), expert_samples=samples, learning_rates=(lr, lr))


def leaves(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_trees_equal(a: Any, b: Any) -> None:
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def assert_trees_close(a: Any, b: Any, **tol: float) -> None:
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_allclose(x, y, **tol)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory, tiny: Any) -> Any:
    from wanloom_trainer.backends.jax.backend import JaxBackend

    workdir = tmp_path_factory.mktemp("backend")
    config = tiny.tiny_config(workdir, optimizer={"clipGradNorm": 1.0, "weightDecay": 0.01})
    b = JaxBackend(config.backend_config, devices=jax.devices()[:1])
    yield b
    b.close()


@pytest.fixture(scope="module")
def initial(backend: Any) -> Any:
    state = backend.init_state()
    return state, jax.tree.map(np.asarray, state)  # a host copy: the step donates device buffers


def fresh(initial: Any) -> Any:
    return jax.tree.map(jax.numpy.asarray, initial[1])


def test_expert_without_samples_keeps_params_and_optimizer_state(backend: Any, initial: Any) -> None:
    state = fresh(initial)
    new, out = backend.train_step(state, inputs([Slot(1, {0: rows(0, 4)})], (0, 4)))
    assert_trees_equal(new.params[0], initial[1].params[0])
    assert_trees_equal(new.opt[0], initial[1].opt[0])  # moments and step count untouched
    assert any(
        not np.array_equal(a, b) for a, b in zip(leaves(new.params[1]), leaves(initial[1].params[1]), strict=True)
    )
    assert int(new.opt[1][0].count) == 1 and int(new.opt[0][0].count) == 0
    assert out.experts[0].grad_norm is None and out.experts[0].loss_sum == 0.0 and not out.experts[0].updated
    assert out.experts[1].grad_norm > 0 and out.experts[1].updated


def test_both_experts_update_when_both_get_samples(backend: Any, initial: Any) -> None:
    state = fresh(initial)
    new, out = backend.train_step(state, inputs([Slot(0, {0: rows(1, 2)}), Slot(1, {0: rows(2, 2)})], (2, 2)))
    for e in (0, 1):
        assert int(new.opt[e][0].count) == 1
        assert out.experts[e].grad_norm > 0
    assert out.loss == pytest.approx(out.experts[0].loss_sum + out.experts[1].loss_sum)


def test_gradient_accumulation_over_slots_equals_one_micro_batch(backend: Any, initial: Any) -> None:
    whole = rows(3, 4, weights=[0.25] * 4)
    split = [Slot(0, {0: take(whole, slice(0, 2))}), Slot(0, {0: take(whole, slice(2, 4))})]
    (g_one, _), loss_one, *_ = backend.accumulate_gradients(fresh(initial), [Slot(0, {0: whole})])
    (g_two, _), loss_two, *_ = backend.accumulate_gradients(fresh(initial), split)
    assert loss_two[0] == pytest.approx(loss_one[0], rel=1e-5)
    # Two partial sums against one: fp32 reassociation moves each entry by a few ulps of the largest terms that
    # meet in it, so the bound is relative to each leaf's scale, not to the (possibly tiny) entry itself.
    for a, b in zip(leaves(g_two), leaves(g_one), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
    # The parameters after AdamW: its first update is lr·g/(|g|+eps), which amplifies round-off by lr·eps/(|g|+eps)²
    # (up to 1e5 at |g| ≈ eps). Entries whose gradient is well above eps must agree to round-off.
    one, out_one = backend.train_step(fresh(initial), inputs([Slot(0, {0: whole})], (4, 0)))
    two, out_two = backend.train_step(fresh(initial), inputs(split, (4, 0)))
    assert out_two.loss == pytest.approx(out_one.loss, rel=1e-5)
    assert out_two.experts[0].grad_norm == pytest.approx(out_one.experts[0].grad_norm, rel=1e-5)
    checked = total = 0
    for p_two, p_one, g in zip(leaves(two.params[0]), leaves(one.params[0]), leaves(g_one), strict=True):
        stable = np.abs(g) > 1e-4  # 10⁴·eps: amplification ≤ lr·1e-8/1e-8 = lr
        np.testing.assert_allclose(p_two[stable], p_one[stable], rtol=1e-6, atol=1e-7)
        assert np.all(np.abs(p_two - p_one) <= 2.0 * 1e-3 + 1e-7)  # no entry moves more than a full Adam step (2·lr)
        checked, total = checked + int(stable.sum()), total + g.size
    assert checked > 0.9 * total, f"only {checked} of {total} entries have a gradient above 1e-4"


def test_padding_rows_with_zero_weight_change_nothing(backend: Any, initial: Any) -> None:
    three = rows(4, 3, weights=[1 / 3] * 3)  # padded to 4 rows inside the backend
    base, out_base = backend.train_step(fresh(initial), inputs([Slot(0, {0: three})], (3, 0)))
    noisy = rows(5, 4, weights=[1 / 3] * 3 + [0.0])
    padded = RankRows(
        *(np.concatenate([getattr(three, f), getattr(noisy, f)[3:]]) for f in ("sample_ids", "latents", "text")),
        noise=np.concatenate([three.noise, noisy.noise[3:]]),
        timesteps=np.concatenate([three.timesteps, noisy.timesteps[3:]]),
        weights=noisy.weights,
    )
    other, out_other = backend.train_step(fresh(initial), inputs([Slot(0, {0: padded})], (3, 0)))
    assert out_other.loss == pytest.approx(out_base.loss, rel=1e-6)
    assert_trees_close(other.params[0], base.params[0], rtol=1e-6, atol=1e-8)


def test_clipping_reports_the_norm_before_clipping(backend: Any, initial: Any) -> None:
    big = rows(6, 2, weights=[50.0, 50.0])  # a huge loss scale: the raw norm exceeds clipGradNorm=1
    _, out = backend.train_step(fresh(initial), inputs([Slot(0, {0: big})], (2, 0)))
    assert out.experts[0].grad_norm > 1.0


def test_save_and_restore_without_a_template(backend: Any, initial: Any) -> None:
    state, _ = backend.train_step(fresh(initial), inputs([Slot(0, {0: rows(7, 2)})], (2, 0)))
    backend.save(state, 5, {"next_step": 5, "seed": 0})
    backend._checkpointer.wait()
    restored = backend.restore()
    assert restored.next_step == 5 and restored.meta["seed"] == 0
    assert_trees_equal(restored.state.params, state.params)
    assert_trees_equal(restored.state.opt, state.opt)
    assert Path(backend.config.checkpoint.uri, "5", "state").is_dir()
