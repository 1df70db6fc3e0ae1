"""The Wan VAE and umT5 text encoder used by ``wanloom data prepare`` (PyTorch + diffusers/transformers).

Loaded from a diffusers-layout model root (``vae/``, ``text_encoder/``, ``tokenizer/``, as in the
``Wan-AI/Wan2.2-*-Diffusers`` repositories). Conventions follow the Wan pipelines:

- pixels in [-1, 1], [B, 3, F, H, W]; latents are the posterior mean, normalised per channel with the VAE
  config's ``latents_mean``/``latents_std``: ``z = (mu − mean) / std``, which is what the transformer sees;
- text: tokens padded/truncated to text_len, encoded with the attention mask, and only the real tokens kept
  (Wan zero-pads them back to text_len; the reader does that);
- I2V condition: the VAE encoding of the first frame followed by black (zero) frames, behind 4 mask channels
  that are 1 on the first latent frame (Wan's mask repeats frame 0 over the 4-frame time stride).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

I2V_MASK_CHANNELS = 4


class PixelEncoder:
    """What both encoder implementations share: clips to latents and the I2V condition, over their ``_encode``
    (float32 pixels in [-1, 1], [B, F, H, W, 3] → normalised posterior means [B, C, T', H', W'])."""

    def encode_pixels(self, clips: np.ndarray) -> np.ndarray:
        """uint8 [B, F, H, W, 3] → float32 normalised latents [B, C, T', H', W']."""
        return self._encode(to_unit(clips, keep_first=False))

    def encode_condition(self, clips: np.ndarray) -> np.ndarray:
        """I2V condition float32 [B, 4 + C, T', H', W'] from uint8 [B, F, H, W, 3] (module docstring)."""
        latents = self._encode(to_unit(clips, keep_first=True))
        b, _, t, h, w = latents.shape
        mask = np.zeros((b, I2V_MASK_CHANNELS, t, h, w), dtype=np.float32)
        mask[:, :, 0] = 1.0
        return np.concatenate([mask, latents], axis=1)

    def _encode(self, x_bfhwc: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class WanEncoders(PixelEncoder):
    """VAE + tokenizer + text encoder on one device, inference only.

    Args:
        model_root: folder with ``vae/``, ``text_encoder/`` and ``tokenizer/`` (diffusers layout).
        device: torch device string; dtype: "float32" or "bfloat16" for the encoders' weights and activations.
    """

    def __init__(self, model_root: str | Path, device: str = "cpu", dtype: str = "float32") -> None:
        import torch
        from diffusers import AutoencoderKLWan
        from transformers import AutoConfig, AutoTokenizer, T5EncoderModel, UMT5EncoderModel

        root = Path(model_root)
        for sub in ("vae", "text_encoder", "tokenizer"):
            if not (root / sub).is_dir():
                raise FileNotFoundError(f"model root {root} has no {sub}/ folder (diffusers layout expected)")
        self.torch, self.device = torch, torch.device(device)
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.vae = AutoencoderKLWan.from_pretrained(root / "vae", torch_dtype=self.dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
        kind = AutoConfig.from_pretrained(root / "text_encoder").model_type
        encoder_cls = UMT5EncoderModel if kind == "umt5" else T5EncoderModel
        self.text_encoder = encoder_cls.from_pretrained(root / "text_encoder", torch_dtype=self.dtype)
        self.text_encoder = self.text_encoder.to(self.device).eval()
        cfg = self.vae.config
        self._mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self._std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)

    @property
    def latent_channels(self) -> int:
        return int(self.vae.config.z_dim)

    @property
    def text_dim(self) -> int:
        return int(self.text_encoder.config.d_model)

    @property
    def vae_stride(self) -> tuple[int, int, int]:
        cfg = self.vae.config
        spatial = int(cfg.scale_factor_spatial or 8)
        return int(cfg.scale_factor_temporal or 4), spatial, spatial

    def _encode(self, x_bfhwc: np.ndarray) -> np.ndarray:
        """float32 pixels in [-1, 1], [B, F, H, W, 3] → normalised posterior means [B, C, T', H', W']."""
        torch = self.torch
        x = torch.from_numpy(np.ascontiguousarray(x_bfhwc)).permute(0, 4, 1, 2, 3).to(self.device, self.dtype)
        with torch.no_grad():
            mu = self.vae.encode(x).latent_dist.mode().float().cpu()
        return ((mu - self._mean) / self._std).numpy()

    def encode_text(self, captions: list[str], text_len: int) -> list[np.ndarray]:
        """Captions → per caption float32 [L_i, D_text], L_i ≤ text_len real tokens (at least 1)."""
        torch = self.torch
        enc = self.tokenizer(
            [clean_caption(c) for c in captions],
            padding="max_length",
            max_length=text_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = enc.input_ids.to(self.device), enc.attention_mask.to(self.device)
        with torch.no_grad():
            hidden = self.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state.float().cpu().numpy()
        lengths = mask.sum(dim=1).clamp(min=1).cpu().tolist()
        return [hidden[i, : int(n)] for i, n in enumerate(lengths)]


class EncoderReplicas:
    """One ``WanEncoders`` per device of the pod (every GPU it was given): each batch is split across them in
    order, encoded on a thread per device (the GPU work releases the GIL) and joined in order. Every sample is
    encoded on its own (no batch statistics; captions padded to the fixed text length), so the split changes no
    result beyond a kernel's rounding."""

    def __init__(self, replicas: Sequence[WanEncoders]) -> None:
        if not replicas:
            raise ValueError("EncoderReplicas needs at least one WanEncoders")
        self.replicas = list(replicas)
        first = self.replicas[0]
        self.latent_channels, self.text_dim, self.vae_stride = first.latent_channels, first.text_dim, first.vae_stride
        self._threads = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="encoder")

    def _split(self, n: int) -> list[slice]:
        bounds = np.linspace(0, n, min(n, len(self.replicas)) + 1).round().astype(int)
        return [slice(a, b) for a, b in itertools.pairwise(bounds)]

    def _map(self, call: Callable[[WanEncoders, Any], Any], items: Any) -> list[Any]:
        parts = self._split(len(items))
        return list(self._threads.map(call, self.replicas[: len(parts)], [items[p] for p in parts]))

    def encode_pixels(self, clips: np.ndarray) -> np.ndarray:
        return np.concatenate(self._map(lambda enc, part: enc.encode_pixels(part), clips))

    def encode_condition(self, clips: np.ndarray) -> np.ndarray:
        return np.concatenate(self._map(lambda enc, part: enc.encode_condition(part), clips))

    def encode_text(self, captions: list[str], text_len: int) -> list[np.ndarray]:
        return [t for part in self._map(lambda enc, part: enc.encode_text(part, text_len), captions) for t in part]


def load_torch_encoders(model_root: str | Path, device: str, dtype: str) -> WanEncoders | EncoderReplicas:
    """The encoders on ``device``; "cuda" with several GPUs visible means one replica on each of them."""
    import torch

    count = torch.cuda.device_count() if device == "cuda" else 1
    if count <= 1:
        return WanEncoders(model_root, device, dtype)
    return EncoderReplicas([WanEncoders(model_root, f"cuda:{i}", dtype) for i in range(count)])


def to_unit(clips: np.ndarray, keep_first: bool) -> np.ndarray:
    """uint8 [B, F, H, W, 3] → float32 in [-1, 1]; keep_first zeroes every frame after the first (Wan I2V)."""
    x = clips.astype(np.float32) / 127.5 - 1.0
    if keep_first:
        x[:, 1:] = 0.0
    return x


def clean_caption(text: str) -> str:
    """Whitespace clean-up as in Wan's tokenizer wrapper (runs of spaces and newlines become one space)."""
    return re.sub(r"\s+", " ", text).strip()


def describe(encoders: Any) -> dict[str, Any]:
    """The encoder facts a dataset's build record keeps."""
    return {
        "latent_channels": encoders.latent_channels,
        "text_dim": encoders.text_dim,
        "vae_stride": list(encoders.vae_stride),
    }
