"""Synthetic latent datasets with a configurable shape mixture, written in the real shard format.

Used by the local run (``spec.data.synthetic``), the tests and the benchmarks. The data must be learnable, or a
tiny model could never show a falling loss: white-noise latents leave the flow-matching target unpredictable
(the best possible loss stays near its starting value). Instead every sample is one of ``PROTOTYPES`` smooth,
low-rank patterns chosen by its "caption":

    x0[c, t, h, w] = Σ_r A[k, c, r] · cos(π·(f_t·t̂ + f_h·ĥ + f_w·ŵ)_r + φ[k, r])  +  0.02·noise

with k the sample's prototype, R = 2 components of integer frequencies in {0, 1, 2} over coordinates normalised
to [0, 1] (so the same prototype renders at any resolution or length), A scaled for unit variance, and text
embeddings fixed per prototype (plus a little noise). The text identifies the pattern, so a model conditioned on
it can drive the loss far below its initial value. I2V variants get the Wan condition: 4 mask channels (1 on
the first latent frame) and the first latent frame's values followed by zeros. Sample i depends only on
(seed, i), so any sample can be regenerated alone. Details: docs/data-format.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from wanloom_trainer.config.variants import WanVariant
from wanloom_trainer.data.format import EncodedSample
from wanloom_trainer.data.index import INDEX_NAME, DatasetHeader, ShapeIndex
from wanloom_trainer.data.prepare.writer import DatasetWriter
from wanloom_trainer.data.storage import open_storage, split_uri

# Four patterns of rank two with 2% noise: measured with the tiny model (200 AdamW steps at lr 3e-3, batch 8),
# the loss falls to 0.36 of its start; eight rank-four patterns with 10% noise only reached 0.48.
PROTOTYPES = 4
RANK = 2
NOISE = 0.02
TEXT_NOISE = 0.05
SHARD_BYTES = 512 << 20  # target shard size when samples_per_shard is not given


@dataclass(frozen=True)
class ShapeMix:
    """One mixture component, in pixels (frames = 1 for images), drawn with probability ∝ weight."""

    frames: int
    height: int
    width: int
    weight: float = 1.0

    def __str__(self) -> str:
        return f"{self.frames}x{self.height}x{self.width}:{self.weight:g}"


# Images and 5 s clips at Wan's training resolutions, with a minority of short clips (docs/data-format.md has the
# reasoning, from the public corpus statistics in docs/adaptiveload.md).
_WAN_480_720 = (
    ShapeMix(1, 480, 832, 2),
    ShapeMix(1, 832, 480, 1),
    ShapeMix(1, 720, 1280, 1),
    ShapeMix(81, 480, 832, 3),
    ShapeMix(81, 720, 1280, 2),
    ShapeMix(81, 832, 480, 1),
    ShapeMix(33, 480, 832, 1),
)
_TINY = (
    ShapeMix(1, 64, 64, 3),
    ShapeMix(1, 64, 96, 2),
    ShapeMix(1, 96, 64, 1),
    ShapeMix(9, 64, 64, 2),
    ShapeMix(17, 32, 48, 1),
)
DEFAULT_MIXTURES: dict[str, tuple[ShapeMix, ...]] = {
    "wan2.2-t2v-a14b": _WAN_480_720,
    "wan2.2-i2v-a14b": _WAN_480_720,
    "wan2.2-ti2v-5b": (
        ShapeMix(1, 704, 1280, 2),
        ShapeMix(1, 1280, 704, 1),
        ShapeMix(121, 704, 1280, 3),
        ShapeMix(121, 480, 832, 2),
        ShapeMix(49, 704, 1280, 1),
    ),
    # Small enough for a CPU: images at three aspects plus two clip lengths.
    "tiny": _TINY,
    "tiny-i2v": _TINY,
    "tiny-ti2v": _TINY,
    "mini-t2v": _TINY,
    "mini-i2v": _TINY,
    # Stride 16 x patch 2: sides in multiples of 32 pixels.
    "mini-ti2v": (*_TINY[:-1], ShapeMix(17, 32, 64, 1)),
}


def parse_mixture(text: str) -> tuple[ShapeMix, ...]:
    """'1x64x64:3,9x64x64:1' → ShapeMix entries (weight defaults to 1)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        shape, _, weight = part.partition(":")
        try:
            f, h, w = (int(v) for v in shape.lower().split("x"))
            out.append(ShapeMix(f, h, w, float(weight) if weight else 1.0))
        except ValueError:
            raise ValueError(f"mixture entry {part!r} is not FRAMESxHEIGHTxWIDTH[:WEIGHT], e.g. 81x480x832:2") from None
    if not out:
        raise ValueError(f"mixture {text!r} has no entries; expected e.g. '1x64x64:3,9x64x64:1'")
    return tuple(out)


