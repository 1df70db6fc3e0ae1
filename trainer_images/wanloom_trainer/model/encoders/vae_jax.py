"""The Wan VAE (``AutoencoderKLWan``: Wan 2.1's 16-channel 4x8x8 and Wan 2.2's 48-channel 4x16x16 with patchify) in
JAX, as pure functions over the diffusers checkpoint's tensors (names as in the checkpoint), channels last.

The encoder runs as the reference does: the first frame, then chunks of 4 frames; the decoder one latent frame at
a time. Each causal layer carries its last input frames from one chunk to the next (the reference's feature cache,
``_FrameCache``), so a chunk's output is the same as running the layer over the whole clip, and memory is that of
one chunk whatever the clip's length: a 121-frame 720p clip needs what a 5-frame one does. The chunks after the
first run in a ``lax.scan``, so one chunk is compiled, not the clip. Per layer:

- a causal 3D convolution sees its two cached frames in front (zeros before the first chunk);
- the temporal downsampler passes the first chunk's single frame through and keeps it; later chunks are convolved
  as stride-2 windows that start at the kept last frame of the chunk before;
- the temporal upsampler passes the first latent frame through; later ones are doubled by a causal convolution
  whose cache starts from zeros (the reference's "Rep" state);
- Wan 2.2's average-down shortcut pads the first chunk's single frame in front to its factor, and its
  duplicate-up shortcut drops the first (factor - 1) frames of the first chunk.

Tests compare latents and reconstructions with diffusers' ``AutoencoderKLWan`` in float32 on shapes they were not
tuned to.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from wanloom_trainer.model.encoders import read_safetensors_folder

Params = dict[str, Any]
_DN3 = ("NDHWC", "DHWIO", "NDHWC")
_DN2 = ("NHWC", "HWIO", "NHWC")


@dataclass(frozen=True)
class VaeConfig:
    """The parts of a diffusers ``AutoencoderKLWan`` config.json the forward needs."""

    base_dim: int
    decoder_base_dim: int
    z_dim: int
    dim_mult: tuple[int, ...]
    num_res_blocks: int
    attn_scales: tuple[float, ...]
    temperal_downsample: tuple[bool, ...]
    is_residual: bool
    patch_size: int | None
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]
    scale_factor_temporal: int
    scale_factor_spatial: int

    @classmethod
    def from_json(cls, path: Path) -> VaeConfig:
        raw = json.loads(path.read_text())
        base = int(raw.get("base_dim", 96))
        return cls(
            base_dim=base,
            decoder_base_dim=int(raw.get("decoder_base_dim") or base),
            z_dim=int(raw.get("z_dim", 16)),
            dim_mult=tuple(raw.get("dim_mult", (1, 2, 4, 4))),
            num_res_blocks=int(raw.get("num_res_blocks", 2)),
            attn_scales=tuple(raw.get("attn_scales", ())),
            temperal_downsample=tuple(raw.get("temperal_downsample", (False, True, True))),
            is_residual=bool(raw.get("is_residual", False)),
            patch_size=raw.get("patch_size"),
            latents_mean=tuple(raw["latents_mean"]),
            latents_std=tuple(raw["latents_std"]),
            scale_factor_temporal=int(raw.get("scale_factor_temporal") or 4),
            scale_factor_spatial=int(raw.get("scale_factor_spatial") or 8),
        )


def load_vae(folder: str | Path, dtype: Any = jnp.float32) -> tuple[VaeConfig, Params]:
    """A diffusers ``vae/`` folder (config.json + safetensors) as (config, nested params), kernels channels last."""
    folder = Path(folder)
    flat = read_safetensors_folder(folder, "diffusers")
    return VaeConfig.from_json(folder / "config.json"), _nest({k: _to_jax(k, v, dtype) for k, v in flat.items()})


def _to_jax(name: str, value: np.ndarray, dtype: Any) -> jax.Array:
    if name.endswith(".weight") and value.ndim == 5:  # Conv3d [O, I, T, H, W] -> [T, H, W, I, O]
        value = value.transpose(2, 3, 4, 1, 0)
    elif name.endswith(".weight") and value.ndim == 4:  # Conv2d [O, I, H, W] -> [H, W, I, O]
        value = value.transpose(2, 3, 1, 0)
    elif name.endswith((".gamma", ".bias")) and value.ndim > 1:  # RMS norm [C, 1, 1(, 1)] -> [C]
        value = value.reshape(-1)
    return jnp.asarray(value, dtype)


def _nest(flat: dict[str, jax.Array]) -> Params:
    out: Params = {}
    for name, value in flat.items():
        node = out
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def random_params(cfg: VaeConfig, seed: int, in_channels: int = 3) -> Params:
    """Random weights (He-scaled normal kernels, zero biases, unit norms) for ``cfg``'s architecture, named as the
    checkpoint names them: the tiny variants' stand-in VAE where no PyTorch can build diffusers' own."""
    rng = np.random.default_rng(seed)
    flat: dict[str, np.ndarray] = {}

    def conv(name: str, cin: int, cout: int, kernel: tuple[int, ...]) -> None:
        fan_in = cin * int(np.prod(kernel))
        flat[f"{name}.weight"] = rng.standard_normal((*kernel, cin, cout)).astype(np.float32) / np.sqrt(fan_in)
        flat[f"{name}.bias"] = np.zeros(cout, np.float32)

    def res(name: str, cin: int, cout: int) -> None:
        flat[f"{name}.norm1.gamma"], flat[f"{name}.norm2.gamma"] = np.ones(cin, np.float32), np.ones(cout, np.float32)
        conv(f"{name}.conv1", cin, cout, (3, 3, 3))
        conv(f"{name}.conv2", cout, cout, (3, 3, 3))
        if cin != cout:
            conv(f"{name}.conv_shortcut", cin, cout, (1, 1, 1))

    def attention(name: str, c: int) -> None:
        flat[f"{name}.norm.gamma"] = np.ones(c, np.float32)
        conv(f"{name}.to_qkv", c, 3 * c, (1, 1))
        conv(f"{name}.proj", c, c, (1, 1))

    def mid(name: str, c: int) -> None:
        res(f"{name}.resnets.0", c, c)
        attention(f"{name}.attentions.0", c)
        res(f"{name}.resnets.1", c, c)

    def resample(name: str, c: int, mode: str, out: int) -> None:
        conv(f"{name}.resample.1", c, out if mode.startswith("up") else c, (3, 3))
        if mode == "upsample3d":
            conv(f"{name}.time_conv", c, 2 * c, (3, 1, 1))
        elif mode == "downsample3d":
            conv(f"{name}.time_conv", c, c, (3, 1, 1))

    patch = (cfg.patch_size or 1) ** 2
    dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
    last = len(cfg.dim_mult) - 1
    conv("encoder.conv_in", in_channels * patch, dims[0], (3, 3, 3))
    layer = 0
    for i, (cin, cout) in enumerate(itertools.pairwise(dims)):
        mode = "downsample3d" if i != last and cfg.temperal_downsample[i] else "downsample2d"
        for r in range(cfg.num_res_blocks):
            if cfg.is_residual:
                res(f"encoder.down_blocks.{i}.resnets.{r}", cin if r == 0 else cout, cout)
            else:
                res(f"encoder.down_blocks.{layer}", cin if r == 0 else cout, cout)
                layer += 1
                if 0.5**i in cfg.attn_scales:
                    attention(f"encoder.down_blocks.{layer}", cout)
                    layer += 1
        if i != last:
            resample(f"encoder.down_blocks.{i}.downsampler" if cfg.is_residual else f"encoder.down_blocks.{layer}",
                     cout, mode, cout)  # fmt: skip
            layer += not cfg.is_residual
    mid("encoder.mid_block", dims[-1])
    flat["encoder.norm_out.gamma"] = np.ones(dims[-1], np.float32)
    conv("encoder.conv_out", dims[-1], 2 * cfg.z_dim, (3, 3, 3))
    conv("quant_conv", 2 * cfg.z_dim, 2 * cfg.z_dim, (1, 1, 1))
    conv("post_quant_conv", cfg.z_dim, cfg.z_dim, (1, 1, 1))

    up = [cfg.decoder_base_dim * m for m in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
    temporal = cfg.temperal_downsample[::-1]
    conv("decoder.conv_in", cfg.z_dim, up[0], (3, 3, 3))
    mid("decoder.mid_block", up[0])
    for i, (cin, cout) in enumerate(itertools.pairwise(up)):
        if i > 0 and not cfg.is_residual:
            cin //= 2  # the 2.1 upsampler halves the channels
        for r in range(cfg.num_res_blocks + 1):
            res(f"decoder.up_blocks.{i}.resnets.{r}", cin if r == 0 else cout, cout)
        if i != last:
            mode = "upsample3d" if temporal[i] else "upsample2d"
            name = f"decoder.up_blocks.{i}.upsampler" if cfg.is_residual else f"decoder.up_blocks.{i}.upsamplers.0"
            resample(name, cout, mode, cout if cfg.is_residual else cout // 2)
    flat["decoder.norm_out.gamma"] = np.ones(up[-1], np.float32)
    conv("decoder.conv_out", up[-1], in_channels * patch, (3, 3, 3))
    return _nest({k: jnp.asarray(v) for k, v in flat.items()})


# --- layers -----------------------------------------------------------------------------------------------------


class _FrameCache:
    """The last input frames of every causal layer, in the order the layers run, carried from one chunk of frames to
    the next (a ``lax.scan`` carry). ``previous`` is None for a clip's first chunk."""

    def __init__(self, previous: list[jax.Array] | None) -> None:
        self.previous = previous
        self.kept: list[jax.Array] = []

    @property
    def first(self) -> bool:
        return self.previous is None

    def prepend(self, x: jax.Array, frames: int) -> jax.Array:
        """``x`` after its ``frames`` cached frames (zeros before the first chunk); keeps the last ``frames``."""
        if self.previous is None:
            cached = jnp.zeros((x.shape[0], frames, *x.shape[2:]), x.dtype)
        else:
            cached = self.previous[len(self.kept)]
        full = jnp.concatenate([cached, x], axis=1)
        self.kept.append(full[:, -frames:])
        return full

    def keep(self, frames: jax.Array) -> None:
        """What a layer that passes the first chunk through keeps for the next chunk."""
        self.kept.append(frames)


