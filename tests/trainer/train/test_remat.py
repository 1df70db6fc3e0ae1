"""spec.parallelism.remat: every policy computes the same gradient, and each saves what it says it saves."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.ad_checkpoint import print_saved_residuals  # noqa: E402

from wanloom_trainer.backends.jax.step import flow_matching_loss  # noqa: E402
from wanloom_trainer.config.variants import get_variant  # noqa: E402
from wanloom_trainer.model.wan_jax import init_model  # noqa: E402


def _batch() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    lat = lambda: jnp.asarray(rng.standard_normal((2, 4, 1, 8, 8)), jnp.float32)
    return {
        "latents": lat(),
        "noise": lat(),
        "text": jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.float32),
        "timesteps": jnp.array([100.0, 900.0], jnp.float32),
        "weights": jnp.array([0.5, 0.5], jnp.float32),
    }


def _loss_and_residuals(remat: str) -> tuple[object, object, str]:
    graphdef, params = nnx.split(init_model(get_variant("tiny"), seed=0, remat=remat), nnx.Param)
    loss = lambda p, batch: flow_matching_loss(nnx.merge(graphdef, p), batch)[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(loss, params, _batch())
    return params, jax.jit(jax.value_and_grad(loss))(params, _batch()), out.getvalue()


@pytest.mark.slow
def test_remat_policies_agree_and_save_what_they_name() -> None:
    results = {name: _loss_and_residuals(name) for name in ("none", "full", "save-matmuls", "save-attention")}
    (ref_loss, ref_grads), saved = results["none"][1], {k: len(v[2].splitlines()) for k, v in results.items()}
    for name, (_, (loss, grads), _) in results.items():
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6), name
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6, err_msg=name)
    assert saved["full"] < saved["save-attention"] < saved["none"], saved
    assert saved["full"] < saved["save-matmuls"] < saved["none"], saved
    # What the blocks' scan keeps per layer: the block input, plus the two attention outputs under save-attention.
    per_layer = {k: v[2].count(" output of scan ") for k, v in results.items()}
    assert per_layer["full"] == 1 and per_layer["save-attention"] == 3, per_layer
