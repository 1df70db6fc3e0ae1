"""FLOPs per training sample of a Wan transformer, accelerator peaks, and MFU.

The FLOP formula (one expert; an A14B sample runs exactly one of its two experts), with S video tokens
(``variant.tokens(T', H', W')``), D = dim, F = ffn_dim, L = text_len (512, zero-padded, no mask, so always counted),
C_in/C_out the in/out channels and P = pt·ph·pw the patch volume. A multiply-add counts as 2 FLOPs.

Per transformer block (forward), summed over ``num_layers`` identical blocks:

    self-attention projections  Q, K, V, O            4 · 2·S·D²
    self-attention scores + values  QKᵀ and PV        2 · 2·S²·D       (= 4·S²·D, full bidirectional attention)
    cross-attention Q and O over the video tokens     2 · 2·S·D²
    cross-attention K and V over the text tokens      2 · 2·L·D²
    cross-attention scores + values                   2 · 2·S·L·D
    FFN, two matrices (GELU-tanh, not SwiGLU)         2 · 2·S·D·F

Outside the blocks (forward):

    patch embedding (Conv3d with stride = kernel)     2·S·(C_in·P)·D
    output projection                                 2·S·D·(C_out·P)
    text embedding  4096 → D → D                      2·L·(text_dim·D + D²)
    time embedding  freq → D → D, then D → 6D         2·(freq·D + D² + 6·D²), once per sample, or once per token
                                                      (× S) for per-token timesteps (TI2V-5B ``expand_timesteps``)

Training FLOPs = 3 × forward (backward = 2 × forward). With LoRA (frozen base weights) the backward skips the
weight gradients: the projections, FFN and embeddings count 2 × forward (forward + input gradients), QKᵀ/PV still 3 ×,
the cross-attention K/V projections of the (never differentiated) text 1 ×; the adapters' rank-r matmuls are left
out (r ≪ D). Recomputation from activation checkpointing is *not*
counted: MFU measures useful model FLOPs, so remat lowers MFU rather than inflating it. Norms, RoPE, softmax and
elementwise modulation are ignored (< 1%). Reference check: A14B at 720×1280×81 has 75,600 tokens and ≈19.6 PFLOP
per training sample, ≈72% of it in QKᵀ/PV (``test_a14b_720p_reference`` in tests/trainer/test_flops.py).

The VAE stride comes from the variant (8× spatial for A14B, 16× for TI2V-5B), never a hard-coded /8.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from wanloom_api.topology import ACCELERATOR_TYPES
from wanloom_trainer.config.variants import WanVariant

TRAIN_FACTOR = 3  # forward + backward (2 × forward)


@dataclass(frozen=True)
class FlopBreakdown:
    """Forward FLOPs of one sample by term (whole model, all layers); ``train`` is 3 × ``forward``."""

    self_attn_proj: float
    self_attn_scores: float
    cross_attn_proj: float
    cross_attn_text_kv: float
    cross_attn_scores: float
    ffn: float
    embeddings: float

    @property
    def forward(self) -> float:
        return (
            self.self_attn_proj
            + self.self_attn_scores
            + self.cross_attn_proj
            + self.cross_attn_text_kv
            + self.cross_attn_scores
            + self.ffn
            + self.embeddings
        )

    @property
    def train(self) -> float:
        return TRAIN_FACTOR * self.forward

    @property
    def train_lora(self) -> float:
        """Training FLOPs with the base frozen (module docstring)."""
        scores = self.self_attn_scores + self.cross_attn_scores
        linear = self.self_attn_proj + self.cross_attn_proj + self.ffn + self.embeddings
        return TRAIN_FACTOR * scores + 2 * linear + self.cross_attn_text_kv

    @property
    def attention_fraction(self) -> float:
        """Share of the FLOPs spent in QKᵀ/PV (self and cross), the part that grows with S²."""
        return (self.self_attn_scores + self.cross_attn_scores) / self.forward


def flop_breakdown(variant: WanVariant, tokens: int) -> FlopBreakdown:
    """Forward FLOPs of one sample with ``tokens`` video tokens, split by term (formula in the module docstring)."""
    if tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    s, d, f, n = float(tokens), float(variant.dim), float(variant.ffn_dim), variant.num_layers
    txt = float(variant.text_len)
    patch = variant.patch_size[0] * variant.patch_size[1] * variant.patch_size[2]
    time_mlp = 2.0 * (variant.freq_dim * d + d * d + 6.0 * d * d)
    embeddings = (
        2.0 * s * variant.in_channels * patch * d
        + 2.0 * s * d * variant.out_channels * patch
        + 2.0 * txt * (variant.text_dim * d + d * d)
        + time_mlp * (s if variant.per_token_timesteps else 1.0)
    )
    return FlopBreakdown(
        self_attn_proj=n * 4 * 2 * s * d * d,
        self_attn_scores=n * 2 * 2 * s * s * d,
        cross_attn_proj=n * 2 * 2 * s * d * d,
        cross_attn_text_kv=n * 2 * 2 * txt * d * d,
        cross_attn_scores=n * 2 * 2 * s * txt * d,
        ffn=n * 2 * 2 * s * d * f,
        embeddings=embeddings,
    )


def train_flop_coefficients(variant: WanVariant) -> tuple[float, float, float]:
    """(c0, c1, c2) with training FLOPs per sample = c0 + c1·S + c2·S², the same formula as ``flop_breakdown``.

    Vectorised cost models use this: c2 is the QKᵀ/PV term, c1 everything linear in S, c0 the text and (per-sample)
    time embeddings.
    """
    d, f, n, txt = float(variant.dim), float(variant.ffn_dim), variant.num_layers, float(variant.text_len)
    patch = variant.patch_size[0] * variant.patch_size[1] * variant.patch_size[2]
    time_mlp = 2.0 * (variant.freq_dim * d + d * d + 6.0 * d * d)
    c0 = n * 4 * txt * d * d + 2.0 * txt * (variant.text_dim * d + d * d)
    c1 = (
        n * (8 * d * d + 4 * d * d + 4 * txt * d + 4 * d * f)
        + 2.0 * (variant.in_channels + variant.out_channels) * patch * d
    )
    if variant.per_token_timesteps:
        c1 += time_mlp
    else:
        c0 += time_mlp
    c2 = n * 4 * d
    return TRAIN_FACTOR * c0, TRAIN_FACTOR * c1, TRAIN_FACTOR * c2


def train_flops_per_sample(variant: WanVariant, tokens: int, *, lora: bool = False) -> float:
    """Training FLOPs (forward × 3; with ``lora``, the frozen-base count) of one sample with ``tokens`` video
    tokens."""
    breakdown = flop_breakdown(variant, tokens)
    return breakdown.train_lora if lora else breakdown.train


def train_flops_for_latent(variant: WanVariant, latent_shape: tuple[int, int, int]) -> float:
    """Training FLOPs of one sample whose latent is (T', H', W')."""
    return train_flops_per_sample(variant, variant.tokens(*latent_shape))


def train_flops_per_step(variant: WanVariant, tokens_per_sample: Iterable[int]) -> float:
    """Training FLOPs of a global step: the sum over its (real, non-padding) samples."""
    return sum(train_flops_per_sample(variant, int(s)) for s in tokens_per_sample)


@dataclass(frozen=True)
class Accelerator:
    """Dense bf16 peak of one device as the trainer counts devices (a JAX device or a CUDA device)."""

    name: str
    peak_bf16_flops: float
    note: str


# Per-chip peaks come from the accelerator table (wanloom_api.topology.ACCELERATOR_TYPES). A TPU v7x chip has two
# TensorCores and JAX shows each as its own device, so its per-device peak is half the chip's. Keep the unit of
# n_devices in mfu() consistent with the entry chosen here.
_TPU7X = ACCELERATOR_TYPES["tpu7x"]
ACCELERATORS: dict[str, Accelerator] = {
    **{name: Accelerator(name, a.peak_bf16_flops, a.peak_note) for name, a in ACCELERATOR_TYPES.items()},
    "tpu7x-tensorcore": Accelerator(
        "tpu7x-tensorcore", _TPU7X.peak_bf16_flops / _TPU7X.devices_per_chip, "TPU v7x, per TensorCore (one JAX device)"
    ),
    # Local runs only, so the MFU panel has something honest to show on a laptop: one AVX2 core's fp32 FMA peak
    # (2 FMA pipes x 8 lanes x 2 FLOPs x 3 GHz); the tiny model is fp32 on CPU.
    "cpu": Accelerator("cpu", 96e9, "one x86-64 core, nominal AVX2 fp32 FMA peak (local runs)"),
}

# GKE node-label spellings of the same devices (A3 Mega's H100 has its own label).
_ALIASES = {a.gke_label: name for name, a in ACCELERATOR_TYPES.items()} | {"nvidia-h100-mega-80gb": "h100"}


def get_accelerator(name: str) -> Accelerator:
    """Look up a peak by name (case-insensitive; GKE accelerator labels accepted)."""
    key = name.lower()
    key = _ALIASES.get(key, key)
    if key not in ACCELERATORS:
        valid = ", ".join([*ACCELERATORS, *_ALIASES])
        raise ValueError(f"unknown accelerator {name!r}; valid: {valid}")
    return ACCELERATORS[key]


def mfu(flops_per_step: float, step_seconds: float, n_devices: int, accelerator: str) -> float:
    """Model FLOPs utilisation = flops_per_step / (step_seconds · n_devices · peak).

    Args:
        flops_per_step: useful model FLOPs of one global step (``train_flops_per_step``; no remat, no padding).
        step_seconds: wall time of that step.
        n_devices: devices the step ran on, in the unit of ``accelerator`` (chips for "tpu7x", JAX devices for
            "tpu7x-tensorcore", GPUs otherwise).
        accelerator: a key of ``ACCELERATORS`` (peak = dense bf16, stated in the table).

    Returns:
        A fraction in [0, 1] for physical runs (not clipped, so a wrong FLOP count shows up as > 1).
    """
    if step_seconds <= 0 or n_devices <= 0:
        raise ValueError(f"step_seconds and n_devices must be positive, got {step_seconds}, {n_devices}")
    peak = get_accelerator(accelerator).peak_bf16_flops
    return flops_per_step / (step_seconds * n_devices * peak)
