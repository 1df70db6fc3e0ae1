"""Validation videos (``spec.validation.videos``): the first held-out samples generated from their own text (and,
for I2V, their first-frame condition) with the current weights at each validation.

Every process runs the sampler (``Backend.predict`` is collective); process 0 saves the latents and decodes them
with the VAE into ``sample-<id>.mp4`` per sample and ``contact-sheet.png`` in ``<samples dir>/step-NNNNNN/``
(``tracking.artifact_dir``: the run directory locally, beside a gs:// checkpoint root on a cluster, uploaded file by
file). Where no PyTorch VAE can run, as in the TPU image, the JAX VAE decodes them (``sampling.media``). The noise
depends only on (seed, sample id), so the videos of successive validations differ by the weights alone, and nothing
here touches the training state or its random streams.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wanloom_api.trainingjob import DEFAULT_SAMPLING, TINY_VARIANTS
from wanloom_trainer.config.train_config import EvaluationConfig
from wanloom_trainer.sampling.media import DecodeSpec, can_decode
from wanloom_trainer.sampling.sampler import SamplerConfig, sample
from wanloom_trainer.tracking import artifact_dir

log = logging.getLogger(__name__)
_NOISE_STREAM = 0x5A3E
FPS = 16


@dataclass(frozen=True)
class Samples:
    """What one validation generated: its folder (local path or gs://) and the files in it (names)."""

    folder: str
    files: tuple[str, ...]
    local: Path | None  # the files process 0 wrote (a staging copy for gs://; None on other processes)


def sampler_config(config: EvaluationConfig) -> SamplerConfig:
    steps, shift, guidance = DEFAULT_SAMPLING[config.model.variant]
    spec = config.spec
    if spec.inference_steps is not None:
        steps = spec.inference_steps
    if spec.guidance_scale is not None:
        guidance = (spec.guidance_scale, spec.guidance_scale)
    return SamplerConfig(steps, shift, config.boundary_ratio, guidance, solver=spec.sampler)


class SampleWriter:
    """Generates the first ``videos`` held-out samples and, with ``promptSize``, the dataset's validation prompts;
    the VAE is loaded on process 0 at the first call."""

    def __init__(self, config: EvaluationConfig, backend: Any, dataset: Any, sample_ids: np.ndarray) -> None:
        self.config, self.backend, self.dataset = config, backend, dataset
        self.ids = [int(i) for i in sample_ids[: config.spec.videos]]
        self.sampler = sampler_config(config)
        # Both fail at the start of the run, not at the first validation: the unconditional prompt, and the VAE.
        if config.spec.negative_prompt:
            self.negative_text = dataset.negative_prompt()
        else:
            self.negative_text = dataset.empty_prompt(needed_by="spec.validation.videos")
        self._decode_spec = DecodeSpec(self._vae_source(), config.model.wan.latent_channels, config.seed, FPS)
        size = config.spec.prompt_size
        self.prompt_texts, self.prompts = dataset.validation_prompts() if size is not None else (np.zeros(0), [])
        self.prompt_shape = config.model.wan.latent_shape(*size.pixels) if size is not None else ()
        self.decodes = can_decode()
        if not self.decodes and backend.process_index == 0:
            log.warning(
                "validation videos: no VAE can run here (neither diffusers nor jax with safetensors); each "
                "validation saves the latents: `wanloom decode-samples FOLDER` turns them into videos"
            )
        self._vae: Any = None

    def run(self, state: Any, steps_done: int) -> Samples:
        """Generate every held-out sample and prompt; process 0 writes them."""
        latents: dict[str, np.ndarray] = {}
        for sid in self.ids:
            batch = self.dataset.load([sid])
            noise = self._noise(sid, batch.latents.shape)
            latents[f"sample-{sid:06d}"] = self._generate(state, noise, batch.text_embeds, batch.condition)
        for i, text in enumerate(self.prompt_texts):
            noise = self._noise(-1 - i, (1, self.config.model.wan.latent_channels, *self.prompt_shape))
            latents[f"prompt-{i:03d}"] = self._generate(state, noise, text[None], None)
        folder = f"{artifact_dir(self.config.checkpoint_uri, self.config.run_dir, 'samples')}/step-{steps_done:06d}"
        if self.backend.process_index != 0:
            return Samples(folder, (), None)
        return self._write(latents, folder)

    def _noise(self, key: int, shape: tuple[int, ...]) -> np.ndarray:
        """The starting noise of one video: a function of (seed, key) only (prompts take negative keys)."""
        stream = [self.config.seed, key if key >= 0 else 2**32 - key, _NOISE_STREAM]
        return np.random.default_rng(stream).standard_normal(shape, dtype=np.float32)

    def _generate(self, state: Any, noise: np.ndarray, text: np.ndarray, condition: np.ndarray | None) -> np.ndarray:
        predict = self.backend.predict
        return sample(
            lambda e, x, t, c: predict(state, e, x, t, c), noise, text, self.negative_text, self.sampler, condition
        )

    def _write(self, latents: dict[str, np.ndarray], folder: str) -> Samples:
        """The latents (``sample-<id>.npy``, ``prompt-<i>.npy``) and ``decode.json`` always; the clips and the
        contact sheet where the VAE can run (``media.can_decode``)."""
        from wanloom_trainer.sampling import media

        local = Path(tempfile.mkdtemp(prefix="wanloom-samples-")) if folder.startswith("gs://") else Path(folder)
        local.mkdir(parents=True, exist_ok=True)
        names = []
        for stem, z in latents.items():
            np.save(local / f"{stem}.npy", z)
            names.append(f"{stem}.npy")
        if self.prompts:
            (local / "prompts.txt").write_text("".join(f"prompt-{i:03d}: {p}\n" for i, p in enumerate(self.prompts)))
            names.append("prompts.txt")
        names.append(self._decode_spec.write(local).name)
        if self.decodes:
            names += media.decode_folder(local, self._load_vae(), FPS)
        if folder.startswith("gs://"):
            from wanloom_trainer.checkpoint.gcs import GcsLocation, upload_dir

            upload_dir(local, GcsLocation.parse(folder))
        return Samples(folder, tuple(names), local)

    def _load_vae(self) -> Any:
        if self._vae is None:
            from wanloom_trainer.sampling import media

            spec = self._decode_spec
            if spec.vae is not None and spec.vae.startswith("gs://"):
                from wanloom_trainer.checkpoint.gcs import stage_weights

                root, _, sub = spec.vae.rstrip("/").rpartition("/")
                staged = stage_weights(root, Path(self.config.run_dir) / "weights", [sub]) / sub
                spec = dataclasses.replace(spec, vae=str(staged))
            self._vae = media.open_vae(spec)
        return self._vae

    def _vae_source(self) -> str | None:
        """``spec.validation.vae``, else ``<model.weights>/vae``; None: the tiny variants' small random VAE."""
        spec, weights = self.config.spec, self.config.model.weights
        folder = spec.vae or (f"{weights.rstrip('/')}/vae" if weights else None)
        if folder is None and self.config.model.variant not in TINY_VARIANTS:
            raise ValueError(
                "spec.validation.videos: no VAE to decode the videos with; set spec.validation.vae (a diffusers "
                "vae/ folder) or spec.model.weights, or set videos: 0"
            )
        return folder


def cleanup(samples: Samples) -> None:
    """Remove the local staging copy of samples uploaded to gs://."""
    if samples.local is not None and samples.folder.startswith("gs://"):
        shutil.rmtree(samples.local, ignore_errors=True)
