"""Low-rank adapters (LoRA) on the PyTorch experts, in the layout diffusers' PEFT integration saves and loads.

``add_lora(model, lora, seed=...)`` turns each targeted ``nn.Linear`` of every block (``spec.lora.targets``, by
diffusers name) into a ``LoRALinear`` in place, by swapping its class as the fused AdaLN patch does: the base
``weight`` and ``bias`` keep their checkpoint names, and two bias-free float32 linears are added, ``lora_A``
(in → r, initialised as PEFT does, Kaiming-uniform with a = √5) and ``lora_B`` (r → out, zeros), so an adapter that
has not trained yet changes nothing. The forward is PEFT's LoRA layer:

    y = x·Wᵀ + b + (alpha / r) · lora_B(lora_A(dropout(x)))

in the activations' dtype (the float32 adapter weights cast to it, as mixed precision casts any weight). Every
other parameter of
the model is frozen (``requires_grad = False``): the optimizer, gradients, EMA and checkpoints see only the adapters.
The adapters' state-dict keys (``blocks.0.attn1.to_q.lora_A.weight``) are a diffusers LoRA file's, so an export is
the adapter tensors under the ``transformer.`` prefix (``export.lora``). PEFT's own wrapper classes are not used:
they move the base weight to ``…to_q.base_layer.weight``, so the official weights would need renaming to load and
every full-state-dict path (FSDP broadcast, DCP, export) would carry two naming schemes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from wanloom_api.trainingjob import LoraSpec


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a float32 low-rank update (module docstring); made by ``add_lora``, not constructed."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, p=self.lora_dropout) if self.lora_dropout and self.training else x
        # In the activations' (compute) dtype, as mixed precision runs PEFT's layers: float32 copies of a 75,600-token
        # layer's inputs and outputs would hold tens of GB within one block.
        update = F.linear(F.linear(h, self.lora_A.weight.to(x.dtype)), self.lora_B.weight.to(x.dtype))
        return base + update * self.lora_scale


def lora_linears(model: nn.Module, targets: tuple[str, ...] | list[str]) -> dict[str, nn.Linear]:
    """The model's targeted linears by module name (``blocks.<i>.<target>``).

    Raises:
        ValueError: a target that names no linear layer of a block.
    """
    found = {}
    for i, block in enumerate(model.blocks):
        for target in targets:
            try:
                module = block.get_submodule(target)
            except AttributeError:
                module = None
            if not isinstance(module, nn.Linear):
                raise ValueError(f"spec.lora.targets: {target!r} is not a linear layer of blocks.{i}")
            found[f"blocks.{i}.{target}"] = module
    return found


def freeze(model: nn.Module) -> nn.Module:
    """No gradient for any parameter of ``model`` (the base of a LoRA job, or an expert it leaves alone)."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def add_lora(model: nn.Module, lora: LoraSpec, *, seed: int) -> nn.Module:
    """Freeze ``model`` and give its targeted linears adapters, in place (module docstring); returns ``model``.

    Call on an unwrapped model (before activation checkpointing and FSDP), after the fused AdaLN patch. On the meta
    device the adapters are meta too (materialised like the rest); elsewhere they are initialised from ``seed``.
    """
    freeze(model)
    generator = None
    for linear in lora_linears(model, lora.targets).values():
        device = linear.weight.device
        linear.__class__ = LoRALinear
        linear.lora_A = nn.Linear(linear.in_features, lora.rank, bias=False, device=device, dtype=torch.float32)
        linear.lora_B = nn.Linear(lora.rank, linear.out_features, bias=False, device=device, dtype=torch.float32)
        linear.lora_scale, linear.lora_dropout = lora.scale, lora.dropout
        if device.type != "meta":
            generator = generator or torch.Generator(device="cpu").manual_seed(seed)
            init_adapter(linear, generator)
    return model


def init_adapter(linear: LoRALinear, generator: torch.Generator) -> None:
    """PEFT's initialisation: ``lora_A`` Kaiming-uniform (a = √5, as ``nn.Linear`` initialises weights),
    ``lora_B`` zeros (the adapted layer starts as the base)."""
    with torch.no_grad():
        fan_in = linear.lora_A.in_features
        bound = math.sqrt(6.0 / ((1 + 5.0) * fan_in))  # kaiming_uniform_ with a = sqrt(5)
        values = torch.rand(linear.lora_A.weight.shape, generator=generator, dtype=torch.float32) * 2 - 1
        linear.lora_A.weight.copy_(values * bound)
        linear.lora_B.weight.zero_()
