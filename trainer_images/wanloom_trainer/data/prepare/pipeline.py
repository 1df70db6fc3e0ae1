"""``wanloom data prepare``: captioned videos and images → latent shards + shape index.

Inputs (``sources``): a manifest (JSONL, CSV or Parquet, on gs:// or a path), or a folder / gs:// prefix of media
with sidecar captions. The ordered inputs are cut into **work units** of ``samples_per_shard``, one shard each;
a unit decodes its sources (ranged reads from GCS), resizes/crops them into their bucket (bucketing.py), encodes
them in batches of one bucket with the Wan VAE and the umT5 text encoder (encoders.py) and is written as a unit
(writer.py). A unit's bytes depend only on its inputs and the settings, so any worker may do (or redo) any unit,
at the same time as another: ``prepare(..., units=[k], finalize=False)`` is one worker of an Indexed Job, and
``finalize`` joins the shards into the index once every unit is written. Re-running skips finished units. Sources
that cannot be decoded or fit no bucket are skipped and listed (``skipped.json``), never fatal.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wanloom_trainer.config.variants import WanVariant, get_variant
from wanloom_trainer.data.bucketing import Bucket, choose_bucket, resize_crop, validate_buckets
from wanloom_trainer.data.format import STORAGE_DTYPES, EncodedSample
from wanloom_trainer.data.index import DatasetHeader, ShapeIndex
from wanloom_trainer.data.prepare.media import MediaError, load_media
from wanloom_trainer.data.prepare.sources import SourceItem, open_media, read_sources
from wanloom_trainer.data.prepare.writer import DatasetWriter
from wanloom_trainer.data.storage import open_storage

log = logging.getLogger(__name__)
ENCODER_BACKENDS = ("auto", "jax", "torch")


@dataclass(frozen=True)
class PrepareConfig:
    """Settings of one ``prepare`` run; every field except ``device``/``encoder_dtype`` is part of the build record.

    Attributes:
        inputs: a manifest (.jsonl/.csv/.parquet), or a folder or gs:// prefix of media with sidecar ``.txt``
            captions (``sources``).
        output: dataset root (path or gs://).
        model: diffusers-layout root with vae/, text_encoder/, tokenizer/.
        variant: the Wan variant the latents are for (channels, strides, text length, I2V condition).
        buckets: pixel buckets (frames, height, width).
        fps: training frame rate clips are resampled to.
        batch_size: sources per VAE/text-encoder call.
        samples_per_shard: sources per shard (the resume unit).
        dtype: storage dtype of the tensors.
        prompts: optional text file, one validation prompt per line, encoded into ``prompts.npz``.
        negative_prompt: optional text validation videos are guided away from, encoded into
            ``negative_prompt.npy`` (``spec.validation.negativePrompt``).
        max_skipped: inputs that may be skipped before finalize refuses to write the index (None: any).
        model_root: a local copy of ``model`` to load the encoders from (``model`` may be a gs:// URI; it is what
            the build records, so every worker records the same).
        encoders: "torch" (diffusers/transformers), "jax" (model/vae_jax.py, umt5_jax.py) or "auto" (torch where
            it is installed, else jax); both give the same latents within float error.
    """

    inputs: str | Path
    output: str
    model: Path | str
    variant: str
    buckets: tuple[Bucket, ...]
    fps: float = 16.0
    batch_size: int = 4
    samples_per_shard: int = 256
    dtype: str = "bfloat16"
    max_skipped: int | None = None
    prompts: Path | None = field(default=None, compare=False)
    negative_prompt: str | None = field(default=None, compare=False)
    device: str = field(default="cpu", compare=False)
    encoder_dtype: str = field(default="float32", compare=False)
    model_root: Path | None = field(default=None, compare=False)
    encoders: str = field(default="auto", compare=False)

    def __post_init__(self) -> None:
        if self.fps <= 0 or self.batch_size < 1 or self.samples_per_shard < 1:
            raise ValueError("fps must be > 0, batch_size and samples_per_shard >= 1")
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")
        if self.encoders not in ENCODER_BACKENDS:
            raise ValueError(f"encoders {self.encoders!r} is not one of {', '.join(ENCODER_BACKENDS)}")


@dataclass(frozen=True)
class PrepareResult:
    index: ShapeIndex | None  # None: the units asked for are written, the dataset is not finalized yet
    skipped: list[dict[str, str]]


def _digest(items: list[SourceItem]) -> str:
    h = hashlib.sha256()
    for it in items:
        bounds = "" if it.start is None and it.end is None else f"{it.uri}\0{it.start}\0{it.end}\0"
        h.update(f"{it.source}\0{it.caption}\0{bounds}".encode())
    return h.hexdigest()[:16]


def _header(config: PrepareConfig, variant: WanVariant, items: list[SourceItem]) -> DatasetHeader:
    return DatasetHeader.for_variant(
        variant,
        dtype=config.dtype,
        source="prepare",
        build={
            "inputs": len(items),
            "inputs_digest": _digest(items),
            "buckets": [str(b) for b in config.buckets],
            "fps": config.fps,
            "samples_per_shard": config.samples_per_shard,
            "model": str(config.model),
        },
    )


def prepare(
    config: PrepareConfig,
    *,
    progress: bool = True,
    encoders: Any = None,
    units: Sequence[int] | None = None,
    finalize: bool = True,
) -> PrepareResult:
    """Run (or resume) a prepare: every unfinished work unit, or only ``units``; then, with ``finalize``, the index.
    ``encoders`` overrides loading ``WanEncoders`` from ``config.model``."""
    variant = get_variant(config.variant)
    validate_buckets(config.buckets, variant)
    items = read_sources(config.inputs)
    per = config.samples_per_shard
    num_units = -(-len(items) // per)
    bad = sorted(k for k in units or () if not 0 <= k < num_units)
    if bad:
        raise ValueError(f"work unit(s) {bad} do not exist: the inputs make units 0..{num_units - 1}")
    writer = DatasetWriter(open_storage(config.output), _header(config, variant, items), num_units)
    todo = [k for k in writer.start() if units is None or k in units]
    if todo:
        encoders = encoders or _load_encoders(config, variant)
        _write_empty_prompt(writer, encoders, variant)  # here, so a finalize step needs no encoders
        total = sum(len(items[k * per : (k + 1) * per]) for k in (range(num_units) if units is None else units))
        bar = _progress(total, total - sum(len(items[k * per : (k + 1) * per]) for k in todo), progress)
        for k in todo:
            shard_items = items[k * per : (k + 1) * per]
            skipped: list[dict[str, str]] = []
            samples = _encode_shard(shard_items, config, variant, encoders, skipped, bar)
            writer.write_shard(k, samples, skipped)
        bar.close()
    if not finalize:
        return PrepareResult(None, writer.skipped())
    return _finalize(config, writer, encoders, variant)


def _finalize(config: PrepareConfig, writer: DatasetWriter, encoders: Any, variant: WanVariant) -> PrepareResult:
    """The dataset-wide files (empty, validation and negative prompts), then the index over every unit."""
    writer.require_complete()
    if not writer.has_empty_prompt():
        encoders = encoders or _load_encoders(config, variant)
        _write_empty_prompt(writer, encoders, variant)
    if config.prompts is not None:
        prompts = read_prompts(config.prompts)
        encoders = encoders or _load_encoders(config, variant)
        writer.write_prompts(prompts, encoders.encode_text(prompts, variant.text_len))
    if config.negative_prompt:
        encoders = encoders or _load_encoders(config, variant)
        writer.write_negative_prompt(encoders.encode_text([config.negative_prompt], variant.text_len)[0])
    return PrepareResult(writer.finalize(config.max_skipped), writer.skipped())


def _write_empty_prompt(writer: DatasetWriter, encoders: Any, variant: WanVariant) -> None:
    """Encoded as the Wan pipelines encode "" (caption dropout trains on it); the same bytes from any worker."""
    if not writer.has_empty_prompt():
        writer.write_empty_prompt(encoders.encode_text([""], variant.text_len)[0])


def read_prompts(path: Path) -> list[str]:
    """The non-empty lines of a prompts file."""
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: no such file")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompt in it (one per line)")
    return prompts


def _load_encoders(config: PrepareConfig, variant: WanVariant) -> Any:
    root = Path(config.model_root or config.model)
    if encoder_backend(config.encoders) == "jax":
        from wanloom_trainer.data.prepare.encoders_jax import JaxEncoders

        enc: Any = JaxEncoders(root, config.encoder_dtype)
    else:
        from wanloom_trainer.data.prepare.encoders import WanEncoders

        enc = WanEncoders(root, config.device, config.encoder_dtype)
    check_encoders(enc, variant)
    return enc


def encoder_backend(choice: str) -> str:
    """ "auto" is torch where PyTorch and diffusers are installed (GPU images), else jax (the TPU image)."""
    if choice != "auto":
        return choice
    return "torch" if all(_installed(m) for m in ("torch", "diffusers", "transformers")) else "jax"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # present in sys.modules as None: deliberately unimportable
        return False


def check_encoders(enc: Any, variant: WanVariant) -> None:
    """The encoders must produce what ``variant`` consumes; errors name the mismatch."""
    if enc.latent_channels != variant.out_channels:
        raise ValueError(
            f"the VAE makes {enc.latent_channels} latent channels; {variant.name} needs {variant.out_channels}"
        )
    if tuple(enc.vae_stride) != tuple(variant.vae_stride):
        raise ValueError(f"the VAE's stride {enc.vae_stride} differs from {variant.name}'s {variant.vae_stride}")
    if variant.condition_channels and variant.condition_channels != 4 + enc.latent_channels:
        raise ValueError(
            f"{variant.name} expects {variant.condition_channels} condition channels, not 4 mask + C latent"
        )
    if enc.text_dim != variant.text_dim:
        raise ValueError(f"the text encoder's width is {enc.text_dim}; {variant.name} needs {variant.text_dim}")


def _progress(total: int, done: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=done, unit="source", desc="prepare", disable=not enabled)


def _encode_shard(
    items: list[SourceItem], config: PrepareConfig, variant: WanVariant, enc: Any, skipped: list, bar: Any
) -> Iterator[EncodedSample]:
    """Decode, bucket and encode a shard's sources, yielding samples batch by batch (bounded memory)."""
    max_frames = max(b.frames for b in config.buckets)
    pending: dict[Bucket, list[tuple[SourceItem, np.ndarray, float]]] = {}
    for item in items:
        bar.update(1)
        if item.problem is not None:
            log.warning("skipping %s: %s", item.source, item.problem)
            skipped.append({"source": item.source, "reason": item.problem})
            continue
        try:
            with open_media(item.uri) as media:
                clip = load_media(media, config.fps, max_frames, name=item.uri, start=item.start, end=item.end)
        except (MediaError, FileNotFoundError) as exc:
            reason = f"{'missing' if isinstance(exc, FileNotFoundError) else 'undecodable'}: {exc}"
            log.warning("skipping %s: %s", item.source, reason)
            skipped.append({"source": item.source, "reason": reason})
            continue
        _, h, w, _ = clip.frames.shape
        bucket = choose_bucket(config.buckets, len(clip.frames), h, w, clip.is_image)
        if bucket is None:
            reason = f"no-bucket: fits no bucket ({len(clip.frames)} frames at {config.fps:g} fps, {h}x{w})"
            log.warning("skipping %s: %s", item.source, reason)
            skipped.append({"source": item.source, "reason": reason})
            continue
        pixels = resize_crop(clip.frames[: bucket.frames], bucket.height, bucket.width)
        pending.setdefault(bucket, []).append((item, pixels, clip.fps))
        if len(pending[bucket]) == config.batch_size:
            yield from _encode_batch(bucket, pending.pop(bucket), variant, enc)
    for bucket in sorted(pending):
        yield from _encode_batch(bucket, pending[bucket], variant, enc)


def _encode_batch(
    bucket: Bucket, batch: list[tuple[SourceItem, np.ndarray, float]], variant: WanVariant, enc: Any
) -> Iterator[EncodedSample]:
    clips = np.stack([pixels for _, pixels, _ in batch])
    latents = enc.encode_pixels(clips)
    texts = enc.encode_text([item.caption for item, _, _ in batch], variant.text_len)
    conditions = enc.encode_condition(clips) if variant.condition_channels else [None] * len(batch)
    for (item, _, fps), z, text, cond in zip(batch, latents, texts, conditions, strict=True):
        yield EncodedSample(
            key=f"s{item.ordinal:09d}",
            latents=z,
            text=text,
            condition=cond,
            source=item.source,
            frames=bucket.frames,
            height=bucket.height,
            width=bucket.width,
            fps=fps,
            caption=item.caption,
        )
