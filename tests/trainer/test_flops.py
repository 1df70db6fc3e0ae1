import pytest

from wanloom_api.topology import ACCELERATOR_TYPES
from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.flops import (
    ACCELERATORS,
    flop_breakdown,
    get_accelerator,
    mfu,
    train_flop_coefficients,
    train_flops_for_latent,
    train_flops_per_sample,
    train_flops_per_step,
)

A14B = get_variant("wan2.2-t2v-a14b")
TI2V = get_variant("wan2.2-ti2v-5b")


def test_a14b_720p_reference():
    s = A14B.tokens_for_pixels(81, 720, 1280)
    assert s == 75_600
    b = flop_breakdown(A14B, s)
    assert b.train == pytest.approx(19.6e15, rel=0.01)  # ≈19.6 PFLOP per training sample
    assert b.attention_fraction == pytest.approx(0.72, abs=0.01)


def test_per_layer_terms():
    s, d, f, n, txt = 1_000, A14B.dim, A14B.ffn_dim, A14B.num_layers, A14B.text_len
    b = flop_breakdown(A14B, s)
    assert b.self_attn_proj == n * 4 * 2 * s * d * d
    assert b.self_attn_scores == n * 4 * s * s * d
    assert b.cross_attn_proj == n * 2 * 2 * s * d * d
    assert b.cross_attn_text_kv == n * 2 * 2 * txt * d * d
    assert b.cross_attn_scores == n * 2 * 2 * s * txt * d
    assert b.ffn == n * 2 * 2 * s * d * f  # two matrices (GELU), not SwiGLU's three
    assert b.train == 3 * b.forward


def test_vae_stride_comes_from_the_variant():
    # TI2V-5B compresses 16x spatially: 704x1280x121 → 27,280 tokens, not the 109,120 a hard-coded /8 would give
    assert train_flops_for_latent(TI2V, TI2V.latent_shape(121, 704, 1280)) == train_flops_per_sample(TI2V, 27_280)


def test_per_token_timesteps_scale_the_time_embedding():
    b1, b2 = flop_breakdown(TI2V, 1_000), flop_breakdown(TI2V, 2_000)
    emb_a14b = flop_breakdown(A14B, 2_000).embeddings - flop_breakdown(A14B, 1_000).embeddings
    emb_ti2v = b2.embeddings - b1.embeddings
    d = TI2V.dim
    time_mlp = 2 * (TI2V.freq_dim * d + d * d + 6 * d * d)
    patch_io = 2 * (TI2V.in_channels + TI2V.out_channels) * 4 * d
    assert emb_ti2v == pytest.approx(1_000 * (time_mlp + patch_io))
    assert emb_a14b == pytest.approx(1_000 * 2 * (A14B.in_channels + A14B.out_channels) * 4 * A14B.dim)


@pytest.mark.parametrize("name", ["wan2.2-t2v-a14b", "wan2.2-i2v-a14b", "wan2.2-ti2v-5b", "tiny"])
def test_polynomial_coefficients_match_breakdown(name):
    v = get_variant(name)
    c0, c1, c2 = train_flop_coefficients(v)
    for s in (1, 3_600, 75_600):
        assert c0 + c1 * s + c2 * s * s == pytest.approx(train_flops_per_sample(v, s), rel=1e-12)


def test_step_flops_sum_samples():
    assert train_flops_per_step(A14B, [75_600, 3_600]) == pytest.approx(
        train_flops_per_sample(A14B, 75_600) + train_flops_per_sample(A14B, 3_600)
    )
    with pytest.raises(ValueError, match="positive"):
        train_flops_per_sample(A14B, 0)


def test_peaks_table():
    assert get_accelerator("tpu7x").peak_bf16_flops == pytest.approx(2307e12)
    assert get_accelerator("tpu7x-tensorcore").peak_bf16_flops == pytest.approx(2307e12 / 2)
    assert get_accelerator("H100").peak_bf16_flops == get_accelerator("h200").peak_bf16_flops == 989e12
    assert get_accelerator("nvidia-b200").peak_bf16_flops == 2250e12
    assert set(ACCELERATORS) >= {"tpu7x", "tpu7x-tensorcore", "h100", "h200", "b200"}
    for name, accelerator in ACCELERATOR_TYPES.items():  # the node label names the same peak as the spec's type
        assert get_accelerator(accelerator.gke_label) == get_accelerator(name)
    with pytest.raises(ValueError, match="unknown accelerator 'v100'"):
        get_accelerator("v100")


def test_mfu():
    # 16 H200s doing 16 samples of 19.6 PFLOP in 100 s: 3.136e18 / (100 * 16 * 989e12)
    flops = 16 * train_flops_per_sample(A14B, 75_600)
    assert mfu(flops, 100.0, 16, "h200") == pytest.approx(flops / (100 * 16 * 989e12))
    # the same work counted per chip or per TensorCore gives the same MFU
    assert mfu(flops, 10.0, 8, "tpu7x") == pytest.approx(mfu(flops, 10.0, 16, "tpu7x-tensorcore"))
    with pytest.raises(ValueError, match="positive"):
        mfu(flops, 0.0, 1, "h100")
