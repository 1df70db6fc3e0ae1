"""Wan 2.2 experts for the PyTorch trainer: diffusers' ``WanTransformer3DModel`` (the reference implementation).

A two-expert variant (A14B, tiny) has a high-noise expert (diffusers folder ``transformer/``, routing expert 0) and
a low-noise expert (``transformer_2/``, routing expert 1); the dense TI2V-5B has one model in ``transformer/``.

``use_fused_adaln`` routes the model's three norm-and-modulate chains (``norm1`` before self-attention, ``norm3``
before the FFN, ``norm_out`` before ``proj_out``) through the fused Triton AdaLN kernel by swapping the classes of
the block and model instances for subclasses whose ``forward`` differs from diffusers' only in those lines.
Parameters, buffers and state-dict keys are untouched, so checkpoints and FSDP sharding are unaffected. The two
forwards follow ``transformer_wan.py`` of diffusers ``DIFFUSERS_FORWARDS`` (pyproject bounds the dependency to that
minor release; the parity tests compare them with diffusers' own forward).

Read bottom-up: expert naming, building/loading, the fused block, the fused model, the patch function.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import WanTransformer3DModel
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_wan import WanTransformerBlock

from wanloom_api.metrics import EXPERT_LABELS
from wanloom_api.trainingjob import ADALN_IMPLS
from wanloom_trainer.config.variants import EXPERT_SUBFOLDERS, WanVariant

# Expert index (``wanloom_trainer.routing.HIGH_NOISE`` = 0, ``LOW_NOISE`` = 1) -> (name, diffusers subfolder).
EXPERTS: tuple[tuple[str, str], ...] = tuple(zip(EXPERT_LABELS, EXPERT_SUBFOLDERS, strict=True))
DIFFUSERS_FORWARDS = "0.42"  # the diffusers release whose Wan forwards the fused subclasses below follow


def expert_names(variant: WanVariant) -> tuple[str, ...]:
    """Names of the variant's experts in routing-index order (one name for single-model variants)."""
    return tuple(name for name, _ in EXPERTS[: 2 if variant.two_experts else 1])


def expert_subfolders(variant: WanVariant) -> tuple[str, ...]:
    """The experts' diffusers subfolders in routing-index order."""
    return tuple(sub for _, sub in EXPERTS[: 2 if variant.two_experts else 1])


def build_expert(variant: WanVariant, *, seed: int) -> WanTransformer3DModel:
    """A randomly initialised fp32 expert; the global torch RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WanTransformer3DModel(**variant.diffusers_config())  # fp32: torch's default dtype


def _check_config(variant: WanVariant, folder: Path) -> None:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: expected a diffusers WanTransformer3DModel folder")
    config = json.loads(config_path.read_text())
    for key, want in variant.diffusers_config().items():
        got = config.get(key)
        got = tuple(got) if isinstance(got, list) else got
        if got != want:
            raise ValueError(f"{config_path}: {key}={got!r} but model variant {variant.name!r} has {key}={want!r}")


def load_expert(folder: str | Path, variant: WanVariant) -> WanTransformer3DModel:
    """Load one expert from a local diffusers folder (``config.json`` + safetensors) as fp32 master weights.

    Raises:
        FileNotFoundError: no ``config.json`` in ``folder``.
        ValueError: the folder's architecture differs from ``variant`` (the message names the key).
    """
    folder = Path(folder)
    _check_config(variant, folder)
    # fp32 whatever the checkpoint's dtype: these are the master weights the optimizer updates.
    return WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.float32, low_cpu_mem_usage=True)


def build_experts(variant: WanVariant, *, weights: str | Path | None, seed: int) -> list[WanTransformer3DModel]:
    """Every expert of ``variant`` in routing-index order.

    Args:
        variant: the architecture.
        weights: local diffusers pipeline root holding ``transformer/`` (and ``transformer_2/``); None builds
            random weights (expert i seeded with ``seed + i``). Remote roots are staged by the caller.
        seed: initialisation seed for random weights.
    """
    subfolders = expert_subfolders(variant)
    if weights is None:
        return [build_expert(variant, seed=seed + i) for i in range(len(subfolders))]
    return [load_expert(Path(weights) / sub, variant) for sub in subfolders]


def _adaln(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    from wanloom_trainer.kernels import adaln_torch  # lazy: pulls in Triton

    return adaln_torch(x, scale, shift, eps=eps, impl="fused")


def _split_modulation(table: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The six fp32 shift/scale/gate tensors: [B, 1, D] (one timestep per sample) or [B, S, D] (per token)."""
    if temb.ndim == 4:  # [B, S, 6, D]: Wan 2.2 TI2V per-token timesteps
        return tuple(m.squeeze(2) for m in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2))
    return (table + temb.float()).chunk(6, dim=1)  # [B, 6, D]: Wan 2.1 / 2.2 A14B