def _conv3d(
    p: Params, x: jax.Array, pad: tuple[int, int, int], cache: _FrameCache | None = None,
    stride: tuple[int, int, int] = (1, 1, 1),
) -> jax.Array:  # fmt: skip
    """Causal 3D convolution: ``2 * pad[0]`` cached frames in front, ``pad[1:]`` on both sides in space."""
    if pad[0]:
        assert cache is not None, "a temporal convolution needs its cache"
        x = cache.prepend(x, 2 * pad[0])
    padding = ((0, 0), (pad[1], pad[1]), (pad[2], pad[2]))
    y = jax.lax.conv_general_dilated(x, p["weight"], stride, padding, dimension_numbers=_DN3)
    return y + p["bias"]


def _conv2d(p: Params, x: jax.Array, padding: Any, stride: tuple[int, int] = (1, 1)) -> jax.Array:
    """A per-frame 2D convolution of [B, T, H, W, C]."""
    b, t = x.shape[:2]
    y = jax.lax.conv_general_dilated(
        x.reshape(b * t, *x.shape[2:]), p["weight"], stride, padding, dimension_numbers=_DN2
    )
    return (y + p["bias"]).reshape(b, t, *y.shape[1:])


def _rms(p: Params, x: jax.Array) -> jax.Array:
    """x / ||x|| over channels * sqrt(C) * gamma (+ bias), as torch's F.normalize (eps 1e-12)."""
    norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True))
    y = (x / jnp.maximum(norm, 1e-12).astype(x.dtype)) * (x.shape[-1] ** 0.5) * p["gamma"]
    return y + p["bias"] if "bias" in p else y


