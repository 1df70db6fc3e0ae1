"""Write safetensors files one tensor at a time: the header is computed from shapes and dtypes up front, then each
tensor is read, converted and appended, so host memory holds one tensor (as float32) and its converted copy.

The format: an 8-byte little-endian header length, a JSON header (``dtype``, ``shape``, ``data_offsets`` per key,
plus ``__metadata__``), padded with spaces to a multiple of 8 bytes, then the tensors' little-endian bytes.
bfloat16 is produced here from float32 with round-to-nearest-even (what ``torch.Tensor.to(torch.bfloat16)``
does), so the writer needs neither torch nor ml_dtypes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Export dtype name -> (safetensors dtype, bytes per element).
DTYPES: dict[str, tuple[str, int]] = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2)}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write: its key in the file and its shape (torch layout)."""

    key: str
    shape: tuple[int, ...]

    def nbytes(self, dtype: str) -> int:
        return math.prod(self.shape) * DTYPES[dtype][1]


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns (uint16), rounding to nearest even; NaNs stay NaNs."""
    f32 = np.ascontiguousarray(x, dtype=np.float32)
    bits = f32.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(f32), np.uint16(0x7FC0), rounded)


def encode(x: np.ndarray, dtype: str) -> bytes:
    """The little-endian bytes of ``x`` (any float array) in ``dtype``."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "bfloat16":
        return bfloat16_bits(x).astype("<u2").tobytes()
    return x.astype("<f4" if dtype == "float32" else "<f2").tobytes()


def write_safetensors(
    path: Path,
    entries: Sequence[TensorEntry],
    read: Callable[[str], np.ndarray],
    *,
    dtype: str,
    metadata: dict[str, str] | None = None,
) -> int:
    """Write ``entries`` to ``path`` in ``dtype``, calling ``read(key)`` for each in turn; returns the data bytes.

    The file appears under its name only when complete (written as ``<name>.partial``, then renamed).
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for entry in entries:
        size = entry.nbytes(dtype)
        header[entry.key] = {
            "dtype": DTYPES[dtype][0],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for entry in entries:
            tensor = read(entry.key)
            if tuple(tensor.shape) != entry.shape:
                raise ValueError(f"{path.name}: tensor {entry.key!r} has shape {tensor.shape}, expected {entry.shape}")
            f.write(encode(tensor, dtype))
    os.replace(partial, path)
    return offset
