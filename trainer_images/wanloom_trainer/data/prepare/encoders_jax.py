"""The Wan VAE and umT5 text encoder in JAX (``model/encoders/vae_jax.py``, ``model/encoders/umt5_jax.py``):
``wanloom data prepare --encoders jax``, and the default where PyTorch is not installed (the TPU image).

The same interface and conventions as the PyTorch encoders (encoders.py): uint8 clips in, normalised posterior
means out as float32 [B, C, T', H', W']; captions cleaned, tokenised to text_len and only the real tokens kept;
the I2V condition as 4 mask channels and the latents of the first frame followed by black frames. Each distinct
input shape compiles once (a bucket is one shape). On a host with several chips (a TPU host's four) the weights
are replicated and a batch is split over the chips whenever its size divides evenly.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from wanloom_trainer.data.prepare.encoders import PixelEncoder, clean_caption
from wanloom_trainer.model.encoders import umt5_jax, vae_jax

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class JaxEncoders(PixelEncoder):
    """VAE + tokenizer + text encoder on the default JAX backend, inference only.

    Args:
        model_root: folder with ``vae/``, ``text_encoder/`` and ``tokenizer/`` (diffusers layout, safetensors).
        dtype: "float32" or "bfloat16" for the weights and activations.
    """

    def __init__(self, model_root: str | Path, dtype: str = "float32") -> None:
        root = Path(model_root)
        for sub in ("vae", "text_encoder", "tokenizer"):
            if not (root / sub).is_dir():
                raise FileNotFoundError(f"model root {root} has no {sub}/ folder (diffusers layout expected)")
        if dtype not in DTYPES:
            raise ValueError(f"encoder dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        self.dtype = DTYPES[dtype]
        self.vae_config, self.vae = vae_jax.load_vae(root / "vae", self.dtype)
        self.text_config, self.text = umt5_jax.load_text_encoder(root / "text_encoder", self.dtype)
        self.tokenizer = umt5_jax.Tokenizer(root / "tokenizer")
        devices = jax.local_devices()
        self._mesh = Mesh(np.array(devices), ("data",)) if len(devices) > 1 else None
        if self._mesh is not None:
            self.vae, self.text = jax.device_put((self.vae, self.text), NamedSharding(self._mesh, P()))
        self._encode_vae = jax.jit(partial(_encode_normalised, cfg=self.vae_config))
        text_config = self.text_config
        self._encode_text = jax.jit(lambda params, ids, mask: umt5_jax.encode(params, text_config, ids, mask))

    @property
    def latent_channels(self) -> int:
        return self.vae_config.z_dim

    @property
    def text_dim(self) -> int:
        return self.text_config.d_model

    @property
    def vae_stride(self) -> tuple[int, int, int]:
        spatial = self.vae_config.scale_factor_spatial
        return self.vae_config.scale_factor_temporal, spatial, spatial

    def _batch(self, x: np.ndarray) -> jax.Array:
        """``x`` split over the host's chips along the batch where it divides evenly, else on one."""
        if self._mesh is not None and len(x) % self._mesh.size == 0:
            return jax.device_put(x, NamedSharding(self._mesh, P("data")))
        return jnp.asarray(x)

    def _encode(self, x_bfhwc: np.ndarray) -> np.ndarray:
        z = self._encode_vae(self.vae, self._batch(np.asarray(x_bfhwc)).astype(self.dtype))
        return np.asarray(z, np.float32).transpose(0, 4, 1, 2, 3)

    def encode_text(self, captions: list[str], text_len: int) -> list[np.ndarray]:
        """Captions → per caption float32 [L_i, D_text], L_i ≤ text_len real tokens (at least 1)."""
        ids, mask = self.tokenizer([clean_caption(c) for c in captions], text_len)
        hidden = np.asarray(self._encode_text(self.text, self._batch(ids), self._batch(mask)), np.float32)
        return [hidden[i, : max(1, int(n))] for i, n in enumerate(mask.sum(axis=1))]


def _encode_normalised(params: Any, pixels: jax.Array, cfg: vae_jax.VaeConfig) -> jax.Array:
    return vae_jax.normalize(cfg, vae_jax.encode(params, cfg, pixels).astype(jnp.float32))
