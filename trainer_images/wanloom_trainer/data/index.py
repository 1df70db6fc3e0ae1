"""The shape index: one JSON file per dataset listing every sample's shard, position, shape and byte ranges.

Plans are made from it without opening a shard (``ShapeIndex.sample_shapes()`` is the planner's input), and the
reader fetches a sample with one range request (``span``). The file is columnar (one list per field) so a
million-sample index parses in seconds; the layout is documented in docs/data-format.md.
Sample ids are positions in the index, 0..n-1, in shard order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from wanloom_trainer.config.variants import WanVariant
from wanloom_trainer.data.format import FORMAT_NAME, FORMAT_VERSION, MEMBERS, STORAGE_DTYPES

INDEX_NAME = "index.json"
# The text encoder's output for the empty prompt "" (real tokens only, float32 [L, D_text]), beside the index:
# what caption dropout trains the unconditional branch on.
EMPTY_PROMPT_NAME = "empty_prompt.npy"
# `wanloom data prepare --negative-prompt`: what guidance steers validation videos away from (same format).
NEGATIVE_PROMPT_NAME = "negative_prompt.npy"
# Validation prompts encoded like the captions (``wanloom data prepare --prompts``): ``text`` float32 [N, L, D]
# zero-padded to text_len, ``lengths`` [N] real tokens, ``prompts`` the strings.
PROMPTS_NAME = "prompts.npz"
SHARD_DIR = "shards"


@dataclass(frozen=True)
class DatasetHeader:
    """What every sample of a dataset shares.

    Attributes:
        variant: the Wan variant the latents were made for (``config.variants``).
        latent_channels: C of latents [C, T', H', W'].
        condition_channels: Cc of the I2V condition, 0 when samples carry none.
        text_dim: D_text; text_len: L the reader zero-pads text to.
        dtype: storage dtype of the tensors (float32, float16 or bfloat16).
        source: "prepare" or "synthetic", with ``build`` holding the settings that produced it.
    """

    variant: str
    latent_channels: int
    condition_channels: int
    text_dim: int
    text_len: int
    dtype: str
    source: str
    build: dict[str, Any]

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"dataset dtype {self.dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")
        for name in ("latent_channels", "text_dim", "text_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"dataset {name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def for_variant(cls, variant: WanVariant, *, dtype: str, source: str, build: dict[str, Any]) -> DatasetHeader:
        """The header of a dataset whose tensors have ``variant``'s latent, condition and text shapes."""
        return cls(
            variant=variant.name,
            latent_channels=variant.out_channels,
            condition_channels=variant.condition_channels,
            text_dim=variant.text_dim,
            text_len=variant.text_len,
            dtype=dtype,
            source=source,
            build=build,
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True, eq=False)
class ShapeIndex:
    """Columnar per-sample table. Arrays have n rows; ``member_ranges`` is int64 [n, len(MEMBERS), 2]."""

    header: DatasetHeader
    shards: tuple[str, ...]
    keys: tuple[str, ...]
    shard: np.ndarray  # int64 [n]: index into ``shards``
    position: np.ndarray  # int64 [n]: ordinal of the sample inside its shard
    latent_shapes: np.ndarray  # int64 [n, 3]: (T', H', W')
    text_tokens: np.ndarray  # int64 [n]
    pixels: np.ndarray  # int64 [n, 3]: (frames, height, width) after bucketing
    fps: np.ndarray  # float64 [n]
    sources: tuple[str, ...]
    span: np.ndarray  # int64 [n, 2]: (offset, length) in the shard
    member_ranges: np.ndarray  # int64 [n, M, 2]: (offset relative to span, size); (-1, 0) when absent
    crc32: np.ndarray  # int64 [n]

    def __post_init__(self) -> None:
        n = len(self.keys)
        for name in ("shard", "position", "latent_shapes", "text_tokens", "pixels", "fps", "span", "crc32"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"index column {name} has {len(getattr(self, name))} rows, expected {n}")
        if n and (self.shard.min() < 0 or self.shard.max() >= len(self.shards)):
            raise ValueError("index column shard points outside the shard list")
        if self.member_ranges.shape != (n, len(MEMBERS), 2):
            raise ValueError(
                f"index member_ranges has shape {self.member_ranges.shape}, expected {(n, len(MEMBERS), 2)}"
            )

    @property
    def num_samples(self) -> int:
        return len(self.keys)

    def sample_shapes(self) -> Any:
        """The planner's input: ``adaptiveload.SampleShapes(ids=0..n-1, latent_shapes=[n, 3])``."""
        from wanloom_trainer.adaptiveload.sizing.shape_index import SampleShapes

        return SampleShapes(np.arange(self.num_samples, dtype=np.int64), self.latent_shapes)

    def has_member(self, sample_id: int, member: str) -> bool:
        return bool(self.member_ranges[sample_id, MEMBERS.index(member), 0] >= 0)

    def to_json(self) -> str:
        doc = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "header": self.header.to_dict(),
            "members": list(MEMBERS),
            "shards": list(self.shards),
            "num_samples": self.num_samples,
            "samples": {
                "key": list(self.keys),
                "shard": self.shard.tolist(),
                "position": self.position.tolist(),
                "latent_shape": self.latent_shapes.tolist(),
                "text_tokens": self.text_tokens.tolist(),
                "pixels": self.pixels.tolist(),
                "fps": self.fps.tolist(),
                "source": list(self.sources),
                "span": self.span.tolist(),
                "member_ranges": self.member_ranges.tolist(),
                "crc32": self.crc32.tolist(),
            },
        }
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "index") -> ShapeIndex:
        """Parse an index; any problem raises ValueError naming ``where`` and the field."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ValueError(f"{where}: not a {FORMAT_NAME} index (field 'format' must be {FORMAT_NAME!r})")
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"{where}: index version {doc.get('version')!r}; this reader supports {FORMAT_VERSION}")
        if doc.get("members") != list(MEMBERS):
            raise ValueError(f"{where}: members {doc.get('members')} differ from {list(MEMBERS)}")
        try:
            return cls._from_doc(doc)
        except KeyError as exc:
            raise ValueError(f"{where}: field {exc} is missing") from exc
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from exc

    @classmethod
    def _from_doc(cls, doc: dict[str, Any]) -> ShapeIndex:
        s = doc["samples"]
        n = len(s["key"])

        def col(name: str, width: tuple[int, ...] = (), dtype: Any = np.int64) -> np.ndarray:
            try:
                return np.asarray(s[name], dtype=dtype).reshape((n, *width))
            except (TypeError, ValueError):
                per = int(np.prod(width)) if width else 1
                held = np.size(s[name]) if _rectangular(s[name]) else "ragged rows"
                raise ValueError(
                    f"samples.{name} must hold {n * per} numbers ({per} per sample, for the {n} samples of "
                    f"samples.key); it holds {held}"
                ) from None

        return cls(
            header=DatasetHeader(**doc["header"]),
            shards=tuple(doc["shards"]),
            keys=tuple(s["key"]),
            shard=col("shard"),
            position=col("position"),
            latent_shapes=col("latent_shape", (3,)),
            text_tokens=col("text_tokens"),
            pixels=col("pixels", (3,)),
            fps=col("fps", dtype=np.float64),
            sources=tuple(s["source"]),
            span=col("span", (2,)),
            member_ranges=col("member_ranges", (len(MEMBERS), 2)),
            crc32=col("crc32"),
        )


def _rectangular(values: Any) -> bool:
    try:
        np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        return False
    return True


def shard_name(number: int, tag: str = "") -> str:
    """Path of shard ``number`` relative to the dataset root (``tag``: a second writer's copy with other bytes)."""
    return f"{SHARD_DIR}/shard-{number:06d}{f'.{tag}' if tag else ''}.tar"


def shard_manifest_name(number: int) -> str:
    """The shard's sidecar: its index rows, written after the tar so its presence marks the shard complete."""
    return f"{SHARD_DIR}/shard-{number:06d}.json"