class FusedAdaLNWanTransformerBlock(WanTransformerBlock):
    """``WanTransformerBlock`` whose norm1/norm3 modulate chains run in the fused AdaLN kernel."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = _split_modulation(
            self.scale_shift_table, temb
        )
        # 1. Self-attention: fused LayerNorm(x)·(1 + scale) + shift (fp32 inside, x's dtype out, like diffusers)
        norm_hidden_states = _adaln(hidden_states, scale_msa, shift_msa, self.norm1.eps)
        attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)
        hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)

        # 2. Cross-attention (affine LayerNorm, no modulation: unchanged)
        norm_hidden_states = self.norm2(hidden_states.float()).type_as(hidden_states)
        attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
        hidden_states = hidden_states + attn_output

        # 3. Feed-forward
        norm_hidden_states = _adaln(hidden_states, c_scale_msa, c_shift_msa, self.norm3.eps)
        ff_output = self.ffn(norm_hidden_states)
        return (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)


class FusedAdaLNWanTransformer3DModel(WanTransformer3DModel):
    """``WanTransformer3DModel`` whose output norm-and-modulate runs in the fused AdaLN kernel.

    ``forward`` follows diffusers' numbered sections; only section 5's modulate differs. Image conditioning
    (Wan 2.1 ``encoder_hidden_states_image``) is not used by Wan 2.2 and is rejected.
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor | Transformer2DModelOutput:
        if encoder_hidden_states_image is not None or attention_kwargs:
            raise ValueError("fused-AdaLN Wan model: encoder_hidden_states_image and attention_kwargs are unsupported")
        batch, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        grid = (frames // p_t, height // p_h, width // p_w)

        # 1. Patch & position embedding
        rotary_emb = self.rope(hidden_states)
        hidden_states = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()

        # 2. Condition embeddings; timestep [B] or [B, S] (Wan 2.2 TI2V per-token)
        ts_seq_len = timestep.shape[1] if timestep.ndim == 2 else None
        temb, timestep_proj, encoder_hidden_states, _ = self.condition_embedder(
            timestep.flatten(), encoder_hidden_states, None, timestep_seq_len=ts_seq_len
        )
        timestep_proj = timestep_proj.unflatten(2 if ts_seq_len is not None else 1, (6, -1))

        # 3-4. Transformer blocks (activation checkpointing, when on, wraps the blocks themselves)
        for block in self.blocks:
            hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)

        # 5. Output norm, projection & unpatchify; shift/scale [B, 1, D] or [B, S, D]
        table = self.scale_shift_table.unsqueeze(0) if temb.ndim == 3 else self.scale_shift_table
        shift, scale = (table + temb.unsqueeze(temb.ndim - 1)).chunk(2, dim=temb.ndim - 1)
        if temb.ndim == 3:
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        hidden_states = _adaln(hidden_states, scale, shift, self.norm_out.eps)
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch, *grid, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        output = hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)


def use_fused_adaln(model: WanTransformer3DModel) -> WanTransformer3DModel:
    """Switch ``model`` (in place) to the fused AdaLN forward; call before activation checkpointing and FSDP.

    Returns:
        The same module, now an instance of ``FusedAdaLNWanTransformer3DModel``.

    Raises:
        TypeError: ``model`` is not a plain diffusers ``WanTransformer3DModel`` with plain blocks (e.g. already
            wrapped by FSDP or checkpointing, whose wrapper classes the swap would drop).
    """
    if type(model) not in (WanTransformer3DModel, FusedAdaLNWanTransformer3DModel):
        raise TypeError(f"use_fused_adaln needs an unwrapped WanTransformer3DModel, got {type(model).__name__}")
    for i, block in enumerate(model.blocks):
        if type(block) not in (WanTransformerBlock, FusedAdaLNWanTransformerBlock):
            raise TypeError(f"use_fused_adaln: blocks[{i}] is {type(block).__name__}; patch before wrapping blocks")
        block.__class__ = FusedAdaLNWanTransformerBlock
    model.__class__ = FusedAdaLNWanTransformer3DModel
    return model


def apply_adaln_impl(model: WanTransformer3DModel, impl: str) -> WanTransformer3DModel:
    """``kernels.adaln`` of the spec: "fused" patches the model, "reference" leaves diffusers' eager chain."""
    if impl not in ADALN_IMPLS:
        raise ValueError(f"kernels.adaln {impl!r} is not one of {', '.join(ADALN_IMPLS)}")
    return use_fused_adaln(model) if impl == "fused" else model
