"""The planner's view of a dataset: one latent shape per sample.

The data pipeline owns the on-disk index format; it hands the planner a :class:`SampleShapes` built from plain
arrays (``SampleShapes(ids, latent_shapes)``). ``ids`` are whatever integer keys the data loader fetches samples by
(``MicroBatch.sample_ids`` carries them back); ``latent_shapes`` are the VAE latent (T', H', W') per sample, images
having T' = 1.

``from_pixel_csv`` reads a CSV of clip and image sizes in pixels (header ``frames,height,width``), so a user can
plan before encoding anything. ``from_json`` reads the simple interchange form ``{"ids": [...], "latent_shapes":
[[T', H', W'], ...]}`` (ids optional, defaulting to 0..n-1), or a list of records that each hold
``"latent_shape"`` (and optionally ``"id"``).
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
    def from_pixel_csv(cls, path: str | Path, vae_stride: tuple[int, int, int], grid: tuple[int, int]) -> SampleShapes:
        """Samples from a CSV with the header ``frames,height,width`` (pixels; frames 1 for an image).

        Each size becomes the latent the data pipeline would make of it: frames cut to 1 + a multiple of the VAE's
        time stride, height and width cropped to multiples of ``grid`` (VAE stride × patch), then divided by the
        VAE strides. Errors name the file, the line and what is valid.
        """
        import csv

        path = Path(path)
        try:
            rows = list(csv.reader(path.read_text().splitlines()))
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: cannot read the shapes CSV: {exc}") from None
        if not rows or [c.strip().lower() for c in rows[0]] != ["frames", "height", "width"]:
            raise ValueError(f"{path}: line 1 must be the header 'frames,height,width' (pixel sizes)")
        st, sh, sw = vae_stride
        pixels = []
        for line, row in enumerate(rows[1:], start=2):
            try:
                f, h, w = (int(v) for v in row)
            except ValueError:
                raise ValueError(f"{path}: line {line}: expected integers frames,height,width, got {row}") from None
            if f < 1 or h < grid[0] or w < grid[1]:
                raise ValueError(
                    f"{path}: line {line}: {f}x{h}x{w} is too small: frames >= 1, height >= {grid[0]}, "
                    f"width >= {grid[1]} pixels"
                )
            pixels.append((1 + (f - 1) // st * st, h // grid[0] * grid[0], w // grid[1] * grid[1]))
        if not pixels:
            raise ValueError(f"{path}: no samples after the header")
        p = np.asarray(pixels, dtype=np.int64)
        return cls.from_arrays(np.stack([(p[:, 0] - 1) // st + 1, p[:, 1] // sh, p[:, 2] // sw], axis=1))

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
