"""Shape benchmark: time real training steps over a grid of (B, latent shape), store them, fit the cost model.

The backend supplies ``step_fn(batch, latent_shape)``: one complete training step (forward, backward, optimizer
update) on ``batch`` samples of ``latent_shape`` in the job's real parallel setup, returning only when the device
has finished (``torch.cuda.synchronize()`` / ``jax.block_until_ready``). Each grid point runs ``warmup`` untimed
steps (compilation, allocator warm-up), then ``repeats`` timed ones; the median is kept.

Results live in one JSON file keyed by ``variant|accelerator|parallelism`` so a cluster's measurements are reused
by every job with the same setup::

    {"version": 1, "entries": {"tiny|cpu|dp1": {"created": "...", "points": [
        {"batch": 2, "latent_shape": [5, 16, 16], "tokens": 320, "seconds": 0.031, "runs": [...]}, ...]}}}
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from wanloom_trainer.adaptiveload.cost.cost_model import CostFit, fit_cost_model
from wanloom_trainer.config.variants import WanVariant

StepFn = Callable[[int, tuple[int, int, int]], None]
BENCH_VERSION = 1


@dataclass(frozen=True)
class BenchPoint:
    """One grid point: median seconds of ``runs`` timed steps of ``batch`` × ``latent_shape``."""

    batch: int
    latent_shape: tuple[int, int, int]
    tokens: int
    seconds: float
    runs: tuple[float, ...]

    @classmethod
    def from_dict(cls, doc: dict) -> BenchPoint:
        return cls(
            batch=int(doc["batch"]),
            latent_shape=tuple(int(x) for x in doc["latent_shape"]),  # type: ignore[arg-type]
            tokens=int(doc["tokens"]),
            seconds=float(doc["seconds"]),
            runs=tuple(float(x) for x in doc.get("runs", [doc["seconds"]])),
        )


def bench_key(variant: str, accelerator: str, parallelism: str) -> str:
    """Key of a measurement set, e.g. ``wan2.2-t2v-a14b|h200|fsdp16``."""
    for name, part in (("variant", variant), ("accelerator", accelerator), ("parallelism", parallelism)):
        if not part or "|" in part:
            raise ValueError(f"bench key {name} must be non-empty and free of '|', got {part!r}")
    return f"{variant}|{accelerator}|{parallelism}"


def shape_grid(
    variant: WanVariant,
    latent_shapes: Sequence[tuple[int, int, int]],
    memory_budget_tokens: int,
    max_shapes: int = 6,
    max_batches: int = 3,
) -> list[tuple[int, tuple[int, int, int]]]:
    """(B, shape) pairs: up to ``max_shapes`` shapes spread over the token range (quantiles), each at B = 1, 2, 4, …
    (≤ ``max_batches`` values) while B·S ≤ M_mem."""
    shapes = sorted({tuple(int(x) for x in s) for s in latent_shapes}, key=lambda s: (variant.tokens(*s), s))
    if not shapes:
        raise ValueError("shape grid needs at least one latent shape")
    picks = np.unique(np.linspace(0, len(shapes) - 1, min(max_shapes, len(shapes))).round().astype(int))
    grid = []
    for i in picks.tolist():
        s = variant.tokens(*shapes[i])
        batches = [b for b in (2**j for j in range(16)) if b * s <= memory_budget_tokens][:max_batches] or [1]
        grid.extend((b, shapes[i]) for b in batches)
    return grid


def run_shape_bench(
    step_fn: StepFn,
    grid: Sequence[tuple[int, tuple[int, int, int]]],
    variant: WanVariant,
    warmup: int = 1,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> list[BenchPoint]:
    """Time ``step_fn`` at every grid point (warm-up, then the median of ``repeats``)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    points = []
    for batch, shape in grid:
        for _ in range(warmup):
            step_fn(batch, shape)
        runs = []
        for _ in range(repeats):
            start = clock()
            step_fn(batch, shape)
            runs.append(clock() - start)
        points.append(BenchPoint(batch, tuple(shape), variant.tokens(*shape), statistics.median(runs), tuple(runs)))
    return points


def fit_points(points: Sequence[BenchPoint], kind: str = "auto") -> CostFit:
    """Fit the cost model (``cost_model.fit_cost_model``) to benchmark points."""
    b = np.array([p.batch for p in points])
    s = np.array([p.tokens for p in points])
    t = np.array([p.seconds for p in points])
    return fit_cost_model(b, s, t, kind=kind)


def load_points(path: str | Path, key: str) -> list[BenchPoint] | None:
    """The stored points of ``key``, or None when the file or the key does not exist."""
    doc = _read(Path(path))
    entry = doc["entries"].get(key)
    return None if entry is None else [BenchPoint.from_dict(p) for p in entry["points"]]


def save_points(path: str | Path, key: str, points: Sequence[BenchPoint]) -> None:
    """Store (or replace) the points of ``key``, keeping every other key of the file."""
    path = Path(path)
    doc = _read(path)
    doc["entries"][key] = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "points": [{**asdict(p), "latent_shape": list(p.latent_shape), "runs": list(p.runs)} for p in points],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def _read(path: Path) -> dict:
    if not path.exists():
        return {"version": BENCH_VERSION, "entries": {}}
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read shape benchmark file {path}: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("version") != BENCH_VERSION or not isinstance(doc.get("entries"), dict):
        raise ValueError(f"{path} is not a version-{BENCH_VERSION} shape benchmark file (expected version, entries)")
    return doc
