"""The on-disk sample format: WebDataset tar members holding .npy tensors plus a JSON record (docs/data-format.md).

One sample is four tar members sharing a key (``<key>.<member>``, WebDataset's "key up to the first dot" rule):

- ``latents.npy``: normalised VAE latents [C, T', H', W'];
- ``text.npy``: text-encoder output [L, D_text], only the caption's L real tokens (the loader zero-pads to text_len);
- ``condition.npy`` (optional): I2V condition [Cc, T', H', W'] (4 mask channels + the first frame's latents);
- ``json``: :class:`SampleMeta`.

bfloat16 has no numpy dtype: it is stored as its raw ``<u2`` bit pattern and the JSON's ``dtypes`` names it, so the
reader (and any other WebDataset consumer) can widen it to float32 exactly, without ml_dtypes or torch.
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import asdict, dataclass, field

import numpy as np

FORMAT_NAME = "wanloom-latents"
FORMAT_VERSION = 1
# Member order inside a sample; the index stores one (offset, size) pair per member in this order.
MEMBERS: tuple[str, ...] = ("latents.npy", "text.npy", "condition.npy", "json")
TENSOR_MEMBERS: dict[str, str] = {"latents": "latents.npy", "text": "text.npy", "condition": "condition.npy"}
STORAGE_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")


class CorruptSample(ValueError):
    """A sample's bytes do not decode into what the index promises (checksum, npy header, shape, values)."""


@dataclass(frozen=True)
class SampleMeta:
    """Per-sample metadata (the ``json`` member). Pixel sizes are after bucketing (what the VAE saw)."""

    key: str
    source: str
    frames: int
    height: int
    width: int
    fps: float
    latent_shape: tuple[int, int, int]
    text_tokens: int
    caption: str = ""
    dtypes: dict[str, str] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        doc = asdict(self)
        doc["latent_shape"] = list(self.latent_shape)
        return json.dumps(doc, sort_keys=True, ensure_ascii=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> SampleMeta:
        doc = json.loads(data)
        doc["latent_shape"] = tuple(doc["latent_shape"])
        return cls(**doc)


@dataclass(frozen=True)
class EncodedSample:
    """One sample ready to be written, tensors in float32 (converted to the storage dtype on write).

    Attributes:
        key: WebDataset key (no dots, no slashes), unique within the dataset.
        latents: float32 [C, T', H', W'].
        text: float32 [L, D_text], the L real tokens only.
        condition: float32 [Cc, T', H', W'] or None.
        meta: everything else; ``latent_shape``, ``text_tokens`` and ``dtypes`` are filled in by ``encode_sample``.
    """

    key: str
    latents: np.ndarray
    text: np.ndarray
    condition: np.ndarray | None
    source: str
    frames: int
    height: int
    width: int
    fps: float
    caption: str = ""


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns (uint16), rounding to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) → float32, exact."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_tensor(x: np.ndarray, dtype: str) -> bytes:
    """A float tensor as .npy bytes in the storage dtype (bfloat16 as raw uint16 bits)."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype {dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")
    stored = to_bfloat16_bits(x) if dtype == "bfloat16" else np.asarray(x, dtype=dtype)
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(stored), allow_pickle=False)
    return buf.getvalue()


# The header dict numpy writes: {'descr': '<f4', 'fortran_order': False, 'shape': (16, 3, 8, 8), }
_NPY_HEADER = re.compile(
    r"""\{\s*'descr':\s*'(?P<descr>[^']+)',\s*'fortran_order':\s*(?P<fortran>True|False),\s*"""
    r"""'shape':\s*\((?P<shape>[\d,\s]*)\),?\s*\}"""
)


def _read_npy_header(stream: io.BytesIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran order, dtype) of a .npy header. numpy's own parser goes through ``ast.literal_eval``, which
    CPython 3.11 can fail with a spurious "SystemError: AST constructor recursion depth mismatch" when threads
    parse at once (python/cpython#106905); the loader decodes in threads, so the header is matched here instead."""
    major, _ = np.lib.format.read_magic(stream)
    size_bytes = 2 if major == 1 else 4
    raw = stream.read(size_bytes)
    if len(raw) != size_bytes:
        raise ValueError("truncated header length")
    text = stream.read(int.from_bytes(raw, "little")).decode("utf8" if major >= 3 else "latin1")
    match = _NPY_HEADER.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"unexpected header {text.strip()[:80]!r}")
    shape = tuple(int(d) for d in match["shape"].replace(" ", "").split(",") if d)
    return shape, match["fortran"] == "True", np.dtype(match["descr"])


def decode_tensor(data: bytes | memoryview, dtype: str) -> np.ndarray:
    """.npy bytes → float32 array, without copying the payload twice. Raises CorruptSample on a bad header."""
    try:
        stream = io.BytesIO(data)
        shape, fortran, stored = _read_npy_header(stream)
        count = math.prod(shape)
        arr = np.frombuffer(data, dtype=stored, count=count, offset=stream.tell())
    except (ValueError, EOFError, TypeError) as exc:
        raise CorruptSample(f"bad .npy member: {exc}") from exc
    arr = arr.reshape(shape, order="F" if fortran else "C")
    if dtype == "bfloat16":
        if arr.dtype != np.uint16:
            raise CorruptSample(f"bfloat16 member stored as {arr.dtype}, expected uint16 bits")
        return from_bfloat16_bits(arr)
    return arr.astype(np.float32)


def encode_sample(sample: EncodedSample, dtype: str) -> dict[str, bytes]:
    """Member name → bytes, in ``MEMBERS`` order (condition omitted when absent)."""
    _check_sample(sample)
    tensors = {"latents.npy": sample.latents, "text.npy": sample.text}
    if sample.condition is not None:
        tensors["condition.npy"] = sample.condition
    meta = SampleMeta(
        key=sample.key,
        source=sample.source,
        frames=int(sample.frames),
        height=int(sample.height),
        width=int(sample.width),
        fps=float(sample.fps),
        latent_shape=tuple(int(s) for s in sample.latents.shape[1:]),  # type: ignore[arg-type]
        text_tokens=int(sample.text.shape[0]),
        caption=sample.caption,
        dtypes={name.removesuffix(".npy"): dtype for name in tensors},
    )
    members = {name: encode_tensor(x, dtype) for name, x in tensors.items()}
    members["json"] = meta.to_bytes()
    return members


def _check_sample(sample: EncodedSample) -> None:
    if not sample.key or any(c in sample.key for c in "./\\") or sample.key != sample.key.strip():
        raise ValueError(f"sample key {sample.key!r} must be non-empty without '.', '/' or spaces at the ends")
    if sample.latents.ndim != 4:
        raise ValueError(f"sample {sample.key}: latents must be [C, T', H', W'], got shape {sample.latents.shape}")
    if sample.text.ndim != 2 or sample.text.shape[0] < 1:
        raise ValueError(f"sample {sample.key}: text must be [L>=1, D], got shape {sample.text.shape}")
    cond = sample.condition
    if cond is not None and (cond.ndim != 4 or cond.shape[1:] != sample.latents.shape[1:]):
        want = ", ".join(map(str, sample.latents.shape[1:]))
        raise ValueError(f"sample {sample.key}: condition shape {cond.shape} must be [Cc, {want}]")
