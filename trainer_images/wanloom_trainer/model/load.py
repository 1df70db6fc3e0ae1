"""Load a diffusers ``WanTransformer3DModel`` checkpoint (safetensors) into the NNX model, streaming.

Layout of a Wan 2.2 diffusers repository: ``transformer/`` is the high-noise expert and ``transformer_2/`` the
low-noise expert (A14B); each holds ``config.json`` and either one ``diffusion_pytorch_model.safetensors`` or
shards listed in ``diffusion_pytorch_model.safetensors.index.json``.

Streaming: every shard is memory-mapped and tensors are read one at a time, cast to the dtype the model's
precision policy gives that parameter (``WanTransformer3DModel``), and placed at once: with a sharding, each
device reads only its own slice of the mapped file (``jax.make_array_from_callback``, which also works across
hosts); without one, the tensor goes to the default device with ``jax.device_put``. Host memory therefore never
holds more than one tensor beyond the page cache, and never a second copy of the model.

The files are read by ``checkpoint.safetensors_files`` (bfloat16 tensors as ``ml_dtypes`` views).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from wanloom_api.metrics import EXPERT_LABELS
from wanloom_trainer.checkpoint.safetensors_files import SafetensorsFile, checkpoint_files
from wanloom_trainer.config import variants
from wanloom_trainer.config.variants import VARIANTS, WanVariant
from wanloom_trainer.model.params import ShardingSpec, param_name, sharding_for
from wanloom_trainer.model.wan_jax import WanTransformer3DModel, abstract_model

EXPERT_SUBFOLDERS = dict(zip(EXPERT_LABELS, variants.EXPERT_SUBFOLDERS, strict=True))
# Keys diffusers itself ignores when loading a Wan transformer.
IGNORED_KEY_PARTS = ("norm_added_q",)
_LORA_KEYS = {"lora_a": "lora_A.weight", "lora_b": "lora_B.weight"}  # NNX leaf -> diffusers LoRA key
_VARIANT_KEYS = (
    "ffn_dim",
    "num_layers",
    "in_channels",
    "out_channels",
    "text_dim",
    "freq_dim",
    "patch_size",
    "eps",
    "rope_max_seq_len",
)
Transform = Callable[[np.ndarray], np.ndarray]


def diffusers_key(name: str, ndim: int) -> tuple[str, Transform]:
    """Checkpoint key and layout change for one NNX parameter name (see ``params.param_name``).

    Linear kernels are stored transposed (torch ``[out, in]`` vs ``[in, out]``); the Conv3d patch embedding is
    ``[out, in, t, h, w]`` in torch and ``[t, h, w, in, out]`` here; norm ``scale`` is torch's ``weight``; LoRA's
    ``lora_a`` [in, r] / ``lora_b`` [r, out] are a diffusers LoRA file's ``lora_A.weight`` / ``lora_B.weight``,
    transposed (``model.lora_jax``).
    """
    prefix, _, leaf = name.rpartition(".")
    if leaf in _LORA_KEYS:
        return f"{prefix}.{_LORA_KEYS[leaf]}", np.transpose
    if leaf == "kernel" and ndim == 5:
        return f"{prefix}.weight", lambda w: np.transpose(w, (2, 3, 4, 1, 0))
    if leaf == "kernel":
        return f"{prefix}.weight", np.transpose
    if leaf == "scale":
        return f"{prefix}.weight", lambda w: w
    return name, lambda w: w


def torch_axes(name: str, ndim: int) -> tuple[int, ...]:
    """The axis order that turns NNX parameter ``name`` back into its checkpoint (torch) layout: the inverse of
    ``diffusers_key``'s layout change, used by the exporters."""
    leaf = name.rpartition(".")[2]
    if leaf == "kernel" and ndim == 5:
        return (4, 3, 0, 1, 2)
    if leaf == "kernel" or leaf in _LORA_KEYS:
        return tuple(reversed(range(ndim)))
    return tuple(range(ndim))


