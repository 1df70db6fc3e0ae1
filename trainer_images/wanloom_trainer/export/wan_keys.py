"""Parameter names of the original Wan release (what ComfyUI, DiffSynth-Studio and the Wan repository load) from
the diffusers ``WanTransformer3DModel`` names the trainers use.

The rename is the inverse of diffusers' ``convert_wan_transformer_to_diffusers`` for the text/image-to-video
transformer (no CLIP image branch, no VACE): every tensor keeps its shape and layout, only its name changes.
Two quirks of the correspondence: diffusers' ``norm2`` (the affine norm before cross-attention) is the original
``norm3``, and the output head's ``scale_shift_table`` is ``head.modulation`` while each block's is
``modulation``. The tests check the inverse against diffusers' own converter on every key of a model.
"""

from __future__ import annotations

import re

# Applied in order to the whole key; later rules see earlier rules' output.
_PREFIXES = (
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    ("proj_out.", "head.head."),
)
_BLOCK_PARTS = (
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".ffn.net.0.proj.", ".ffn.0."),
    (".ffn.net.2.", ".ffn.2."),
)
_BLOCK_NORM = re.compile(r"^(blocks\.\d+\.)norm([23])\.")


def wan_key(diffusers_key: str) -> str:
    """The original Wan name of one diffusers ``WanTransformer3DModel`` parameter."""
    if diffusers_key == "scale_shift_table":
        return "head.modulation"
    for old, new in _PREFIXES:
        if diffusers_key.startswith(old):
            return new + diffusers_key[len(old) :]
    if not diffusers_key.startswith("blocks."):
        return diffusers_key  # patch_embedding.*
    key = diffusers_key
    if key.endswith(".scale_shift_table"):
        return key.removesuffix("scale_shift_table") + "modulation"
    key = _BLOCK_NORM.sub(lambda m: f"{m.group(1)}norm{5 - int(m.group(2))}.", key)  # 2 ↔ 3
    for old, new in _BLOCK_PARTS:
        key = key.replace(old, new)
    return key
