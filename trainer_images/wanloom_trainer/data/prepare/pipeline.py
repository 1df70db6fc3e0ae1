"""``wanloom data prepare``: captioned videos and images → latent shards + shape index.

Inputs (``sources``): a manifest (JSONL, CSV or Parquet, on gs:// or a path), or a folder / gs:// prefix of media
with sidecar captions. The ordered inputs are cut into **work units** of ``samples_per_shard``, one shard each; a
unit's sources are read (ranged reads from GCS), decoded and resized into their bucket on a pool of CPU processes
(loading.py), encoded in batches of one bucket with the Wan VAE and the umT5 text encoder on the main process
(encoders.py) and written by a background thread as they come (background_write.py, writer.py); each stage's seconds
go to the log and to the pod's metrics (stages.py). A unit's bytes depend only on its inputs and the settings, so
any worker may do (or redo) any unit, at the same time as another: ``prepare(..., units=[k], finalize=False)`` is
one worker of an Indexed Job, and ``finalize`` joins the shards into the index once every unit is written. Re-running
skips finished units. Sources that cannot be decoded or fit no bucket are skipped and listed (``skipped.json``),
never fatal.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from wanloom_trainer.config.variants import WanVariant, get_variant
from wanloom_trainer.data.bucketing import Bucket, validate_buckets
from wanloom_trainer.data.format import STORAGE_DTYPES, EncodedSample
from wanloom_trainer.data.index import DatasetHeader, ShapeIndex
from wanloom_trainer.data.outage import StorageBreaker
from wanloom_trainer.data.prepare.background_write import BackgroundWrite
from wanloom_trainer.data.prepare.loading import Loaded, LoadSettings, decode_workers, load_all
from wanloom_trainer.data.prepare.sources import SourceItem, read_sources, skip_kind
from wanloom_trainer.data.prepare.stages import ProgressCallback, StageClock
from wanloom_trainer.data.prepare.writer import DatasetWriter
from wanloom_trainer.data.storage import TransientStorageError, open_storage

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
        encoders: "torch" (diffusers/transformers), "jax" (model/encoders/vae_jax.py, umt5_jax.py) or "auto" (torch
            where it is installed, else jax); both give the same latents within float error.
        storage_outage_s: how long storage may stay unreachable: the unit being written is redone after a wait,
            nothing is skipped; past it, ``StorageOutage``.
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
    storage_outage_s: float = field(default=600.0, compare=False)

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
    workers: int | None = None,
    on_progress: ProgressCallback | None = None,
) -> PrepareResult:
    """Run (or resume) a prepare: every unfinished work unit, or only ``units``; then, with ``finalize``, the index.
    ``encoders`` overrides loading ``WanEncoders`` from ``config.model``; ``workers`` processes read and decode
    (default: ``loading.decode_workers()``; 0: in this process); ``on_progress`` gets each written unit's counts."""
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
        shards = {k: items[k * per : (k + 1) * per] for k in (range(num_units) if units is None else units)}
        total = sum(map(len, shards.values()))
        bar = _progress(total, total - sum(len(shards[k]) for k in todo), progress)
        settings = LoadSettings(config.buckets, config.fps)
        workers = decode_workers() if workers is None else workers
        breaker, attempt = StorageBreaker(config.storage_outage_s), 0
        while todo:
            batch = tuple(todo)  # what this pass loads; `todo` shrinks as units are written
            try:
                with closing(load_all((it for k in batch for it in shards[k]), settings, workers)) as loaded:
                    for k in batch:
                        _write_unit(k, islice(loaded, len(shards[k])), writer, config, variant, encoders, bar,
                                    on_progress)  # fmt: skip
                        todo.remove(k)
                        breaker.succeeded()
            except TransientStorageError as exc:  # an outage, not bad data: wait, then redo the unit
                breaker.failed(f"work unit {todo[0]}", str(exc), attempt)
                attempt += 1
        bar.close()
    if not finalize:
        return PrepareResult(None, writer.skipped())
    return _finalize(config, writer, encoders, variant)


def _write_unit(
    number: int,
    loaded: Iterator[Loaded],
    writer: DatasetWriter,
    config: PrepareConfig,
    variant: WanVariant,
    enc: Any,
    bar: Any,
    on_progress: ProgressCallback | None,
) -> None:
    """Encode one unit's loaded sources while a thread writes it; its counts go to the log and ``on_progress``."""
    started, clock, skipped = time.monotonic(), StageClock(), []
    with BackgroundWrite(writer, number, skipped, clock) as sink:
        for sample in _encode_unit(loaded, config.batch_size, variant, enc, skipped, bar, clock):
            sink.put(sample)
    done = clock.take(units=1)
    log.info("unit %d: %s (%.1f s)", number, done.summary(), time.monotonic() - started)
    if on_progress is not None:
        on_progress(done)


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
        from wanloom_trainer.data.prepare.encoders import load_torch_encoders

        enc = load_torch_encoders(root, config.device, config.encoder_dtype)  # a replica per GPU of the pod
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


def _encode_unit(
    loaded: Iterator[Loaded],
    batch_size: int,
    variant: WanVariant,
    enc: Any,
    skipped: list[dict[str, str]],
    bar: Any,
    clock: StageClock,
) -> Iterator[EncodedSample]:
    """Encode a unit's loaded sources in batches of one bucket, yielding samples batch by batch (bounded memory);
    sources that cannot be used are listed in ``skipped``, in input order."""
    pending: dict[Bucket, list[Loaded]] = {}
    for source in loaded:
        bar.update(1)
        for stage, seconds in source.seconds.items():
            clock.time(stage, seconds)
        if source.reason is not None or source.bucket is None:
            log.warning("skipping %s: %s", source.item.source, source.reason)
            skipped.append({"source": source.item.source, "reason": str(source.reason)})
            clock.skip(skip_kind(str(source.reason)))
            continue
        pending.setdefault(source.bucket, []).append(source)
        if len(pending[source.bucket]) == batch_size:
            yield from _encode_batch(source.bucket, pending.pop(source.bucket), variant, enc, clock)
    for bucket in sorted(pending):
        yield from _encode_batch(bucket, pending[bucket], variant, enc, clock)


def _encode_batch(
    bucket: Bucket, batch: list[Loaded], variant: WanVariant, enc: Any, clock: StageClock
) -> Iterator[EncodedSample]:
    clips = np.stack([source.pixels for source in batch])
    started = time.perf_counter()
    latents = enc.encode_pixels(clips)
    conditions = enc.encode_condition(clips) if variant.condition_channels else [None] * len(batch)
    encoded = time.perf_counter()
    texts = enc.encode_text([source.item.caption for source in batch], variant.text_len)
    clock.time("vae", encoded - started)
    clock.time("text", time.perf_counter() - encoded)
    for source, z, text, cond in zip(batch, latents, texts, conditions, strict=True):
        clock.sample()
        yield EncodedSample(
            key=f"s{source.item.ordinal:09d}",
            latents=z,
            text=text,
            condition=cond,
            source=source.item.source,
            frames=bucket.frames,
            height=bucket.height,
            width=bucket.width,
            fps=source.fps,
            caption=source.item.caption,
        )
