"""The Wan transformer in Flax NNX and its diffusers checkpoint loader.

Importing this package is cheap; the names below load jax/flax on first use:

- ``WanTransformer3DModel``, ``abstract_model``, ``init_model``, ``REMAT_POLICIES`` (``model.wan_jax``)
- ``load_diffusers_transformer``, ``EXPERT_SUBFOLDERS``, ``diffusers_key_map`` (``model.load``)
- ``xla_attention``, ``splash_attention``, ``AttentionFn`` (``model.attention``)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "WanTransformer3DModel": "wan_jax",
    "abstract_model": "wan_jax",
    "init_model": "wan_jax",
    "state_shardings": "wan_jax",
    "REMAT_POLICIES": "wan_jax",
    "load_diffusers_transformer": "load",
    "EXPERT_SUBFOLDERS": "load",
    "diffusers_key_map": "load",
    "xla_attention": "attention",
    "splash_attention": "attention",
    "AttentionFn": "attention",
    "ShardingSpec": "params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
