"""The Wan VAE and umT5 text encoder in JAX (``model/encoders/vae_jax.py``, ``model/encoders/umt5_jax.py``):
``wanloom data prepare --encoders jax``, and the default where PyTorch is not installed (the TPU image).

The same interface and conventions as the PyTorch encoders (encoders.py): uint8 clips in, normalised posterior
means out as float32 [B, C, T', H', W']; captions cleaned, tokenised to text_len and only the real tokens kept;
the I2V condition as 4 mask channels and the latents of the first frame followed by black frames. Each distinct
input shape compiles once (a bucket is one shape). On a host with several chips (a TPU host's four) the weights
are replicated and a batch is split over the chips whenever its size divides evenly.

How many clips (or captions) of a shape go through the VAE (or umT5) at once is read from the compiled program, not
guessed: where the device reports its memory (TPUs, GPUs), the batch is halved until XLA's memory figure for the
program (arguments, scratch and output, per device) fits in ``MEMORY_SHARE`` of it, and a batch is encoded in calls
of that size. The weights stay replicated: umT5-XXL needs 16 GiB of a v7x TensorCore's 96 at 512 tokens
(docs/benchmarks.md), so sharding them would only add collectives.
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
        self._per_call: dict[tuple[Any, ...], int] = {}
        self._programs: dict[tuple[Any, ...], Any] = {}
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

    def _encode(self, x_bfhwc: np.ndarray) -> np.ndarray:
        x = np.asarray(x_bfhwc)
        clip = "x".join(map(str, x.shape[1:4]))
        return self._in_calls("VAE", f"{clip} clip", self._encode_vae, self.vae, x).transpose(0, 4, 1, 2, 3)

    def encode_text(self, captions: list[str], text_len: int) -> list[np.ndarray]:
        """Captions → per caption float32 [L_i, D_text], L_i ≤ text_len real tokens (at least 1)."""
        ids, mask = self.tokenizer([clean_caption(c) for c in captions], text_len)
        hidden = self._in_calls("text encoder", f"{text_len}-token caption", self._encode_text, self.text, ids, mask)
        return [hidden[i, : max(1, int(n))] for i, n in enumerate(mask.sum(axis=1))]

    def _in_calls(self, model: str, item: str, fn: Any, params: Any, *batch: np.ndarray) -> np.ndarray:
        """``fn(params, *batch)`` as float32, in calls of as many items as one device holds."""
        n, size = len(batch[0]), self._per_call_size(model, item, fn, params, batch)
        parts = []
        for i in range(0, n, size):
            part = [a[i : i + size] for a in batch]
            parts.append(np.asarray(self._program(fn, params, part)(params, *map(self._batch, part)), np.float32))
        return np.concatenate(parts)

    def _per_call_size(self, model: str, item: str, fn: Any, params: Any, batch: tuple[np.ndarray, ...]) -> int:
        """All of ``batch`` where the device reports no memory, else the largest part whose compiled program fits
        (decided once per shape; the programs compiled on the way are kept, the chosen one is reused)."""
        n = len(batch[0])
        key = (model, *(a.shape for a in batch))
        if self._memory_limit is None or key in self._per_call:
            return self._per_call.get(key, n)
        step = self._mesh.size if self._mesh is not None else 1
        try:
            size = largest_batch_that_fits(lambda b: self._program(fn, params, [a[:b] for a in batch]), n,
                                           self._memory_limit, step)  # fmt: skip
        except ValueError as exc:
            raise ValueError(f"the {model} cannot encode a {item}: {exc}") from None
        if size < n:
            log.info("the %s encodes %ss %d at a time: %d need more than %.1f GiB per device", model, item, size, n,
                     self._memory_limit / 2**30)  # fmt: skip
        self._per_call[key] = size
        return size

    def _program(self, fn: Any, params: Any, batch: list[np.ndarray]) -> Any:
        """``fn`` compiled for ``batch``'s shapes, once."""
        key = (fn, *(a.shape for a in batch))
        if key not in self._programs:
            args = [jax.ShapeDtypeStruct(a.shape, self._dtype_of(a), sharding=self._batch_sharding(len(a)))
                    for a in batch]  # fmt: skip
            self._programs[key] = fn.lower(params, *args).compile()
        return self._programs[key]

    def _dtype_of(self, x: np.ndarray) -> Any:
        return self.dtype if x.dtype.kind == "f" else x.dtype

    def _batch_sharding(self, n: int) -> Any:
        """A batch of ``n`` split over the host's chips where it divides evenly, else on the first."""
        if self._mesh is not None and n % self._mesh.size == 0:
            return NamedSharding(self._mesh, P("data"))
        return SingleDeviceSharding(jax.local_devices()[0])

    def _batch(self, x: np.ndarray) -> jax.Array:
        return jax.device_put(x.astype(self._dtype_of(x), copy=False), self._batch_sharding(len(x)))


def _encode_normalised(params: Any, pixels: jax.Array, cfg: vae_jax.VaeConfig) -> jax.Array:
    return vae_jax.normalize(cfg, vae_jax.encode(params, cfg, pixels).astype(jnp.float32))