def _resblock(p: Params, x: jax.Array, cache: _FrameCache) -> jax.Array:
    h = _conv3d(p["conv_shortcut"], x, (0, 0, 0)) if "conv_shortcut" in p else x
    x = _conv3d(p["conv1"], jax.nn.silu(_rms(p["norm1"], x)), (1, 1, 1), cache)
    x = _conv3d(p["conv2"], jax.nn.silu(_rms(p["norm2"], x)), (1, 1, 1), cache)
    return x + h


def _attention(p: Params, x: jax.Array) -> jax.Array:
    """Single-head self-attention over each frame's pixels."""
    b, t, h, w, c = x.shape
    qkv = _conv2d(p["to_qkv"], _rms(p["norm"], x), "VALID").reshape(b * t, h * w, 3 * c)
    q, k, v = qkv[..., :c], qkv[..., c : 2 * c], qkv[..., 2 * c :]
    weights = jax.nn.softmax(jnp.einsum("nqc,nkc->nqk", q, k) / jnp.sqrt(c).astype(q.dtype), axis=-1)
    out = jnp.einsum("nqk,nkc->nqc", weights, v).reshape(b, t, h, w, c)
    return _conv2d(p["proj"], out, "VALID") + x


def _mid(p: Params, x: jax.Array, cache: _FrameCache) -> jax.Array:
    x = _resblock(p["resnets"]["0"], x, cache)
    return _resblock(p["resnets"]["1"], _attention(p["attentions"]["0"], x), cache)


