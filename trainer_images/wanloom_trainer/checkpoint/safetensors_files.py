"""Read diffusers model folders' safetensors files one tensor at a time, without torch or jax.

The header is parsed here (8-byte little-endian length, then JSON with dtype, shape and byte offsets) rather than
through ``safe_open(framework="numpy")``, which cannot return bfloat16 tensors: ``tensor`` gives zero-copy views
(bfloat16 as ``ml_dtypes.bfloat16``, which the JAX trainer has), ``float32`` a float32 copy that needs neither.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
}


class SafetensorsFile:
    """A memory-mapped ``.safetensors`` file; ``tensor(key)`` is a zero-copy view into the mapping."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        self._entries: dict[str, dict] = header
        self._data_start = 8 + header_len
        self._map = np.memmap(path, dtype=np.uint8, mode="r")

    def keys(self) -> list[str]:
        return list(self._entries)

    def tensor(self, key: str) -> np.ndarray:
        entry = self._entries[key]
        raw = self._raw(key)
        if entry["dtype"] == "BF16":
            import ml_dtypes

            return raw.view(ml_dtypes.bfloat16).reshape(entry["shape"])
        return raw.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def float32(self, key: str) -> np.ndarray:
        """The tensor as float32 (bfloat16 widened bit by bit: it is float32's upper half)."""
        entry = self._entries[key]
        raw = self._raw(key)
        if entry["dtype"] == "BF16":
            return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])
        return raw.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"]).astype(np.float32)

    def _raw(self, key: str) -> np.ndarray:
        entry = self._entries[key]
        if entry["dtype"] not in (*_DTYPES, "BF16"):
            valid = ", ".join((*_DTYPES, "BF16"))
            raise ValueError(f"{self.path}: tensor {key!r} has dtype {entry['dtype']}; supported: {valid}")
        begin, end = (self._data_start + offset for offset in entry["data_offsets"])
        return self._map[begin:end]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entries[key]["shape"])


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Map every tensor key of a diffusers model folder to the shard file that holds it."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise ValueError(f"{folder}: more than one safetensors index: {[p.name for p in indexes]}")
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    singles = sorted(folder.glob("*.safetensors"))
    if len(singles) != 1:
        raise FileNotFoundError(
            f"{folder}: expected one *.safetensors file or a *.safetensors.index.json, "
            f"found {[p.name for p in singles]}"
        )
    return dict.fromkeys(SafetensorsFile(singles[0]).keys(), singles[0])
