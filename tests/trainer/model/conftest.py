"""Tiny Wan variants and diffusers-written checkpoints for the model tests (exposed as fixtures: the test tree
is imported with --import-mode=importlib, so test files cannot import helpers by module name)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from wanloom_trainer.config.variants import WanVariant, get_variant

TINY = get_variant("tiny")
# T2V (two experts), TI2V-like (one model, per-token timesteps) and I2V-like (two experts, 4 noise + 4 mask +
# 4 condition channels in, 4 out): the registered tiny variants of the three Wan 2.2 modes.
TINY_VARIANTS = {name: get_variant(name) for name in ("tiny", "tiny-ti2v", "tiny-i2v")}
# Small enough that save_pretrained writes several shards and an index for the tiny model (~60 KB).
SHARD_SIZE = "20KB"


def _make_torch_model(variant: WanVariant, seed: int):
    """A diffusers WanTransformer3DModel with every parameter perturbed away from its init (norm weights ≠ 1,
    biases ≠ 0), so a wrongly mapped or transposed tensor shows in the outputs."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**variant.diffusers_config()).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


MakeCheckpoint = Callable[..., tuple[object, Path]]


@pytest.fixture(scope="module")
def tiny_variants() -> dict[str, WanVariant]:
    """ "tiny" (T2V), "tiny-ti2v" (per-token timesteps) and "tiny-i2v" (12 in / 4 out channels)."""
    return TINY_VARIANTS


@pytest.fixture(scope="module")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> MakeCheckpoint:
    """``make(variant, seed=0, max_shard_size=SHARD_SIZE, dtype=None, folder=None) -> (diffusers model, folder)``
    written by diffusers' own ``save_pretrained`` (``max_shard_size=None``: one file, no index)."""
    pytest.importorskip("diffusers")

    def make(variant: WanVariant, seed: int = 0, max_shard_size: str | None = SHARD_SIZE, dtype=None, folder=None):
        model = _make_torch_model(variant, seed)
        if dtype is not None:
            model = model.to(dtype)
        folder = Path(folder) if folder is not None else tmp_path_factory.mktemp(variant.name)
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(folder, safe_serialization=True, **kwargs)
        return model, folder

    return make


@pytest.fixture(scope="module")
def tiny_checkpoints(make_checkpoint: MakeCheckpoint) -> dict[str, tuple[object, Path]]:
    """variant name -> (diffusers model, sharded checkpoint folder written by its save_pretrained)."""
    return {name: make_checkpoint(variant, seed) for seed, (name, variant) in enumerate(TINY_VARIANTS.items())}
