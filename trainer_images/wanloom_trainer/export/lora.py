"""Export a LoRA job's adapters, alone or merged into the base weights.

A LoRA checkpoint (``spec.lora``) holds only the adapters of the experts that trained: ``lora_A`` [r, in] and
``lora_B`` [out, r] per adapted linear, under the linear's diffusers name (``blocks.0.attn1.to_q.lora_A.weight``;
the JAX trainer's are renamed to these by ``sources``). The exported adapters carry the job's scale
``alpha / r`` folded into ``lora_B``, so every loader applies them with scale 1 whatever convention it follows:

``diffusers``: ``transformer/pytorch_lora_weights.safetensors`` (high-noise expert, or the one model) and
``transformer_2/pytorch_lora_weights.safetensors`` (low-noise), keys ``transformer.blocks.…lora_A.weight`` with the
adapter config in the file's ``lora_adapter_metadata`` (r, ``lora_alpha`` = r, target modules): what
``WanTransformer3DModel.load_lora_adapter(file, prefix="transformer")`` and
``WanPipeline.load_lora_weights(file)`` (``load_into_transformer_2=True`` for the second) read.

``wan``: ``<name>_high_noise.safetensors`` / ``<name>_low_noise.safetensors`` (one model: ``<name>.safetensors``)
in the original Wan names ComfyUI's LoRA loader reads: ``diffusion_model.blocks.0.self_attn.q.lora_A.weight``,
``….lora_B.weight`` and ``….alpha`` (= r).

``--merge``: full weights, ``W + (alpha / r)·B·A``, in either full layout (``layouts``), the base read one tensor at
a time from the job's ``model.weights``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from wanloom_api.metrics import EXPERT_LABELS
from wanloom_api.trainingjob import LoraSpec
from wanloom_trainer.checkpoint.safetensors_files import SafetensorsFile, checkpoint_files
from wanloom_trainer.config.variants import EXPERT_SUBFOLDERS, WanVariant
from wanloom_trainer.export.safetensors_out import TensorEntry, write_safetensors
from wanloom_trainer.export.sources import CheckpointTensors
from wanloom_trainer.export.wan_keys import wan_key

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
DIFFUSERS_PREFIX = "transformer"  # diffusers' Wan LoRA files name the model "transformer" (both experts)
_PARTS = (".lora_A.weight", ".lora_B.weight")


def is_lora(source: CheckpointTensors) -> bool:
    """Does the checkpoint hold adapters (a LoRA job's) rather than full weights?"""
    return any(e.key.endswith(_PARTS) for e in source.entries(source.expert_ids[0]))


def trained_experts(source: CheckpointTensors, lora: LoraSpec, experts: int) -> list[int]:
    """The experts whose adapters trained: those of ``lora.experts`` (the JAX trainer keeps zero adapters on the
    other, the PyTorch trainer none)."""
    return [e for e in source.expert_ids if lora.experts == "both" or experts == 1 or EXPERT_LABELS[e] == lora.experts]


def adapted_modules(source: CheckpointTensors, expert: int) -> list[str]:
    """The diffusers names of the linears ``expert``'s adapters modify, in checkpoint order."""
    return [e.key.removesuffix(".lora_A.weight") for e in source.entries(expert) if e.key.endswith(".lora_A.weight")]


def _scaled(source: CheckpointTensors, expert: int, key: str, scale: float) -> np.ndarray:
    tensor = source.read(expert, key)
    return tensor * np.float32(scale) if key.endswith(".lora_B.weight") else tensor


def write_lora_files(
    source: CheckpointTensors,
    lora: LoraSpec,
    *,
    fmt: str,
    dest: object,
    name: str,
    dtype: str,
    experts: int,
) -> dict[str, list[str]]:
    """Each adapted expert's adapter file under ``dest`` (a ``layouts._Destination``); the files by expert label.

    ``experts``: the variant's expert count (a checkpoint of a job that adapted one expert holds only that one).
    ``dest`` is a ``layouts._Destination`` (``path(relative)``, ``done(relative)``).
    """
    files: dict[str, list[str]] = {}
    for expert in trained_experts(source, lora, experts):
        entries = [e for e in source.entries(expert) if e.key.endswith(_PARTS)]
        if fmt == "diffusers":
            relative = f"{EXPERT_SUBFOLDERS[expert]}/{LORA_WEIGHTS_NAME}"
            renamed = {f"{DIFFUSERS_PREFIX}.{e.key}": e for e in entries}
            config = {"r": lora.rank, "lora_alpha": lora.rank, "target_modules": sorted(lora.targets)}
            metadata = {
                "format": "pt",
                "lora_adapter_metadata": json.dumps({f"{DIFFUSERS_PREFIX}.{k}": v for k, v in config.items()}),
            }
        else:
            stem = f"{name}_{EXPERT_LABELS[expert]}" if experts > 1 else name
            relative = f"{stem}.safetensors"
            renamed = {_wan_lora_key(e.key): e for e in entries}
            metadata = {"format": "pt"}
        out_entries = [TensorEntry(k, e.shape) for k, e in renamed.items()]
        alphas: dict[str, str] = {}
        if fmt == "wan":
            alphas = {f"{_wan_module(m)}.alpha": m for m in adapted_modules(source, expert)}
            out_entries += [TensorEntry(key, ()) for key in alphas]

        def read(key: str, expert: int = expert, renamed: dict = renamed, alphas: dict = alphas) -> np.ndarray:
            if key in alphas:
                return np.asarray(lora.rank, dtype=np.float32)
            return _scaled(source, expert, renamed[key].key, lora.scale)

        write_safetensors(dest.path(relative), out_entries, read, dtype=dtype, metadata=metadata)
        dest.done(relative)
        files[EXPERT_LABELS[expert]] = [relative]
    return files


def _wan_module(diffusers_module: str) -> str:
    return "diffusion_model." + wan_key(diffusers_module + ".weight").removesuffix(".weight")


def _wan_lora_key(diffusers_key: str) -> str:
    for part in _PARTS:
        if diffusers_key.endswith(part):
            return _wan_module(diffusers_key.removesuffix(part)) + part
    raise ValueError(f"{diffusers_key!r} is not an adapter tensor")


class MergedTensors:
    """The base weights with every adapter folded in (``W + scale·B·A``), one tensor at a time: a
    ``CheckpointTensors`` for the full layouts. Experts without adapters are the base unchanged."""

    def __init__(self, base: BaseWeights, adapters: CheckpointTensors, lora: LoraSpec) -> None:
        self.uri, self.step, self.experts = adapters.uri, adapters.step, base.experts
        self.expert_ids = tuple(range(base.experts))
        self._base, self._adapters, self._scale = base, adapters, lora.scale
        trained = trained_experts(adapters, lora, base.experts)
        self._modules = {e: set(adapted_modules(adapters, e)) for e in trained}

    def entries(self, expert: int) -> list[TensorEntry]:
        return self._base.entries(expert)

    def read(self, expert: int, key: str) -> np.ndarray:
        weight = self._base.read(expert, key)
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module in self._modules.get(expert, ()):
            a = self._adapters.read(expert, f"{module}.lora_A.weight")
            b = self._adapters.read(expert, f"{module}.lora_B.weight")
            weight = weight + np.float32(self._scale) * (b @ a)
        return weight


class BaseWeights:
    """A diffusers pipeline root's expert folders (``transformer/``, ``transformer_2/``), read one tensor at a time
    (``checkpoint.safetensors_files``: no torch or jax needed)."""

    def __init__(self, root: Path, variant: WanVariant) -> None:
        self.experts = 2 if variant.two_experts else 1
        self._files: dict[int, dict[str, SafetensorsFile]] = {}
        for expert in range(self.experts):
            folder = root / EXPERT_SUBFOLDERS[expert]
            if not folder.is_dir():
                raise FileNotFoundError(f"spec.model.weights: {folder} is not a folder")
            opened: dict[Path, SafetensorsFile] = {}
            self._files[expert] = {
                key: opened.setdefault(path, SafetensorsFile(path)) for key, path in checkpoint_files(folder).items()
            }

    def entries(self, expert: int) -> list[TensorEntry]:
        return [TensorEntry(key, f.shape(key)) for key, f in self._files[expert].items()]

    def read(self, expert: int, key: str) -> np.ndarray:
        return self._files[expert][key].float32(key)


@contextmanager
def base_weights(uri: str | None, variant: WanVariant, staging: Path) -> Iterator[BaseWeights]:
    """The job's ``model.weights`` (a path or ``gs://``, staged under ``staging``) as ``BaseWeights``.

    Raises:
        ValueError: no ``model.weights``: the adapters' base is not on disk to merge into.
    """
    if uri is None:
        raise ValueError(
            "--merge folds the adapters into the base weights, and spec.model.weights is unset (a random base); "
            "export the adapters alone, or train from saved weights"
        )
    if uri.startswith("gs://"):
        from wanloom_trainer.checkpoint.gcs import stage_weights

        subfolders = EXPERT_SUBFOLDERS[: 2 if variant.two_experts else 1]
        yield BaseWeights(stage_weights(uri, staging, subfolders), variant)
        return
    yield BaseWeights(Path(uri), variant)
