"""Parameter names and placement rules shared by random init (wan_jax) and checkpoint loading (load).

A parameter is named by its dotted NNX path, e.g. ``blocks.3.attn1.to_q.kernel``: the diffusers key with
``weight`` spelled ``kernel`` (Linear/Conv) or ``scale`` (norms). A placement rule (``ShardingSpec``) maps that
name and the parameter's abstract value to a ``jax.sharding.Sharding``; ``None`` keeps JAX's default placement.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

ShardingRule = Callable[[str, jax.ShapeDtypeStruct], jax.sharding.Sharding | None]
ShardingSpec = ShardingRule | Mapping[str, jax.sharding.Sharding] | None


def param_name(path: tuple[Any, ...]) -> str:
    """Dotted name of an NNX state path: (blocks, 0, attn1, to_q, kernel) → ``blocks.0.attn1.to_q.kernel``."""
    return ".".join(str(getattr(part, "key", part)) for part in path)


def sharding_for(spec: ShardingSpec, name: str, abstract: jax.ShapeDtypeStruct) -> jax.sharding.Sharding | None:
    """Resolve one parameter's placement; a mapping must name every parameter."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        try:
            return spec[name]
        except KeyError:
            raise KeyError(f"sharding mapping has no entry for parameter {name!r}") from None
    return spec(name, abstract)
