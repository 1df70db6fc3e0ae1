"""Latents → pixels → files: the Wan VAE decode, mp4 clips (PyAV) and a contact-sheet PNG (one row per sample,
frames evenly spaced).

The VAE is diffusers' ``AutoencoderKLWan`` (PyTorch) where PyTorch is installed, else the JAX one
(``model/encoders/vae_jax.py``, the same latents within float error): TPU runs decode their validation videos too.
Latents are the normalised ones the transformer sees (``data.prepare.encoders``: z = (μ − mean) / std), so decoding
first undoes the VAE config's ``latents_mean``/``latents_std``. The tiny variants have no real VAE: ``small_vae``
builds a seeded random one with their latent channels and the Wan strides, which decodes to noise-like clips of the
right shape (enough to exercise the path, not to look at; the PyTorch and JAX ones are random in their own ways).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHEET_FRAMES = 5  # frames per sample on the contact sheet
DECODE_FILE = "decode.json"


@dataclass(frozen=True)
class DecodeSpec:
    """How a samples folder's latents (``sample-<id>.npy``) decode: the VAE folder (None: ``small_vae`` of
    ``latent_channels`` seeded with ``seed``) and the clips' frame rate. Written beside the latents, so a folder
    saved where no VAE can run (the TPU image has no PyTorch) decodes later with ``wanloom decode-samples``."""

    vae: str | None
    latent_channels: int
    seed: int
    fps: int = 16

    def write(self, folder: Path) -> Path:
        path = folder / DECODE_FILE
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def read(cls, folder: Path) -> DecodeSpec:
        path = folder / DECODE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: expected a validation samples folder (samples/step-NNNNNN)")
        return cls(**json.loads(path.read_text()))


@dataclass(frozen=True)
class JaxVae:
    """The JAX Wan VAE: its config, weights and compiled decode."""

    config: Any
    params: Any
    decode: Any


def has_torch_vae() -> bool:
    """Whether diffusers' PyTorch VAE can run here (the GPU image and local installs; not the TPU image)."""
    import importlib.util

    try:
        return all(importlib.util.find_spec(m) is not None for m in ("torch", "diffusers"))
    except ValueError:  # in sys.modules as None: deliberately unimportable
        return False


def can_decode() -> bool:
    """Whether a VAE can decode here: diffusers' (PyTorch), else the JAX one (safetensors weights)."""
    import importlib.util

    return has_torch_vae() or all(importlib.util.find_spec(m) is not None for m in ("jax", "safetensors"))


def open_vae(spec: DecodeSpec) -> Any:
    """The VAE ``spec`` names; a gs:// folder must be staged locally first (``checkpoint.gcs.stage_weights``)."""
    if not has_torch_vae():
        return _jax_vae(spec)
    if spec.vae is None:
        return small_vae(spec.latent_channels, spec.seed)
    return load_vae(spec.vae)


def _jax_vae(spec: DecodeSpec) -> JaxVae:
    import jax

    from wanloom_trainer.model.encoders import vae_jax

    if spec.vae is None:
        c = spec.latent_channels
        config = vae_jax.VaeConfig(8, 8, c, (1, 2, 4, 4), 1, (), (False, True, True), False, None,
                                   (0.0,) * c, (1.0,) * c, 4, 8)  # fmt: skip  # small_vae's architecture
        params = vae_jax.random_params(config, spec.seed)
    else:
        config, params = vae_jax.load_vae(spec.vae)
    return JaxVae(config, params, jax.jit(lambda p, z: vae_jax.decode(p, config, vae_jax.denormalize(config, z))))


def decode_folder(folder: Path, vae: Any, fps: int) -> list[str]:
    """An mp4 for every ``sample-<id>.npy`` and ``prompt-<i>.npy`` in ``folder``, and ``contact-sheet.png`` (held-out
    samples first, then prompts); their names."""
    latents = sorted(folder.glob("sample-*.npy")) + sorted(folder.glob("prompt-*.npy"))
    if not latents:
        raise FileNotFoundError(f"{folder}: no sample-*.npy or prompt-*.npy latents to decode")
    videos, names = [], []
    for path in latents:
        frames = decode(vae, np.load(path))[0]
        names.append(write_mp4(frames, path.with_suffix(".mp4"), fps).name)
        videos.append(frames)
    names.append(contact_sheet(videos, folder / "contact-sheet.png").name)
    return names


def small_vae(latent_channels: int, seed: int) -> Any:
    """A ~0.6 M-parameter ``AutoencoderKLWan`` with the Wan strides (4 in time, 8 in space), random weights."""
    import torch
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKLWan(
            base_dim=8,
            z_dim=latent_channels,
            dim_mult=[1, 2, 4, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * latent_channels,
            latents_std=[1.0] * latent_channels,
        ).eval()


def load_vae(folder: str | Path) -> Any:
    """The Wan VAE of a diffusers repository's ``vae/`` folder (float32, CPU)."""
    import torch
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(folder, torch_dtype=torch.float32).eval()


def decode(vae: Any, latents: np.ndarray) -> np.ndarray:
    """uint8 [B, F, H, W, 3] frames of normalised latents [B, C, T', H', W']."""
    if isinstance(vae, JaxVae):
        video = np.asarray(vae.decode(vae.params, latents.astype(np.float32).transpose(0, 2, 3, 4, 1)))
        return ((np.clip(video, -1, 1) + 1) * 127.5).round().astype(np.uint8)
    import torch

    config = vae.config
    mean = torch.tensor(config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
    std = torch.tensor(config.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(torch.from_numpy(latents).float() * std + mean).sample  # [B, 3, F, H, W] in [-1, 1]
    pixels = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 4, 1).numpy()


def write_mp4(frames: np.ndarray, path: Path, fps: int = 16) -> Path:
    """H.264 (yuv420p) mp4 of uint8 [F, H, W, 3] frames."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def contact_sheet(videos: Sequence[np.ndarray], path: Path) -> Path:
    """A PNG grid: one row per video, ``SHEET_FRAMES`` frames evenly spaced (all of them when fewer)."""
    from PIL import Image

    rows = []
    for frames in videos:
        picks = np.unique(np.linspace(0, len(frames) - 1, min(SHEET_FRAMES, len(frames))).round().astype(int))
        row = np.concatenate([frames[i] for i in picks], axis=1)
        rows.append(row)
    width = max(r.shape[1] for r in rows)
    rows = [np.pad(r, ((0, 0), (0, width - r.shape[1]), (0, 0))) for r in rows]
    Image.fromarray(np.concatenate(rows, axis=0)).save(path)
    return path
