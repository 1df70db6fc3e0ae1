"""Loading diffusers-written Wan checkpoints: key map, shards + index, dtype policy, memory mapping, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.model.load import (
    EXPERT_SUBFOLDERS,
    SafetensorsFile,
    checkpoint_files,
    diffusers_key,
    diffusers_key_map,
    load_diffusers_transformer,
    variant_from_config,
)
from wanloom_trainer.model.params import param_name
from wanloom_trainer.model.wan_jax import abstract_model

torch = pytest.importorskip("torch")


def _params(model: nnx.Module) -> dict[str, np.ndarray]:
    return {param_name(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _expected(name: str, state_dict: dict, ndim: int) -> np.ndarray:
    key, transform = diffusers_key(name, ndim)
    return transform(state_dict[key].float().numpy())


def test_sharded_checkpoint_loads_every_tensor_exactly(tiny_checkpoints) -> None:
    torch_model, folder = tiny_checkpoints["tiny"]
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert len(set(checkpoint_files(folder).values())) > 1, "test needs a checkpoint split over several shards"
    model = load_diffusers_transformer(folder, get_variant("tiny"))
    state_dict = torch_model.state_dict()
    params = _params(model)
    assert set(diffusers_key_map(model).values()) == set(state_dict), "key map must cover the checkpoint exactly"
    for name, value in params.items():
        np.testing.assert_array_equal(value, _expected(name, state_dict, value.ndim), err_msg=name)


def test_key_map_is_nearly_identity() -> None:
    model = abstract_model(get_variant("tiny"))
    key_map = diffusers_key_map(model)
    assert key_map["blocks.1.attn1.to_out.0.kernel"] == "blocks.1.attn1.to_out.0.weight"
    assert key_map["blocks.0.ffn.net.0.proj.kernel"] == "blocks.0.ffn.net.0.proj.weight"
    assert key_map["blocks.0.attn2.norm_k.scale"] == "blocks.0.attn2.norm_k.weight"
    assert key_map["condition_embedder.time_embedder.linear_1.bias"] == "condition_embedder.time_embedder.linear_1.bias"
    assert key_map["scale_shift_table"] == "scale_shift_table"
    assert key_map["patch_embedding.kernel"] == "patch_embedding.weight"


def _is_fp32_by_policy(name: str) -> bool:
    return (
        name.startswith(("patch_embedding.", "condition_embedder."))
        or ".norm" in name
        or name.endswith("scale_shift_table")
    )


def test_dtype_policy_bf16_params_keep_fp32_norms_embedders_and_tables(tiny_checkpoints) -> None:
    _, folder = tiny_checkpoints["tiny"]
    model = load_diffusers_transformer(folder, get_variant("tiny"), param_dtype=jnp.bfloat16)
    dtypes = {name: value.dtype for name, value in _params(model).items()}
    fp32 = {name for name in dtypes if _is_fp32_by_policy(name)}
    assert {"blocks.0.scale_shift_table", "blocks.1.norm2.bias", "condition_embedder.time_proj.kernel"} <= fp32
    assert all(dtypes[name] == jnp.float32 for name in fp32)
    assert all(dtypes[name] == jnp.bfloat16 for name in set(dtypes) - fp32)
    assert dtypes["blocks.0.attn1.to_q.kernel"] == jnp.bfloat16 and dtypes["proj_out.kernel"] == jnp.bfloat16


def test_bf16_single_file_checkpoint_loads_into_fp32_params(make_checkpoint, tmp_path: Path) -> None:
    torch_model, folder = make_checkpoint(get_variant("tiny"), seed=3, max_shard_size=None, dtype=torch.bfloat16)
    assert not list(folder.glob("*.index.json")) and len(list(folder.glob("*.safetensors"))) == 1
    model = load_diffusers_transformer(folder)
    state_dict = torch_model.state_dict()
    for name, value in _params(model).items():
        assert value.dtype == np.float32, name
        np.testing.assert_array_equal(value, _expected(name, state_dict, value.ndim), err_msg=name)


def test_tensors_are_zero_copy_views_of_the_memory_map(tiny_checkpoints) -> None:
    _, folder = tiny_checkpoints["tiny"]
    key, path = next(iter(checkpoint_files(folder).items()))
    file = SafetensorsFile(path)
    view = file.tensor(key)
    assert np.shares_memory(view, file._map)
    assert isinstance(view, np.memmap)


def test_two_expert_layout_loads_each_expert(make_checkpoint, tmp_path: Path) -> None:
    variant = get_variant("tiny")
    high, _ = make_checkpoint(variant, seed=11, folder=tmp_path / EXPERT_SUBFOLDERS["high_noise"])
    low, _ = make_checkpoint(variant, seed=12, folder=tmp_path / EXPERT_SUBFOLDERS["low_noise"])
    for expert, torch_model in (("high_noise", high), ("low_noise", low)):
        model = load_diffusers_transformer(tmp_path / EXPERT_SUBFOLDERS[expert], variant)
        want = torch_model.state_dict()["blocks.1.ffn.net.2.weight"].numpy().T
        np.testing.assert_array_equal(np.asarray(model.blocks[1].ffn.net[2].kernel[...]), want, err_msg=expert)


def test_variant_is_derived_from_config(tiny_checkpoints, tiny_variants) -> None:
    config = json.loads((tiny_checkpoints["tiny"][1] / "config.json").read_text())
    assert variant_from_config(config) == get_variant("tiny")
    custom = variant_from_config({**config, "ffn_dim": 48, "num_layers": 3}, "some/folder")
    assert (custom.name, custom.ffn_dim, custom.num_layers, custom.dim) == ("custom:some/folder", 48, 3, 32)
    i2v = variant_from_config(json.loads((tiny_checkpoints["tiny-i2v"][1] / "config.json").read_text()))
    assert (i2v.name, i2v.in_channels, i2v.out_channels) == ("tiny-i2v", 12, 4)


def test_config_mismatch_names_the_field(tiny_checkpoints, tiny_variants) -> None:
    _, folder = tiny_checkpoints["tiny"]
    with pytest.raises(ValueError, match=r"config.json: in_channels=4 but variant 'tiny-i2v' has in_channels=12"):
        load_diffusers_transformer(folder, tiny_variants["tiny-i2v"])


def test_missing_tensor_is_named(tiny_checkpoints, tmp_path: Path) -> None:
    _, source = tiny_checkpoints["tiny"]
    folder = tmp_path / "broken"
    shutil.copytree(source, folder)
    index_path = folder / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["blocks.1.ffn.net.2.bias"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"missing keys \['blocks.1.ffn.net.2.bias'\]"):
        load_diffusers_transformer(folder)


def test_missing_config_and_weights_are_reported(tmp_path: Path, tiny_checkpoints) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json not found"):
        load_diffusers_transformer(tmp_path)
    shutil.copy(tiny_checkpoints["tiny"][1] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"expected one \*.safetensors file"):
        load_diffusers_transformer(tmp_path)
