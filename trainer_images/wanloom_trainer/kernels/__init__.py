"""Fused kernels and their plain references, one file per op per backend.

AdaLN (``y = LayerNorm(x) · (1 + scale) + shift``, the modulated LayerNorm of every Wan block):

- ``adaln_shapes.py``: the shape/dtype contract, pure Python, shared by both launchers.
- ``adaln_ref_torch.py`` / ``adaln_ref_jax.py``: plain framework code (the eager chain the kernels replace).
- ``adaln_triton.py``: Triton kernels + ``AdaLNFunction`` (PyTorch, GPU; CPU only in the Triton interpreter).
- ``adaln_pallas.py``: Pallas/Mosaic kernels + ``jax.custom_vjp`` (JAX, TPU; the Pallas interpreter elsewhere).
- ``adaln_memory.py``: bytes saved for backward (torch saved-tensor hooks, JAX residuals).
- ``triton_aot.py``: compile Triton kernels for sm_90/sm_100 without a GPU; registers, spills, occupancy.

Dispatch: model code calls one entry per framework and passes the TrainingJob's ``kernels.adaln`` value as ``impl``:
``adaln_torch(x, scale, shift, *, eps=1e-6, impl="fused" | "reference")`` (``dispatch_torch.py``) and
``adaln_jax(...)`` (``dispatch_jax.py``). The choice is explicit and never falls back silently: ``impl="fused"`` on
CPU torch tensors needs ``TRITON_INTERPRET=1`` set before the Triton module is first imported, and raises otherwise.
Nothing heavy is imported here: the two entry points are loaded on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from wanloom_api.trainingjob import ADALN_IMPLS

_LAZY = {"adaln_torch": "wanloom_trainer.kernels.dispatch_torch", "adaln_jax": "wanloom_trainer.kernels.dispatch_jax"}

__all__ = ["ADALN_IMPLS", "adaln_jax", "adaln_torch"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
