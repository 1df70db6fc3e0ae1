"""Validation videos (``spec.validation.videos``): the first held-out samples generated from their own text (and,
for I2V, their first-frame condition) with the current weights at each validation.

Every process runs the sampler (``Backend.predict`` is collective); process 0 decodes with the VAE and writes
``sample-<id>.mp4`` per sample and ``contact-sheet.png`` to ``<samples dir>/step-NNNNNN/`` (``tracking.artifact_dir``:
the run directory locally, beside a gs:// checkpoint root on a cluster, uploaded file by file). The starting noise
depends only on (seed, sample id), so the videos of successive validations differ by the weights alone, and
nothing here touches the training state or its random streams.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wanloom_api.trainingjob import DEFAULT_SAMPLING
from wanloom_trainer.config.train_config import TrainConfig
from wanloom_trainer.sampling.sampler import SamplerConfig, sample
from wanloom_trainer.tracking import artifact_dir

_NOISE_STREAM = 0x5A3E
FPS = 16


@dataclass(frozen=True)
class Samples:
    """What one validation generated: its folder (local path or gs://) and the files in it (names)."""

    folder: str
    files: tuple[str, ...]
    local: Path | None  # the files process 0 wrote (a staging copy for gs://; None on other processes)


def sampler_config(config: TrainConfig) -> SamplerConfig:
    steps, shift, guidance = DEFAULT_SAMPLING[config.model.variant]
    spec = config.validation
    if spec.inference_steps is not None:
        steps = spec.inference_steps
    if spec.guidance_scale is not None:
        guidance = (spec.guidance_scale, spec.guidance_scale)
    return SamplerConfig(steps, shift, config.routing.boundary_ratio, guidance)


class SampleWriter:
    """Generates the first ``videos`` held-out samples; ``vae`` is loaded on process 0 at the first call."""

    def __init__(self, config: TrainConfig, backend: Any, dataset: Any, sample_ids: np.ndarray) -> None:
        self.config, self.backend, self.dataset = config, backend, dataset
        self.ids = [int(i) for i in sample_ids[: config.validation.videos]]
        self.sampler = sampler_config(config)
        # Both fail at the start of the run, not at the first validation: the unconditional prompt, and the VAE.
        self.empty_text = dataset.empty_prompt(needed_by="spec.validation.videos")
        self._vae_uri = self._vae_source() if backend.process_index == 0 else None
        self._vae: Any = None

    def run(self, state: Any, steps_done: int) -> Samples:
        latents = []
        for sid in self.ids:
            batch = self.dataset.load([sid])
            noise = np.random.default_rng([self.config.seed, sid, _NOISE_STREAM]).standard_normal(
                batch.latents.shape, dtype=np.float32
            )
            latents.append(
                sample(
                    lambda e, x, t, c: self.backend.predict(state, e, x, t, c),
                    noise,
                    batch.text_embeds,
                    self.empty_text,
                    self.sampler,
                    batch.condition,
                )
            )
        folder = f"{artifact_dir(self.config, 'samples')}/step-{steps_done:06d}"
        if self.backend.process_index != 0:
            return Samples(folder, (), None)
        return self._write(latents, folder)

    def _write(self, latents: list[np.ndarray], folder: str) -> Samples:
        from wanloom_trainer.sampling import media

        local = Path(tempfile.mkdtemp(prefix="wanloom-samples-")) if folder.startswith("gs://") else Path(folder)
        local.mkdir(parents=True, exist_ok=True)
        vae = self._load_vae()
        videos = [media.decode(vae, z)[0] for z in latents]
        names = [
            media.write_mp4(v, local / f"sample-{sid:06d}.mp4", FPS).name
            for sid, v in zip(self.ids, videos, strict=True)
        ]
        names.append(media.contact_sheet(videos, local / "contact-sheet.png").name)
        if folder.startswith("gs://"):
            from wanloom_trainer.checkpoint.gcs import GcsLocation, upload_dir

            upload_dir(local, GcsLocation.parse(folder))
        return Samples(folder, tuple(names), local)

    def _load_vae(self) -> Any:
        if self._vae is None:
            from wanloom_trainer.sampling import media

            if self._vae_uri is None:
                self._vae = media.small_vae(self.config.model.wan.latent_channels, self.config.seed)
            elif self._vae_uri.startswith("gs://"):
                from wanloom_trainer.checkpoint.gcs import stage_weights

                root, _, sub = self._vae_uri.rstrip("/").rpartition("/")
                self._vae = media.load_vae(stage_weights(root, Path(self.config.run_dir) / "weights", [sub]) / sub)
            else:
                self._vae = media.load_vae(self._vae_uri)
        return self._vae

    def _vae_source(self) -> str | None:
        """``spec.validation.vae``, else ``<model.weights>/vae``; None: the tiny variants' small random VAE."""
        spec, weights = self.config.validation, self.config.model.weights
        folder = spec.vae or (f"{weights.rstrip('/')}/vae" if weights else None)
        if folder is None and not self.config.model.variant.startswith("tiny"):
            raise ValueError(
                "spec.validation.videos: no VAE to decode the videos with; set spec.validation.vae (a diffusers "
                "vae/ folder) or spec.model.weights, or set videos: 0"
            )
        return folder


def cleanup(samples: Samples) -> None:
    """Remove the local staging copy of samples uploaded to gs://."""
    if samples.local is not None and samples.folder.startswith("gs://"):
        shutil.rmtree(samples.local, ignore_errors=True)
