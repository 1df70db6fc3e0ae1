"""The umT5 text encoder (transformers' ``UMT5EncoderModel``; ``T5EncoderModel`` too) in JAX, as pure functions over
the checkpoint's tensors (names as in the checkpoint), with the tokenizer read by the ``tokenizers`` library.

umT5 gives every layer its own relative position bias (T5 only the first, shared by all); attention is unscaled
(T5's), with the padding keys masked; the feed-forward is gated (gelu-tanh for umT5). Padding never changes a real
token's output, so captions are padded to the longest in the batch and only the real tokens are returned.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from wanloom_trainer.model.encoders import read_safetensors_folder

Params = dict[str, Any]


@dataclass(frozen=True)
class TextConfig:
    d_model: int
    num_heads: int
    d_kv: int
    num_layers: int
    num_buckets: int
    max_distance: int
    eps: float
    activation: str  # "gelu_new" (tanh), "gelu" or "relu"
    gated: bool

    @classmethod
    def from_json(cls, path: Path) -> TextConfig:
        raw = json.loads(path.read_text())
        proj = raw.get("feed_forward_proj", "gated-gelu")
        act = raw.get("dense_act_fn") or proj.split("-")[-1]
        return cls(
            d_model=int(raw["d_model"]),
            num_heads=int(raw["num_heads"]),
            d_kv=int(raw["d_kv"]),
            num_layers=int(raw["num_layers"]),
            num_buckets=int(raw.get("relative_attention_num_buckets", 32)),
            max_distance=int(raw.get("relative_attention_max_distance", 128)),
            eps=float(raw.get("layer_norm_epsilon", 1e-6)),
            activation="gelu_new" if act == "gelu" and proj.startswith("gated") else act,
            gated=proj.startswith("gated"),
        )


def load_text_encoder(folder: str | Path, dtype: Any = jnp.float32) -> tuple[TextConfig, Params]:
    """A transformers ``text_encoder/`` folder (config.json + safetensors) as (config, params by checkpoint name);
    linear weights transposed to [in, out]."""
    folder = Path(folder)
    flat = read_safetensors_folder(folder, "transformers")
    params = {}
    for name, value in flat.items():
        linear = name.endswith(".weight") and value.ndim == 2 and "relative_attention_bias" not in name
        linear = linear and not name.endswith(("shared.weight", "embed_tokens.weight"))
        params[name] = jnp.asarray(value.T if linear else value, dtype)
    if "shared.weight" not in params and "encoder.embed_tokens.weight" in params:
        params["shared.weight"] = params["encoder.embed_tokens.weight"]
    return TextConfig.from_json(folder / "config.json"), params


def _rms(weight: jax.Array, x: jax.Array, eps: float) -> jax.Array:
    variance = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return weight * (x * jax.lax.rsqrt(variance + eps)).astype(weight.dtype)


def _buckets(cfg: TextConfig, length: int) -> np.ndarray:
    """Bidirectional relative-position buckets [L, L] (memory - query), as T5's encoder computes them."""
    relative = np.arange(length)[None, :] - np.arange(length)[:, None]
    half = cfg.num_buckets // 2
    out = (relative > 0).astype(np.int64) * half
    distance = np.abs(relative)
    max_exact = half // 2
    safe = np.maximum(distance, 1).astype(np.float32)  # the log is only read where distance >= max_exact
    large = max_exact + (np.log(safe / max_exact) / math.log(cfg.max_distance / max_exact) * (half - max_exact)).astype(
        np.int64
    )
    return out + np.where(distance < max_exact, distance, np.minimum(large, half - 1))


def _activation(name: str, x: jax.Array) -> jax.Array:
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "relu":
        return jax.nn.relu(x)
    raise ValueError(f"text encoder activation {name!r} is not supported (gelu_new, gelu, relu)")


def encode(params: Params, cfg: TextConfig, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """Token ids and attention mask [B, L] -> last hidden states [B, L, d_model] (padding rows are garbage)."""
    b, length = ids.shape
    x = params["shared.weight"][ids]
    buckets = jnp.asarray(_buckets(cfg, length))
    neg = jnp.finfo(jnp.float32).min
    key_mask = jnp.where(mask[:, None, None, :] > 0, 0.0, neg).astype(jnp.float32)
    bias = None
    for i in range(cfg.num_layers):
        block = f"encoder.block.{i}.layer"
        attn = f"{block}.0.SelfAttention"
        if f"{attn}.relative_attention_bias.weight" in params:  # umT5: every layer; T5: the first, then shared
            bias = params[f"{attn}.relative_attention_bias.weight"][buckets].transpose(2, 0, 1)[None]
        h = _rms(params[f"{block}.0.layer_norm.weight"], x, cfg.eps)
        q, k, v = (
            (h @ params[f"{attn}.{n}.weight"]).reshape(b, length, cfg.num_heads, cfg.d_kv) for n in ("q", "k", "v")
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) + bias + key_mask
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, length, cfg.num_heads * cfg.d_kv)
        x = x + out @ params[f"{attn}.o.weight"]
        h = _rms(params[f"{block}.1.layer_norm.weight"], x, cfg.eps)
        ff = f"{block}.1.DenseReluDense"
        if cfg.gated:
            h = _activation(cfg.activation, h @ params[f"{ff}.wi_0.weight"]) * (h @ params[f"{ff}.wi_1.weight"])
        else:
            h = _activation(cfg.activation, h @ params[f"{ff}.wi.weight"])
        x = x + h @ params[f"{ff}.wo.weight"]
    return _rms(params["encoder.final_layer_norm.weight"], x, cfg.eps)


class Tokenizer:
    """The ``tokenizer/`` folder's tokenizer.json, used as transformers' fast tokenizer uses it (special tokens
    added, truncated to ``max_length``)."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the JAX text encoder reads the fast tokenizer's tokenizer.json")
        self._tokenizer = HFTokenizer.from_file(str(path))
        self._tokenizer.no_padding()

    def __call__(self, texts: list[str], max_length: int) -> tuple[np.ndarray, np.ndarray]:
        """ids and mask [B, L] with L the longest (truncated) caption; at least one token each."""
        self._tokenizer.enable_truncation(max_length)
        encoded = [e.ids for e in self._tokenizer.encode_batch(texts)]
        length = max(1, *(len(e) for e in encoded))
        ids = np.zeros((len(texts), length), np.int32)
        mask = np.zeros((len(texts), length), np.int32)
        for row, e in enumerate(encoded):
            ids[row, : len(e)], mask[row, : len(e)] = e, 1
        return ids, mask
