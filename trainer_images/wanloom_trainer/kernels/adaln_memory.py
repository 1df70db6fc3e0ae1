"""Bytes an op keeps alive for its backward: torch saved-tensor hooks and JAX VJP residuals.

Used by the memory test and ``benchmarks/adaln_kernels.py`` to compare the fused AdaLN kernels with the eager chain.
Counting is per storage (PyTorch) or per buffer (JAX), so a tensor saved twice, or a view of one, counts once.
``total`` counts everything saved; ``new`` leaves out buffers that are the call's own inputs (the caller may hold
those anyway), i.e. the activation memory the op itself adds. jax and torch are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SavedBytes:
    total: int
    new: int

    def saving_vs(self, baseline: SavedBytes) -> tuple[float, float]:
        """Fractions saved relative to ``baseline``: ``(total, new)``, e.g. 0.75 = 75% fewer bytes."""
        return 1 - self.total / baseline.total, 1 - self.new / max(1, baseline.new)


def saved_bytes_torch(fn: Callable[..., Any], *args: Any) -> SavedBytes:
    """Run ``fn(*args)`` once under ``saved_tensors_hooks`` and sum the storages autograd saved."""
    import torch

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return SavedBytes(sum(saved.values()), sum(n for ptr, n in saved.items() if ptr not in inputs))


def residual_bytes_jax(fn: Callable[..., Any], *args: Any) -> SavedBytes:
    """Sum the arrays ``jax.vjp(fn, *args)`` keeps in its pullback (the residuals of the linearised fn)."""
    import jax

    _, pullback = jax.vjp(fn, *args)
    residuals = {_buffer_id(a): a.nbytes for a in jax.tree_util.tree_leaves(pullback) if isinstance(a, jax.Array)}
    inputs = {_buffer_id(a) for a in args if isinstance(a, jax.Array)}
    return SavedBytes(sum(residuals.values()), sum(n for key, n in residuals.items() if key not in inputs))


def _buffer_id(a: Any) -> int:
    try:
        return a.unsafe_buffer_pointer()
    except Exception:  # sharded or deleted arrays have no single pointer: fall back to identity
        return id(a)
