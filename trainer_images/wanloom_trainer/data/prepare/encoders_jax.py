"""The Wan VAE and umT5 text encoder in JAX (``model/encoders/vae_jax.py``, ``model/encoders/umt5_jax.py``):
``wanloom data prepare --encoders jax``, and the default where PyTorch is not installed (the TPU image).

The same interface and conventions as the PyTorch encoders (encoders.py): uint8 clips in, normalised posterior
means out as float32 [B, C, T', H', W']; captions cleaned, tokenised to text_len and only the real tokens kept;
the I2V condition as 4 mask channels and the latents of the first frame followed by black frames. Each distinct
input shape compiles once (a bucket is one shape). On a host with several chips (a TPU host's four) the weights
are replicated and a batch is split over the chips whenever its size divides evenly.

How many clips of a shape go through the VAE at once is read from the compiled program, not guessed: where the
device reports its memory (TPUs, GPUs), the batch is halved until XLA's memory figure for the program (arguments,
scratch and output, per device) fits in ``MEMORY_SHARE`` of it, and a batch is encoded in calls of that size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from wanloom_trainer.data.prepare.encoders import PixelEncoder, clean_caption
from wanloom_trainer.model.encoders import umt5_jax, vae_jax

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
MEMORY_SHARE = 0.9  # of a device's memory a program may plan for: XLA's figure leaves out the runtime's own
log = logging.getLogger(__name__)


def device_memory_bytes(device: Any) -> int | None:
    """The memory a device reports (TPU, GPU); None where it reports none (the CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def program_bytes(compiled: Any) -> int:
    """XLA's memory figure of a compiled program on one device: its arguments, scratch and output."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes)


def largest_batch_that_fits(compile_for: Callable[[int], Any], batch: int, limit: int, step: int = 1) -> int:
    """The largest of ``batch``, ``batch/2``, ... (a multiple of ``step``, the devices a batch is split over, while
    one is possible) whose compiled program fits in ``limit`` bytes; ValueError when one item does not fit."""
    size = batch
    while True:
        need = program_bytes(compile_for(size))
        if need <= limit:
            return size
        if size == 1:
            raise ValueError(f"one item needs {need / 2**30:.1f} GiB of a device's {limit / 2**30:.1f} GiB usable")
        half = max(1, size // 2)
        size = half // step * step if half >= step else half


class JaxEncoders(PixelEncoder):
    """VAE + tokenizer + text encoder on the default JAX backend, inference only.

    Args:
        model_root: folder with ``vae/``, ``text_encoder/`` and ``tokenizer/`` (diffusers layout, safetensors).
        dtype: "float32" or "bfloat16" for the weights and activations.
        memory_bytes: a device's memory to plan the VAE's batches for; default: what the device reports.
    """

    def __init__(self, model_root: str | Path, dtype: str = "float32", memory_bytes: int | None = None) -> None:
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
        limit = memory_bytes or device_memory_bytes(devices[0])
        self._memory_limit = int(limit * MEMORY_SHARE) if limit else None
        self._per_call: dict[tuple[int, ...], int] = {}
        self._programs: dict[tuple[int, ...], Any] = {}
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

    def _batch_sharding(self, n: int) -> Any:
        """A batch of ``n`` split over the host's chips where it divides evenly, else on the first."""
        if self._mesh is not None and n % self._mesh.size == 0:
            return NamedSharding(self._mesh, P("data"))
        return SingleDeviceSharding(jax.local_devices()[0])

    def _batch(self, x: np.ndarray) -> jax.Array:
        return jax.device_put(x, self._batch_sharding(len(x)))

    def _encode(self, x_bfhwc: np.ndarray) -> np.ndarray:
        x = np.asarray(x_bfhwc)
        n = self._per_call_batch(x.shape)
        parts = [self._vae_program((len(x[i : i + n]), *x.shape[1:]))(self.vae, self._batch(x[i : i + n]))
                 for i in range(0, len(x), n)]  # fmt: skip
        return np.concatenate([np.asarray(z, np.float32) for z in parts]).transpose(0, 4, 1, 2, 3)

    def _vae_program(self, shape: tuple[int, ...], keep: bool = True) -> Any:
        """The VAE compiled for a batch of ``shape`` [B, F, H, W, 3] (once per shape where ``keep``)."""
        if shape in self._programs:
            return self._programs[shape]
        x = jax.ShapeDtypeStruct(shape, self.dtype, sharding=self._batch_sharding(shape[0]))
        program = self._encode_vae.lower(self.vae, x).compile()
        if keep:
            self._programs[shape] = program
        return program

    def _per_call_batch(self, shape: tuple[int, ...]) -> int:
        """Clips of ``shape`` [B, F, H, W, 3] per VAE call: all of them, or fewer where the compiled program of B
        does not fit the device (decided once per shape)."""
        if self._memory_limit is None:
            return shape[0]
        if shape not in self._per_call:
            step = self._mesh.size if self._mesh is not None else 1
            try:
                fits = largest_batch_that_fits(lambda b: self._vae_program((b, *shape[1:]), keep=False), shape[0],
                                               self._memory_limit, step)  # fmt: skip
            except ValueError as exc:
                raise ValueError(f"the VAE cannot encode a {'x'.join(map(str, shape[1:4]))} clip: {exc}") from None
            if fits < shape[0]:
                log.info("encoding %s clips %d at a time: the compiled VAE of %d needs more than %.1f GiB per device",
                         "x".join(map(str, shape[1:4])), fits, shape[0], self._memory_limit / 2**30)  # fmt: skip
            self._per_call[shape] = fits
        return self._per_call[shape]

    def _batch_sharding(self, n: int) -> Any:
        """A batch of ``n`` split over the host's chips where it divides evenly, else on the first."""
        if self._mesh is not None and n % self._mesh.size == 0:
            return NamedSharding(self._mesh, P("data"))
        return SingleDeviceSharding(jax.local_devices()[0])

    def _batch(self, x: np.ndarray) -> jax.Array:
        return jax.device_put(x.astype(self.dtype) if x.dtype.kind == "f" else x, self._batch_sharding(len(x)))

    def encode_text(self, captions: list[str], text_len: int) -> list[np.ndarray]:
        """Captions → per caption float32 [L_i, D_text], L_i ≤ text_len real tokens (at least 1)."""
        ids, mask = self.tokenizer([clean_caption(c) for c in captions], text_len)
        hidden = np.asarray(self._encode_text(self.text, self._batch(ids), self._batch(mask)), np.float32)
        return [hidden[i, : max(1, int(n))] for i, n in enumerate(mask.sum(axis=1))]


def _encode_normalised(params: Any, pixels: jax.Array, cfg: vae_jax.VaeConfig) -> jax.Array:
    return vae_jax.normalize(cfg, vae_jax.encode(params, cfg, pixels).astype(jnp.float32))
