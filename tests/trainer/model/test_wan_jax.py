"""Unit checks of the NNX Wan model: RoPE and timestep tables, sizes, remat, attention and AdaLN backends, errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.model.attention import splash_attention, xla_attention
from wanloom_trainer.model.embeddings import timestep_sinusoid
from wanloom_trainer.model.rope import rope_cos_sin
from wanloom_trainer.model.wan_jax import WanTransformer3DModel, abstract_model

torch = pytest.importorskip("torch")
TINY = get_variant("tiny")
GRID_SHAPE = (2, 4, 3, 6, 10)  # B, C, T', H', W': a 3 × 3 × 5 token grid


def _inputs(variant=TINY, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, variant.in_channels, *GRID_SHAPE[2:])), jnp.float32)
    context = jnp.asarray(rng.standard_normal((batch, 7, variant.text_dim)), jnp.float32)
    return x, jnp.asarray([999.0, 250.5][:batch], jnp.float32), context


@pytest.fixture(scope="module")
def tiny_model() -> WanTransformer3DModel:
    return WanTransformer3DModel(TINY, rngs=nnx.Rngs(0))


def _forward(model, *args):
    return np.asarray(nnx.jit(lambda m, *a: m(*a))(model, *args))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_rope_tables_match_diffusers_at_720p_positions() -> None:
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    # Frame and width extents of A14B 720×1280×81 after patchify (21 × 45 × 80 tokens); a short height keeps it quick.
    grid = (21, 3, 80)
    cos_ref, sin_ref = WanRotaryPosEmbed(128, (1, 2, 2), 1024)(torch.zeros(1, 16, 21, 6, 160))
    cos, sin = rope_cos_sin(grid, 128, 1024)
    # diffusers repeats each pair's angle twice (interleaved); one value per pair is enough here.
    np.testing.assert_allclose(np.asarray(cos), cos_ref[0, :, 0, 0::2].numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(sin), sin_ref[0, :, 0, 1::2].numpy(), atol=1e-6, rtol=0)


def test_rope_rejects_grids_beyond_max_seq_len() -> None:
    with pytest.raises(ValueError, match="rope_max_seq_len=1024"):
        rope_cos_sin((1, 1025, 2), 128, 1024)


def test_timestep_sinusoid_matches_diffusers() -> None:
    from diffusers.models.embeddings import get_timestep_embedding

    t = torch.tensor([0.0, 0.5, 37.25, 875.0, 999.9])
    want = get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0).numpy()
    # Angles reach ~1000 rad, where one fp32 ulp of the argument (6e-5) is what two exp() implementations differ by.
    np.testing.assert_allclose(np.asarray(timestep_sinusoid(jnp.asarray(t.numpy()), 256)), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["wan2.2-t2v-a14b", "wan2.2-i2v-a14b", "wan2.2-ti2v-5b"])
def test_parameter_shapes_match_diffusers_for_real_variants(name: str) -> None:
    """One layer of each real size (the other layers repeat it), built abstractly: no memory is allocated."""
    from diffusers import WanTransformer3DModel as TorchWan

    from wanloom_trainer.model.load import diffusers_key_map

    variant = dataclasses.replace(get_variant(name), num_layers=1)
    model = abstract_model(variant, param_dtype=jnp.bfloat16)
    with torch.device("meta"):
        reference = TorchWan(**variant.diffusers_config()).state_dict()
    key_map = diffusers_key_map(model)
    state = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert set(key_map.values()) == set(reference)
    for path, var in state.items():
        value = var.get_value()
        assert isinstance(value, jax.ShapeDtypeStruct)
        name_ = ".".join(map(str, path))
        assert value.size == reference[key_map[name_]].numel(), name_


def test_remat_policies_keep_gradients_and_save_per_layer_residuals_through_the_scan(capsys) -> None:
    """The blocks run as one scan, so what each policy saves shows as scan outputs stacked over the layers."""
    two_blocks = dataclasses.replace(TINY, num_layers=2)  # compile time dominates; two show the layer axis
    x, t, context = _inputs()
    layers, (batch, _, frames, height, width) = two_blocks.num_layers, x.shape
    seq = frames * height * width // math.prod(two_blocks.patch_size)
    residual = (layers, batch, seq, two_blocks.dim)  # each block's input, the scan's carry
    attention_core = (layers, batch, seq, two_blocks.num_heads, two_blocks.head_dim)

    def grads_and_scan_residuals(remat: str, with_grads: bool):
        # Same seed, same construction order: every policy's model holds the same parameters.
        graphdef, state = nnx.split(WanTransformer3DModel(two_blocks, rngs=nnx.Rngs(0), remat=remat))
        loss = lambda s: jnp.sum(jnp.square(nnx.merge(graphdef, s)(x, t, context)))
        capsys.readouterr()
        print_saved_residuals(loss, state)
        saved = [
            tuple(int(n) for n in re.match(r"\w+\[([\d,]*)\]", line).group(1).split(","))
            for line in capsys.readouterr().out.splitlines()
            if " output of scan " in line
        ]
        return (jax.jit(jax.grad(loss))(state) if with_grads else None), sorted(saved)

    base, base_saved = grads_and_scan_residuals("none", with_grads=True)
    for remat in ("full", "save-attention", "save-matmuls"):
        grads, saved = grads_and_scan_residuals(remat, with_grads=remat == "save-attention")
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base) if grads else [], strict=True):
            assert _rel(a, b) < 1e-5, remat  # recomputation reorders float sums, nothing more
        assert len(saved) < len(base_saved), f"{remat} must save fewer residuals than none"
        if remat == "full":
            assert saved == [residual]
        if remat == "save-attention":  # self- and cross-attention core outputs
            assert saved == sorted([residual, attention_core, attention_core])
        if remat == "save-matmuls":
            assert len(saved) > 3


def test_attention_fn_hook_replaces_every_core(tiny_model) -> None:
    calls = []

    def doubled_values(q, k, v):
        calls.append(q.shape)
        return xla_attention(q, k, 2.0 * v)

    graphdef, state = nnx.split(tiny_model)
    hooked = nnx.merge(graphdef, state)
    hooked.set_attention_fn(self_attention=doubled_values, cross_attention=doubled_values)
    x, t, context = _inputs()
    out, base = _forward(hooked, x, t, context), _forward(tiny_model, x, t, context)
    assert len(calls) == 2, "one trace of the scanned block: self- and cross-attention"
    assert _rel(out, base) > 1e-3, "the hook must actually be used"
    hooked.blocks[1].attn1.attention_fn = xla_attention
    with pytest.raises(ValueError, match="block 1 differs"):
        _forward(hooked, x, t, context)


def test_splash_attention_model_matches_xla(tiny_model) -> None:
    """The splash path (Pallas interpreter on CPU) gives the XLA result, sequence padding included."""
    graphdef, state = nnx.split(tiny_model)
    splash = nnx.merge(graphdef, state)
    splash.set_attention_fn(splash_attention, splash_attention)
    x, t, context = _inputs(batch=1)
    assert _rel(_forward(splash, x, t[:1], context), _forward(tiny_model, x, t[:1], context)) < 1e-5


@pytest.mark.slow
def test_splash_attention_core_matches_xla_with_gradients() -> None:
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 45, 2, 16))
    k, v = (jax.random.normal(key, (1, 7, 2, 16)) for key in keys[1:])
    np.testing.assert_allclose(splash_attention(q, k, v), xla_attention(q, k, v), atol=1e-5)
    grad = lambda fn: jax.grad(lambda *a: jnp.sum(jnp.square(fn(*a))), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grad(splash_attention), grad(xla_attention), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_fused_adaln_matches_reference(tiny_model, per_token: bool) -> None:
    kernels = (
        importlib.import_module("wanloom_trainer.kernels")
        if importlib.util.find_spec("wanloom_trainer.kernels")
        else None
    )
    if kernels is None or not hasattr(kernels, "adaln_jax"):
        pytest.skip("wanloom_trainer.kernels.adaln_jax is not available (kernels module absent)")
    fused = WanTransformer3DModel(TINY, rngs=nnx.Rngs(0), adaln_impl="fused")
    x, t, context = _inputs()
    if per_token:  # TI2V-style [B, S] timesteps: per-token scale/shift through the kernel
        t = jnp.broadcast_to(t[:, None], (2, 45)).at[:, :15].set(0.0)
    assert _rel(_forward(fused, x, t, context), _forward(tiny_model, x, t, context)) < 1e-5


def test_bf16_compute_stays_close_to_fp32(tiny_model) -> None:
    graphdef, state = nnx.split(tiny_model)
    bf16 = nnx.merge(graphdef, state)
    bf16_model = WanTransformer3DModel(TINY, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    nnx.update(bf16_model, jax.tree.map(lambda a, b: a.astype(b.dtype), nnx.state(bf16), nnx.state(bf16_model)))
    x, t, context = _inputs()
    out = nnx.jit(lambda m, *a: m(*a))(bf16_model, x, t, context)
    assert out.dtype == jnp.bfloat16
    assert bf16_model.blocks[0].scale_shift_table[...].dtype == jnp.float32
    assert _rel(np.asarray(out, np.float32), _forward(tiny_model, x, t, context)) < 3e-2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"adaln_impl": "triton"}, "adaln_impl='triton' is not valid; valid: fused, reference"),
        ({"remat": "some"}, "remat='some' is not valid; valid: none, full, save-matmuls, save-attention"),
        ({"attention_impl": "flash"}, "unknown attention_impl 'flash'; valid: xla, splash"),
    ],
    ids=["adaln", "remat", "attention"],
)
def test_bad_options_are_rejected(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        WanTransformer3DModel(TINY, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (((2, 5, 3, 6, 10), (2,), (2, 7, 32)), r"hidden_states must be \[B, 4, T, H, W\]"),
        (((2, 4, 3, 5, 10), (2,), (2, 7, 32)), r"must be divisible by patch_size"),
        (((2, 4, 3, 6, 10), (2, 44), (2, 7, 32)), r"per-token \[B, S\]=\[2, 45\]"),
        (((2, 4, 3, 6, 10), (2,), (2, 7, 16)), r"encoder_hidden_states must be \[B, L, 32\]"),
    ],
    ids=["channels", "patch", "timestep", "text-dim"],
)
def test_bad_inputs_name_the_argument(tiny_model, shapes, message) -> None:
    x, t, context = (jnp.zeros(shape) for shape in shapes)
    with pytest.raises(ValueError, match=message):
        tiny_model(x, t, context)


def test_remat_policies_are_the_spec_vocabulary() -> None:
    from wanloom_api import trainingjob
    from wanloom_trainer.model import wan_jax

    assert tuple(wan_jax.REMAT_POLICIES) == trainingjob.REMAT_POLICIES
