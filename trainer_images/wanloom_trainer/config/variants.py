"""Wan model sizes as one table, keyed by the TrainingJob's ``model.variant``.

Numbers follow the official Wan 2.2 configs and diffusers' ``WanTransformer3DModel`` (see docs/architecture.md).
Routing defaults (the boundary ratio per variant) belong to the API, ``wanloom_api.trainingjob``.
Pure Python: AdaptiveLoad, FLOP accounting and both trainers read it without importing jax or torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Diffusers layout of a two-expert checkpoint, indexed by routing's expert id (0 high-noise, 1 low-noise);
# single-model variants use the first folder only.
EXPERT_SUBFOLDERS: tuple[str, str] = ("transformer", "transformer_2")


@dataclass(frozen=True)
class WanVariant:
    """Architecture of one Wan transformer (one expert for the A14B models).

    Attributes mirror diffusers' ``WanTransformer3DModel`` constructor arguments so that a variant converts
    one-to-one into a diffusers config (``diffusers_config``).
    """

    name: str
    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    in_channels: int
    out_channels: int
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    patch_size: tuple[int, int, int] = (1, 2, 2)
    vae_stride: tuple[int, int, int] = (4, 8, 8)
    eps: float = 1e-6
    two_experts: bool = True
    per_token_timesteps: bool = False
    rope_max_seq_len: int = 1024
    # In-channel layout for image-conditioned models: noise latents + mask + condition latents.
    condition_channels: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def latent_channels(self) -> int:
        return self.out_channels

    def diffusers_config(self) -> dict[str, object]:
        """Keyword arguments for ``diffusers.WanTransformer3DModel``."""
        return {
            "patch_size": self.patch_size,
            "num_attention_heads": self.num_heads,
            "attention_head_dim": self.head_dim,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "text_dim": self.text_dim,
            "freq_dim": self.freq_dim,
            "ffn_dim": self.ffn_dim,
            "num_layers": self.num_layers,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "eps": self.eps,
            "image_dim": None,
            "added_kv_proj_dim": None,
            "rope_max_seq_len": self.rope_max_seq_len,
            "pos_embed_seq_len": None,
        }

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Latent (T', H', W') of a clip of ``frames`` × ``height`` × ``width`` pixels (images: frames = 1)."""
        st, sh, sw = self.vae_stride
        return ((frames - 1) // st + 1, height // sh, width // sw)

    def tokens(self, latent_frames: int, latent_height: int, latent_width: int) -> int:
        """Transformer sequence length of a latent of shape (T', H', W')."""
        pt, ph, pw = self.patch_size
        return (latent_frames // pt) * (latent_height // ph) * (latent_width // pw)

    def tokens_for_pixels(self, frames: int, height: int, width: int) -> int:
        return self.tokens(*self.latent_shape(frames, height, width))


_TINY = WanVariant(
    name="tiny", dim=32, ffn_dim=64, num_heads=2, num_layers=2, in_channels=4, out_channels=4, text_dim=32,
    text_len=16, freq_dim=32,
)  # fmt: skip
_MINI = WanVariant(
    name="mini-t2v", dim=256, ffn_dim=512, num_heads=2, num_layers=2, in_channels=16, out_channels=16, text_len=32
)
VARIANTS: dict[str, WanVariant] = {
    "wan2.2-t2v-a14b": WanVariant(
        name="wan2.2-t2v-a14b", dim=5120, ffn_dim=13824, num_heads=40, num_layers=40, in_channels=16, out_channels=16
    ),
    "wan2.2-i2v-a14b": WanVariant(
        name="wan2.2-i2v-a14b",
        dim=5120,
        ffn_dim=13824,
        num_heads=40,
        num_layers=40,
        in_channels=36,
        out_channels=16,
        condition_channels=20,
    ),
    "wan2.2-ti2v-5b": WanVariant(
        name="wan2.2-ti2v-5b",
        dim=3072,
        ffn_dim=14336,
        num_heads=24,
        num_layers=30,
        in_channels=48,
        out_channels=48,
        vae_stride=(4, 16, 16),
        two_experts=False,
        per_token_timesteps=True,
    ),
    # A two-expert model small enough to train on a laptop CPU in a minute; the shapes match the test model in
    # diffusers' own Wan tests so parity checks stay cheap.
    "tiny": _TINY,
    # The I2V-A14B layout at tiny size: two experts whose input is x_t (4) + mask (4) + first-frame latents (4).
    "tiny-i2v": dataclasses.replace(_TINY, name="tiny-i2v", in_channels=12, condition_channels=8),
    # The TI2V-5B layout at tiny size: one model with per-token timesteps (the image rides in latent frame 0).
    "tiny-ti2v": dataclasses.replace(_TINY, name="tiny-ti2v", two_experts=False, per_token_timesteps=True),
    # The three modes shaped like the real models at their smallest: heads of 128, freq_dim 256, text_dim 4096 and
    # the real channel counts, so that loaders that read a Wan model's size off its weights (ComfyUI derives heads as
    # dim // 128 and fixes freq_dim and text_dim) accept their exports. Two layers; a short text length keeps the
    # synthetic datasets small (it shapes no weight).
    "mini-t2v": _MINI,
    "mini-i2v": dataclasses.replace(_MINI, name="mini-i2v", in_channels=36, condition_channels=20),
    "mini-ti2v": dataclasses.replace(
        _MINI,
        name="mini-ti2v",
        in_channels=48,
        out_channels=48,
        vae_stride=(4, 16, 16),
        two_experts=False,
        per_token_timesteps=True,
    ),
}


def get_variant(name: str) -> WanVariant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown model variant {name!r}; valid: {', '.join(VARIANTS)}") from None
