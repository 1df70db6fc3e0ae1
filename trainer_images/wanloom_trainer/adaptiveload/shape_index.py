"""The planner's view of a dataset: one latent shape per sample.

The data pipeline owns the on-disk index format; it hands the planner a :class:`SampleShapes` built from plain
arrays (``SampleShapes(ids, latent_shapes)``). ``ids`` are whatever integer keys the data loader fetches samples by
(``MicroBatch.sample_ids`` carries them back); ``latent_shapes`` are the VAE latent (T', H', W') per sample, images
having T' = 1.

``from_json`` reads the simple interchange form ``{"ids": [...], "latent_shapes": [[T', H', W'], ...]}`` (ids
optional, defaulting to 0..n-1), or a list of records that each hold ``"latent_shape"`` (and optionally ``"id"``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True, eq=False)
class SampleShapes:
    """Per-sample latent shapes.

    Attributes:
        ids: int64 [n], unique sample keys.
        latent_shapes: int64 [n, 3], (T', H', W') per sample.
    """

    ids: np.ndarray
    latent_shapes: np.ndarray

    def __post_init__(self) -> None:
        ids = np.asarray(self.ids, dtype=np.int64).reshape(-1)
        shapes = np.asarray(self.latent_shapes, dtype=np.int64)
        if shapes.ndim != 2 or shapes.shape[1] != 3:
            raise ValueError(f"latent_shapes must be [n, 3] (T', H', W'), got shape {shapes.shape}")
        if len(ids) != len(shapes):
            raise ValueError(f"ids ({len(ids)}) and latent_shapes ({len(shapes)}) differ in length")
        if len(ids) == 0:
            raise ValueError("the shape index holds no samples")
        if (shapes <= 0).any():
            bad = int(np.flatnonzero((shapes <= 0).any(axis=1))[0])
            raise ValueError(f"sample id {ids[bad]} has a non-positive latent shape {tuple(shapes[bad])}")
        if len(np.unique(ids)) != len(ids):
            raise ValueError("sample ids must be unique")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "latent_shapes", shapes)

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def from_arrays(cls, latent_shapes: Any, ids: Any | None = None) -> SampleShapes:
        shapes = np.asarray(latent_shapes, dtype=np.int64)
        return cls(np.arange(len(shapes)) if ids is None else np.asarray(ids), shapes)

    @classmethod
    def from_json(cls, path: str | Path) -> SampleShapes:
        """Read the interchange form described in the module docstring; errors name the file."""
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read shape index {path}: {exc}") from exc
        try:
            if isinstance(doc, dict):
                return cls.from_arrays(doc["latent_shapes"], doc.get("ids"))
            if isinstance(doc, list):
                ids = [r["id"] for r in doc] if doc and all("id" in r for r in doc) else None
                return cls.from_arrays([r["latent_shape"] for r in doc], ids)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"shape index {path}: {exc}") from exc
        raise ValueError(f"shape index {path}: expected an object with 'latent_shapes' or a list of records")

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"ids": self.ids.tolist(), "latent_shapes": self.latent_shapes.tolist()}))
