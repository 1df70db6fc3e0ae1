"""The JAX Wan VAE against diffusers' ``AutoencoderKLWan``, float32 on the CPU: Wan 2.1's layout (16-channel style,
temporal down/upsampling, attention in the middle) and Wan 2.2's (residual blocks, average-down and duplicate-up
shortcuts, patchify), on an odd clip, an image batch, a short clip and one whose frames are not 1 + 4k; latents
(posterior means) and reconstructions within 1e-4 relative, and the bfloat16 error stated. The encoder and decoder
run chunk by chunk as the reference does, so their memory does not grow with the clip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from wanloom_trainer.model.encoders import vae_jax

WAN21 = {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1}
WAN22 = {
    **WAN21, "decoder_base_dim": 12, "z_dim": 6, "num_res_blocks": 2, "is_residual": True, "patch_size": 2,
    "in_channels": 12, "out_channels": 12, "scale_factor_spatial": 16,
}  # fmt: skip
CASES = {
    "wan2.1-17x272x480": ({**WAN21, "base_dim": 4}, (1, 17, 272, 480)),
    "wan2.1-images-2x1x96x160": (WAN21, (2, 1, 96, 160)),
    "wan2.2-9x96x160": (WAN22, (1, 9, 96, 160)),
    "wan2.1-7x64x96": (WAN21, (1, 7, 64, 96)),  # the reference leaves the last 2 frames out: 1 + 4 are encoded
}


def _vae(kw: dict[str, Any], folder: Path) -> Any:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    z = kw["z_dim"]
    vae = AutoencoderKLWan(
        **kw, latents_mean=[0.1 * i for i in range(z)], latents_std=[0.5 + 0.1 * i for i in range(z)]
    )
    with torch.no_grad():  # norms away from 1, so a wrong gamma cannot hide
        for name, param in vae.named_parameters():
            if name.endswith("gamma"):
                param.add_(torch.randn_like(param) * 0.2)
    vae.eval().save_pretrained(folder)
    return vae


def _rel(got: Any, want: np.ndarray) -> float:
    return float(np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.slow
def test_latents_and_reconstructions_match_diffusers(case: str, tmp_path: Path) -> None:
    kw, (b, f, h, w) = CASES[case]
    vae = _vae(kw, tmp_path / "vae")
    pixels = torch.rand(b, 3, f, h, w, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        mu = vae.encode(pixels).latent_dist.mode()
        reconstruction = vae.decode(mu).sample
    mu_ref, rec_ref = mu.permute(0, 2, 3, 4, 1).numpy(), reconstruction.permute(0, 2, 3, 4, 1).numpy()

    cfg, params = vae_jax.load_vae(tmp_path / "vae")
    x = jnp.asarray(pixels.permute(0, 2, 3, 4, 1).numpy())
    encode = jax.jit(lambda p, x: vae_jax.encode(p, cfg, x))  # jitted, as the encoders run it (and faster)
    got_mu = encode(params, x)
    assert got_mu.shape == mu_ref.shape and _rel(got_mu, mu_ref) <= 1e-4
    got_rec = jax.jit(lambda p, z: vae_jax.decode(p, cfg, z))(params, jnp.asarray(mu_ref))
    assert got_rec.shape == rec_ref.shape and _rel(got_rec, rec_ref) <= 1e-4
    z = vae_jax.normalize(cfg, got_mu)
    np.testing.assert_allclose(vae_jax.denormalize(cfg, z), got_mu, rtol=1e-5, atol=1e-6)

    if f * h * w > 2e6:
        return  # the bfloat16 figure comes from the smaller cases (CPU time)
    cfg16, params16 = vae_jax.load_vae(tmp_path / "vae", jnp.bfloat16)
    bf16 = _rel(jax.jit(lambda p, x: vae_jax.encode(p, cfg16, x))(params16, x.astype(jnp.bfloat16)), mu_ref)
    print(f"{case}: bfloat16 latents within {bf16:.1e} of float32 diffusers")
    assert bf16 <= 5e-2


def test_memory_stays_that_of_one_chunk_as_the_clip_grows() -> None:
    """Compiled (XLA's own memory figure, as the TPU batch choice reads it) for 17 and 65 frames: a whole-clip
    forward needs ~3.8x the scratch memory for the longer clip; the chunked one only its larger input and output."""
    cfg = vae_jax.VaeConfig(8, 8, 4, (1, 2, 2, 2), 1, (), (False, True, True), False, None, (0.0,) * 4,
                            (1.0,) * 4, 4, 8)  # fmt: skip
    params = jax.eval_shape(lambda: vae_jax.random_params(cfg, 0))

    def scratch(frames: int) -> tuple[int, int]:
        x = jax.ShapeDtypeStruct((1, frames, 64, 96, 3), jnp.float32)
        z = jax.ShapeDtypeStruct((1, (frames - 1) // 4 + 1, 8, 12, 4), jnp.float32)
        encode = jax.jit(lambda p, x: vae_jax.encode(p, cfg, x)).lower(params, x).compile()
        decode = jax.jit(lambda p, z: vae_jax.decode(p, cfg, z)).lower(params, z).compile()
        return encode.memory_analysis().temp_size_in_bytes, decode.memory_analysis().temp_size_in_bytes

    (enc_short, dec_short), (enc_long, dec_long) = scratch(17), scratch(65)
    assert enc_long / enc_short < 2.0, (enc_short, enc_long)
    assert dec_long / dec_short < 2.0, (dec_short, dec_long)