def _resample(p: Params, x: jax.Array, mode: str, cache: _FrameCache) -> jax.Array:
    if mode == "upsample3d":
        if cache.first:  # the first latent frame stays one frame; the convolution starts from zeros
            cache.keep(jnp.zeros((x.shape[0], 2, *x.shape[2:]), x.dtype))
        else:
            doubled = _conv3d(p["time_conv"], x, (1, 0, 0), cache)  # [B, T, H, W, 2C]: two frames per frame
            b, t, h, w, c2 = doubled.shape
            x = doubled.reshape(b, t, h, w, 2, c2 // 2).transpose(0, 1, 4, 2, 3, 5).reshape(b, 2 * t, h, w, c2 // 2)
    if mode.startswith("upsample"):
        x = jnp.repeat(jnp.repeat(x, 2, axis=2), 2, axis=3)  # nearest-exact x2
        return _conv2d(p["resample"]["1"], x, ((1, 1), (1, 1)))
    x = _conv2d(p["resample"]["1"], x, ((0, 1), (0, 1)), stride=(2, 2))  # zero pad right and bottom, stride 2
    if mode == "downsample3d":
        if cache.first:  # the first frame passes through and starts the next chunk's first window
            cache.keep(x[:, -1:])
        else:  # windows (last kept, 1, 2), (2, 3, 4) of a 4-frame chunk
            x = cache.prepend(x, 1)
            x = _conv3d(p["time_conv"], x, (0, 0, 0), stride=(2, 1, 1))
    return x


def _avg_down(x: jax.Array, out_channels: int, ft: int, fs: int) -> jax.Array:
    b, t, h, w, c = x.shape
    pad_t = (ft - t % ft) % ft
    x = jnp.pad(x, ((0, 0), (pad_t, 0), (0, 0), (0, 0), (0, 0)))
    t = x.shape[1]
    x = x.reshape(b, t // ft, ft, h // fs, fs, w // fs, fs, c).transpose(0, 1, 3, 5, 7, 2, 4, 6)
    x = x.reshape(b, t // ft, h // fs, w // fs, out_channels, c * ft * fs * fs // out_channels)
    return x.mean(axis=-1)


def _dup_up(x: jax.Array, out_channels: int, ft: int, fs: int, first_chunk: bool) -> jax.Array:
    b, t, h, w, c = x.shape
    repeats = out_channels * ft * fs * fs // c
    x = jnp.repeat(x, repeats, axis=-1).reshape(b, t, h, w, out_channels, ft, fs, fs)
    x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, t * ft, h * fs, w * fs, out_channels)
    return x[:, ft - 1 :] if first_chunk else x


# --- encoder and decoder, one chunk of frames -------------------------------------------------------------------


def _encoder(p: Params, cfg: VaeConfig, x: jax.Array, cache: _FrameCache) -> jax.Array:
    dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
    x = _conv3d(p["conv_in"], x, (1, 1, 1), cache)
    last = len(cfg.dim_mult) - 1
    layer = 0
    for i, out_dim in enumerate(dims[1:]):
        down = "downsample3d" if i != last and cfg.temperal_downsample[i] else "downsample2d"
        if cfg.is_residual:
            block = p["down_blocks"][str(i)]
            shortcut = _avg_down(
                x, out_dim, 2 if i != last and cfg.temperal_downsample[i] else 1, 2 if i != last else 1
            )
            for r in range(cfg.num_res_blocks):
                x = _resblock(block["resnets"][str(r)], x, cache)
            if i != last:
                x = _resample(block["downsampler"], x, down, cache)
            x = x + shortcut
            continue
        for _ in range(cfg.num_res_blocks):
            x = _resblock(p["down_blocks"][str(layer)], x, cache)
            layer += 1
            if 0.5**i in cfg.attn_scales:
                x = _attention(p["down_blocks"][str(layer)], x)
                layer += 1
        if i != last:
            x = _resample(p["down_blocks"][str(layer)], x, down, cache)
            layer += 1
    x = _mid(p["mid_block"], x, cache)
    return _conv3d(p["conv_out"], jax.nn.silu(_rms(p["norm_out"], x)), (1, 1, 1), cache)


def _decoder(p: Params, cfg: VaeConfig, z: jax.Array, cache: _FrameCache) -> jax.Array:
    dims = [cfg.decoder_base_dim * m for m in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
    temporal = cfg.temperal_downsample[::-1]
    x = _mid(p["mid_block"], _conv3d(p["conv_in"], z, (1, 1, 1), cache), cache)
    last = len(cfg.dim_mult) - 1
    for i, out_dim in enumerate(dims[1:]):
        block = p["up_blocks"][str(i)]
        up = i != last
        mode = "upsample3d" if up and temporal[i] else "upsample2d"
        shortcut = x
        for r in range(cfg.num_res_blocks + 1):
            x = _resblock(block["resnets"][str(r)], x, cache)
        if cfg.is_residual:
            if up:
                x = _resample(block["upsampler"], x, mode, cache)
                x = x + _dup_up(shortcut, out_dim, 2 if temporal[i] else 1, 2, first_chunk=cache.first)
        elif up:
            x = _resample(block["upsamplers"]["0"], x, mode, cache)
    return _conv3d(p["conv_out"], jax.nn.silu(_rms(p["norm_out"], x)), (1, 1, 1), cache)


def _chunked(run: Any, x: jax.Array, size: int) -> jax.Array:
    """``run(chunk, cache)`` over the first frame of ``x``, then over chunks of ``size`` frames in a ``lax.scan``, the
    cache carried through; outputs joined along time. Frames past the last whole chunk are left out, as the
    reference leaves them out."""
    cache = _FrameCache(None)
    first = run(x[:, :1], cache)
    chunks = (x.shape[1] - 1) // size
    if not chunks:
        return first
    b = x.shape[0]
    rest = x[:, 1 : 1 + chunks * size].reshape(b, chunks, size, *x.shape[2:]).swapaxes(0, 1)

    def step(previous: list[jax.Array], chunk: jax.Array) -> tuple[list[jax.Array], jax.Array]:
        chunk_cache = _FrameCache(previous)
        y = run(chunk, chunk_cache)
        return chunk_cache.kept, y

    _, ys = jax.lax.scan(step, cache.kept, rest)  # [chunks, B, t, ...]
    return jnp.concatenate([first, ys.swapaxes(0, 1).reshape(b, -1, *ys.shape[3:])], axis=1)


def _patchify(x: jax.Array, p: int | None) -> jax.Array:
    if not p or p == 1:
        return x
    b, t, h, w, c = x.shape
    x = x.reshape(b, t, h // p, p, w // p, p, c).transpose(0, 1, 2, 4, 6, 5, 3)  # channel = c*p*p + pw*p + ph
    return x.reshape(b, t, h // p, w // p, c * p * p)


def _unpatchify(x: jax.Array, p: int | None) -> jax.Array:
    if not p or p == 1:
        return x
    b, t, h, w, cpp = x.shape
    x = x.reshape(b, t, h, w, cpp // (p * p), p, p).transpose(0, 1, 2, 6, 3, 5, 4)  # [.., h, ph, w, pw, c]
    return x.reshape(b, t, h * p, w * p, cpp // (p * p))


def encode(params: Params, cfg: VaeConfig, pixels: jax.Array) -> jax.Array:
    """Pixels in [-1, 1], [B, F, H, W, 3] (F = 1 + 4k) -> posterior means [B, T', H', W', z_dim], not normalised."""
    x = _chunked(lambda chunk, cache: _encoder(params["encoder"], cfg, chunk, cache),
                 _patchify(pixels, cfg.patch_size), cfg.scale_factor_temporal)  # fmt: skip
    moments = _conv3d(params["quant_conv"], x, (0, 0, 0))
    return moments[..., : cfg.z_dim]


def decode(params: Params, cfg: VaeConfig, latents: jax.Array) -> jax.Array:
    """Latents [B, T', H', W', z_dim] (not normalised) -> pixels in [-1, 1], [B, F, H, W, 3]."""
    z = _conv3d(params["post_quant_conv"], latents, (0, 0, 0))
    x = _chunked(lambda chunk, cache: _decoder(params["decoder"], cfg, chunk, cache), z, 1)
    return jnp.clip(_unpatchify(x, cfg.patch_size), -1.0, 1.0)


def normalize(cfg: VaeConfig, mu: jax.Array) -> jax.Array:
    """The trainer's latents: (mu - latents_mean) / latents_std per channel."""
    return (mu - jnp.asarray(cfg.latents_mean, mu.dtype)) / jnp.asarray(cfg.latents_std, mu.dtype)


def denormalize(cfg: VaeConfig, z: jax.Array) -> jax.Array:
    return z * jnp.asarray(cfg.latents_std, z.dtype) + jnp.asarray(cfg.latents_mean, z.dtype)