def diffusers_key_map(model: nnx.Module) -> dict[str, str]:
    """NNX parameter name → diffusers checkpoint key, for every parameter of ``model`` (abstract or real)."""
    return {
        param_name(path): diffusers_key(param_name(path), var.get_value().ndim)[0]
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def _check_keys(expected: set[str], found: set[str], folder: Path) -> None:
    missing = sorted(expected - found)
    unexpected = sorted(k for k in found - expected if not any(part in k for part in IGNORED_KEY_PARTS))
    if missing or unexpected:
        raise ValueError(
            f"{folder}: checkpoint does not match the model; missing keys {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} ({len(missing)}), unexpected keys {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )


def _place(view: np.ndarray, dtype: np.dtype, sharding: jax.sharding.Sharding | None) -> jax.Array:
    if sharding is None:
        return jax.device_put(np.asarray(view, dtype=dtype))
    # Each device copies only its slice out of the memory map.
    return jax.make_array_from_callback(view.shape, sharding, lambda index: np.asarray(view[index], dtype=dtype))


def _stream(folder: Path, abstract: nnx.Module, shardings: ShardingSpec) -> Iterator[tuple[tuple, nnx.Variable]]:
    files = checkpoint_files(folder)
    flat = list(nnx.to_flat_state(nnx.state(abstract, nnx.Param)))
    plan = {path: diffusers_key(param_name(path), var.get_value().ndim) for path, var in flat}
    _check_keys({key for key, _ in plan.values()}, set(files), folder)
    opened: dict[Path, SafetensorsFile] = {}
    for path, var in flat:
        name, target = param_name(path), var.get_value()
        key, transform = plan[path]
        file = files[key]
        view = transform(opened.setdefault(file, SafetensorsFile(file)).tensor(key))
        if view.shape != target.shape:
            raise ValueError(
                f"{file}: tensor {key!r} has shape {tuple(view.shape)} after layout change, "
                f"but model parameter {name} needs {tuple(target.shape)}"
            )
        yield path, var.replace(_place(view, target.dtype, sharding_for(shardings, name, target)))


def variant_from_config(config: dict, folder: Path | str = "") -> WanVariant:
    """The known variant whose diffusers config equals ``config`` (architecture keys), else a custom one."""
    arch = {k: (tuple(v) if isinstance(v, list) else v) for k, v in config.items() if not k.startswith("_")}
    for variant in VARIANTS.values():
        if all(arch.get(k) == v for k, v in variant.diffusers_config().items()):
            return variant
    if arch.get("image_dim") is not None or arch.get("added_kv_proj_dim") is not None:
        raise ValueError(f"{folder}: image_dim/added_kv_proj_dim (Wan 2.1 CLIP image conditioning) is not supported")
    try:
        kwargs = {
            "dim": arch["num_attention_heads"] * arch["attention_head_dim"],
            "num_heads": arch["num_attention_heads"],
            **{k: arch[k] for k in _VARIANT_KEYS},
        }
    except KeyError as err:
        raise ValueError(f"{folder}/config.json: missing {err.args[0]!r}") from None
    # Not recorded in config.json: per-token timesteps, VAE stride and expert pairing keep their defaults.
    return WanVariant(name=f"custom:{folder}", two_experts=False, **kwargs)


def check_config(variant: WanVariant, config: dict, folder: Path | str) -> None:
    """Raise if the checkpoint's ``config.json`` disagrees with ``variant`` on any architecture field."""
    for key, want in variant.diffusers_config().items():
        got = config.get(key)
        got = tuple(got) if isinstance(got, list) else got
        if got != want:
            raise ValueError(f"{folder}/config.json: {key}={got!r} but variant {variant.name!r} has {key}={want!r}")


def load_diffusers_transformer(
    folder: str | os.PathLike,
    variant: WanVariant | None = None,
    *,
    shardings: ShardingSpec = None,
    **model_kwargs: object,
) -> WanTransformer3DModel:
    """Build a ``WanTransformer3DModel`` from a diffusers transformer folder, placing each tensor as it streams.

    Args:
        folder: a ``transformer``/``transformer_2`` folder (``config.json`` + safetensors). For a whole pipeline
            repository pass ``root / EXPERT_SUBFOLDERS["high_noise"]``.
        variant: architecture to check ``config.json`` against; None derives it from ``config.json``.
        shardings: placement rule or mapping by parameter name (``params.ShardingSpec``); None → default device.
        model_kwargs: constructor options (param_dtype, compute_dtype, adaln_impl, attention_impl, remat).

    Returns:
        The model; parameters have the dtypes of its precision policy whatever the checkpoint's dtype.
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: expected a diffusers WanTransformer3DModel folder")
    config = json.loads(config_path.read_text())
    if variant is None:
        variant = variant_from_config(config, folder)
    else:
        check_config(variant, config, folder)
    graphdef, abstract_state = nnx.split(abstract_model(variant, **model_kwargs))
    abstract = nnx.merge(graphdef, abstract_state)
    loaded = nnx.from_flat_state(list(_stream(folder, abstract, shardings)))
    return nnx.merge(graphdef, loaded)