def validate_mixture(mixture: tuple[ShapeMix, ...], variant: WanVariant) -> None:
    """Every entry must map onto whole latents and patches of ``variant``; errors name the entry."""
    st, sh, sw = variant.vae_stride
    _, ph, pw = variant.patch_size
    for m in mixture:
        if m.weight <= 0:
            raise ValueError(f"mixture entry {m}: weight must be > 0")
        if m.frames < 1 or (m.frames - 1) % st:
            raise ValueError(f"mixture entry {m}: frames must be 1 or 1 + a multiple of {st} (the VAE's time stride)")
        if m.height % (sh * ph) or m.width % (sw * pw) or m.height < sh * ph or m.width < sw * pw:
            raise ValueError(
                f"mixture entry {m}: height and width must be positive multiples of {sh * ph} and {sw * pw} "
                f"(VAE stride × patch of {variant.name})"
            )


@dataclass(frozen=True)
class PatternBank:
    """The prototypes of one (variant, seed): amplitudes [K, C, R], frequencies [K, R, 3], phases [K, R], texts."""

    amplitudes: np.ndarray
    freqs: np.ndarray
    phases: np.ndarray
    texts: tuple[np.ndarray, ...]  # K × [L_k, D_text]

    @classmethod
    def create(cls, variant: WanVariant, seed: int) -> PatternBank:
        rng = np.random.default_rng([seed, 0x5EED])
        c, d, text_len = variant.out_channels, variant.text_dim, variant.text_len
        amplitudes = rng.normal(0.0, math.sqrt(2.0 / RANK), (PROTOTYPES, c, RANK))
        freqs = rng.integers(0, 3, (PROTOTYPES, RANK, 3))
        phases = rng.uniform(0.0, 2 * math.pi, (PROTOTYPES, RANK))
        lengths = rng.integers(max(1, text_len // 4), text_len + 1, PROTOTYPES)
        texts = tuple(rng.normal(0.0, 0.5, (int(n), d)).astype(np.float32) for n in lengths)
        return cls(amplitudes, freqs, phases, texts)

    def render(self, k: int, shape: tuple[int, int, int]) -> np.ndarray:
        """Prototype ``k`` at latent shape (T', H', W') → float32 [C, T', H', W']."""
        axes = [np.arange(n) / max(n - 1, 1) if i == 0 else (np.arange(n) + 0.5) / n for i, n in enumerate(shape)]
        t, h, w = np.meshgrid(*axes, indexing="ij")
        f = self.freqs[k]
        arg = np.pi * (f[:, 0, None, None, None] * t + f[:, 1, None, None, None] * h + f[:, 2, None, None, None] * w)
        basis = np.cos(arg + self.phases[k][:, None, None, None])  # [R, T', H', W']
        return np.einsum("cr,rthw->cthw", self.amplitudes[k], basis).astype(np.float32)


def synth_sample(
    i: int, seed: int, variant: WanVariant, mixture: tuple[ShapeMix, ...], bank: PatternBank
) -> EncodedSample:
    """Sample ``i`` of the synthetic dataset ``seed`` (depends on nothing else)."""
    rng = np.random.default_rng([seed, i])
    m = _draw_entry(rng, mixture)
    shape = variant.latent_shape(m.frames, m.height, m.width)
    k = int(rng.integers(PROTOTYPES))
    latents = bank.render(k, shape) + NOISE * rng.standard_normal((variant.out_channels, *shape), dtype=np.float32)
    text = bank.texts[k] + TEXT_NOISE * rng.standard_normal(bank.texts[k].shape, dtype=np.float32)
    return EncodedSample(
        key=f"synth{i:09d}",
        latents=latents,
        text=text,
        condition=i2v_condition(latents, variant.condition_channels),
        source=f"synthetic:{seed}:{i}:prototype{k}",
        frames=m.frames,
        height=m.height,
        width=m.width,
        fps=16.0 if m.frames > 1 else 0.0,
        caption=f"prototype {k}",
    )


def _draw_entry(rng: np.random.Generator, mixture: tuple[ShapeMix, ...]) -> ShapeMix:
    weights = np.array([m.weight for m in mixture], dtype=np.float64)
    return mixture[int(rng.choice(len(mixture), p=weights / weights.sum()))]


def synthetic_pixel_shapes(
    variant: WanVariant, samples: int, seed: int, mixture: tuple[ShapeMix, ...] | None = None
) -> np.ndarray:
    """(frames, height, width) int64 [samples, 3] of the synthetic dataset ``write_synthetic`` would write: the same
    draws, without rendering anything (``wanloom plan`` before the data exists)."""
    mixture = mixture or DEFAULT_MIXTURES[variant.name]
    entries = [_draw_entry(np.random.default_rng([seed, i]), mixture) for i in range(samples)]
    return np.array([(m.frames, m.height, m.width) for m in entries], dtype=np.int64).reshape(-1, 3)


def i2v_condition(latents: np.ndarray, condition_channels: int) -> np.ndarray | None:
    """Wan I2V condition [mask (Cc − C channels) + C latent channels, T', H', W']: only the first frame is known."""
    if condition_channels == 0:
        return None
    c, t, h, w = latents.shape
    masks = condition_channels - c
    if masks < 0:
        raise ValueError(f"condition_channels {condition_channels} is smaller than the {c} latent channels")
    cond = np.zeros((condition_channels, t, h, w), dtype=np.float32)
    cond[:masks, 0] = 1.0
    cond[masks:, 0] = latents[:, 0]
    return cond


def synthetic_header(
    variant: WanVariant, samples: int, seed: int, mixture: tuple[ShapeMix, ...], dtype: str
) -> DatasetHeader:
    build = {"samples": samples, "seed": seed, "mixture": [str(m) for m in mixture]}
    return DatasetHeader.for_variant(variant, dtype=dtype, source="synthetic", build=build)


def default_samples_per_shard(variant: WanVariant, mixture: tuple[ShapeMix, ...], dtype: str) -> int:
    largest = max(math.prod(variant.latent_shape(m.frames, m.height, m.width)) for m in mixture)
    per_sample = (variant.out_channels + variant.condition_channels) * largest + variant.text_len * variant.text_dim
    return int(np.clip(SHARD_BYTES // (per_sample * (2 if dtype != "float32" else 4)), 1, 1024))


def write_synthetic(
    uri: str,
    variant: WanVariant,
    samples: int,
    seed: int = 0,
    mixture: tuple[ShapeMix, ...] | None = None,
    *,
    samples_per_shard: int | None = None,
    dtype: str = "float32",
    progress: bool = False,
) -> ShapeIndex:
    """Write (or finish writing) a synthetic dataset at ``uri``; returns its index."""
    if samples < 1:
        raise ValueError(f"synthetic samples must be >= 1, got {samples}")
    mixture = mixture or DEFAULT_MIXTURES[variant.name]
    validate_mixture(mixture, variant)
    per_shard = samples_per_shard or default_samples_per_shard(variant, mixture, dtype)
    if per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {per_shard}")
    header = synthetic_header(variant, samples, seed, mixture, dtype)
    writer = DatasetWriter(open_storage(uri), header, num_shards=-(-samples // per_shard))
    todo = writer.start()
    bank = PatternBank.create(variant, seed)
    shards = {k: range(k * per_shard, min(samples, (k + 1) * per_shard)) for k in todo}
    bar = _progress(sum(len(ids) for ids in shards.values()), progress)
    for k, ids in shards.items():
        writer.write_shard(k, (synth_sample(i, seed, variant, mixture, bank) for i in ids))
        bar.update(len(ids))
    bar.close()
    # A synthetic "empty prompt": one token of its own pattern, so dropped captions differ from every prototype's.
    empty = np.random.default_rng([seed, 0xE0]).normal(0.0, 0.5, (1, variant.text_dim)).astype(np.float32)
    writer.write_empty_prompt(empty)
    return writer.finalize()


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="sample", desc="synth", disable=not enabled)


def ensure_synthetic(data: Any, variant: WanVariant, *, progress: bool = False) -> str:
    """For the trainer: make sure ``spec.data`` names a usable dataset, generating a synthetic one if asked.

    Args:
        data: ``spec.data`` (uri, index, synthetic{samples, seed}).
        variant: the model the run trains; an existing dataset must match its shapes.

    Returns:
        The index location to pass to ``open_dataset(data.uri, index=...)``.
    """
    index_uri = data.index or f"{str(data.uri).rstrip('/')}/{INDEX_NAME}"
    root, name = split_uri(index_uri)
    if open_storage(root).exists(name):
        from wanloom_trainer.data.reader import read_index

        header = read_index(data.uri, data.index).header
        check_header(header, variant, index_uri)
        _check_synthetic_settings(header, data.synthetic, index_uri)
        return index_uri
    if data.synthetic is None:
        raise FileNotFoundError(
            f"spec.data: no dataset at {index_uri}; prepare one (wanloom data prepare / synth) or set "
            "spec.data.synthetic to generate a synthetic one"
        )
    if data.index is not None and index_uri != f"{str(data.uri).rstrip('/')}/{INDEX_NAME}":
        raise ValueError(
            "spec.data.index must be unset when spec.data.synthetic generates the dataset at spec.data.uri"
        )
    write_synthetic(data.uri, variant, data.synthetic.samples, data.synthetic.seed, progress=progress)
    return index_uri


def check_header(header: DatasetHeader, variant: WanVariant, where: str) -> None:
    """The dataset's tensors must have the shapes ``variant`` consumes; errors name the mismatch."""
    want = {
        "latent_channels": variant.out_channels,
        "condition_channels": variant.condition_channels,
        "text_dim": variant.text_dim,
        "text_len": variant.text_len,
    }
    bad = [f"{k} {getattr(header, k)} (model needs {v})" for k, v in want.items() if getattr(header, k) != v]
    if bad:
        raise ValueError(f"dataset {where} was built for {header.variant}, not {variant.name}: {'; '.join(bad)}")


def _check_synthetic_settings(header: DatasetHeader, synthetic: Any, where: str) -> None:
    if synthetic is None or header.source != "synthetic":
        return
    asked = {"samples": synthetic.samples, "seed": synthetic.seed}
    have = {k: header.build.get(k) for k in asked}
    if have != asked:
        raise ValueError(
            f"{where} holds a synthetic dataset with {have}, but spec.data.synthetic asks for {asked}; "
            "delete it or point spec.data.uri elsewhere"
        )
