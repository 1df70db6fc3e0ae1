"""A LatentDataset's three steps, each one process (``wanloom data build``): the operator runs each as a pod.

- :func:`plan`: read the manifest (or listing) and count the inputs and work units: the encode Job's completions.
- :func:`encode`: encode work units (the pod's completion index), exactly as ``wanloom data prepare --work-unit``.
- :func:`finalize`: join the units into ``index.json`` and ``skipped.json``; no encoders needed (the encode step
  writes the dataset-wide empty-prompt embedding).

Each returns a small summary the pod writes as its termination message (JSON), which is how the operator learns
counts without reading the bucket. The same functions in a row are a local build of the dataset file.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wanloom_api.latentdataset import LatentDataset
from wanloom_trainer.data.bucketing import Bucket
from wanloom_trainer.data.prepare.pipeline import PrepareConfig, prepare
from wanloom_trainer.data.prepare.sources import read_sources, skip_kind
from wanloom_trainer.data.prepare.stages import ProgressCallback
from wanloom_trainer.data.storage import GCS_SCHEME

ENCODER_FOLDERS = ("vae", "text_encoder", "tokenizer")
WEIGHTS_CACHE = Path(os.environ.get("WANLOOM_WEIGHTS_CACHE", "/tmp/wanloom-weights"))


def prepare_config(dataset: LatentDataset, device: str | None = None, model_root: Path | None = None) -> PrepareConfig:
    """The build settings a LatentDataset stands for (the same in every pod, so every pod records the same build)."""
    spec = dataset.spec
    device = device or ("cuda" if spec.resources.gpu is not None else "cpu")
    accelerated = spec.resources.gpu is not None or spec.resources.tpu is not None
    dtype = spec.encoders.dtype or ("bfloat16" if accelerated else "float32")
    return PrepareConfig(
        inputs=spec.source.uri,
        output=spec.output,
        model=spec.encoders.weights,
        variant=spec.encoders.variant,
        buckets=tuple(Bucket(b.frames, b.height, b.width) for b in spec.buckets),
        fps=spec.fps,
        batch_size=spec.encoders.batch_size,
        samples_per_shard=spec.samples_per_shard,
        dtype=spec.dtype,
        max_skipped=spec.max_bad_samples,
        storage_outage_s=spec.storage_outage_seconds,
        device=device,
        encoder_dtype=dtype,
        model_root=model_root,
        encoders=spec.encoders.backend,
    )


def plan(dataset: LatentDataset) -> dict[str, Any]:
    """Inputs, work units and inputs already known to be bad (rows, captions) of the dataset's source."""
    items = read_sources(dataset.spec.source.uri)
    per = dataset.spec.samples_per_shard
    bad = Counter(skip_kind(i.problem) for i in items if i.problem is not None)
    return {"inputs": len(items), "units": -(-len(items) // per), "bad": dict(sorted(bad.items()))}


def encode(
    dataset: LatentDataset,
    units: Sequence[int],
    device: str | None = None,
    on_progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Encode ``units`` (finished ones are skipped); the encoders load from a local copy of the weights, the media
    are decoded on ``$WANLOOM_DECODE_WORKERS`` processes; ``on_progress`` gets each unit's counts."""
    started = time.monotonic()
    config = prepare_config(dataset, device, _local_weights(dataset.spec.encoders.weights))
    prepare(config, progress=False, units=list(units), finalize=False, on_progress=on_progress)
    return {"units": list(units), "seconds": round(time.monotonic() - started, 3)}


def finalize(dataset: LatentDataset) -> dict[str, Any]:
    """Write skipped.json and index.json once every unit is written (``TooManySkipped`` past maxBadSamples)."""
    result = prepare(prepare_config(dataset), progress=False, units=[], finalize=True)
    assert result.index is not None
    reasons = Counter(skip_kind(s["reason"]) for s in result.skipped)
    return {
        "samples": int(result.index.num_samples),
        "shards": len(result.index.shards),
        "skipped": dict(sorted(reasons.items())),
    }


def build(
    dataset: LatentDataset, device: str | None = None, on_progress: ProgressCallback | None = None
) -> dict[str, Any]:
    """Every step in this process: what the operator's pods do, on one machine."""
    planned = plan(dataset)
    encode(dataset, range(planned["units"]), device, on_progress)
    return {**planned, **finalize(dataset)}


def _local_weights(uri: str) -> Path:
    """A local folder with the encoders' subfolders: ``uri`` itself, or a one-time copy of a gs:// root."""
    if not uri.startswith(GCS_SCHEME):
        return Path(uri)
    from wanloom_trainer.checkpoint.gcs import stage_weights

    try:
        return stage_weights(uri, WEIGHTS_CACHE, ENCODER_FOLDERS)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"spec.encoders.weights: {exc}".replace("spec.model.weights: ", "")) from exc
