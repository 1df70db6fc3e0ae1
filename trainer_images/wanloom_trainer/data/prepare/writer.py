"""Writing a dataset: shards, their manifests and finally the index, resumable shard by shard.

A dataset is built as numbered shards, each from a fixed slice of the inputs. A shard is written as its tar and
then its manifest (``shards/shard-NNNNNN.json``: the shard's index rows and the inputs it skipped); a shard whose
manifest exists is complete, so an interrupted build redoes at most the shards it was writing. ``build.json``
records the settings; resuming with different settings is refused rather than mixing two datasets.
``finalize`` joins the manifests into ``index.json`` (and the skipped inputs into ``skipped.json``), the last file
written: its presence marks a usable dataset.

Any number of workers may write shards at once, the same shard too (a retried pod beside a slow one): both
objects are created only if absent (GCS ``ifGenerationMatch=0``, a hard link locally). A tar that is already there
with other bytes (an encoder is not bit-exact across devices) makes this writer's tar ``shard-NNNNNN.<md5>.tar``;
the first manifest decides which tar the shard is, and a writer whose manifest lost removes its own tar.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from wanloom_trainer.data.format import MEMBERS, EncodedSample, encode_sample
from wanloom_trainer.data.index import (
    EMPTY_PROMPT_NAME,
    INDEX_NAME,
    NEGATIVE_PROMPT_NAME,
    PROMPTS_NAME,
    DatasetHeader,
    ShapeIndex,
    shard_manifest_name,
    shard_name,
)
from wanloom_trainer.data.shards import ShardWriter
from wanloom_trainer.data.storage import Storage

BUILD_NAME = "build.json"
SKIPPED_NAME = "skipped.json"


class TooManySkipped(ValueError):
    """More inputs were skipped than the build allows: the dataset is not finalized (no index.json)."""

    def __init__(self, skipped: list[dict[str, str]], limit: int, listing: str) -> None:
        first = "; ".join(f"{s['source']}: {s['reason']}" for s in skipped[:3])
        super().__init__(f"{len(skipped)} inputs skipped, more than maxBadSamples {limit} (all in {listing}): {first}")
        self.skipped = skipped


class DatasetWriter:
    """Writes one dataset rooted at ``storage``.

    Args:
        storage: where the dataset goes.
        header: shared facts; every written sample is checked against them.
        num_shards: how many shards the build has (fixed up front so resumption knows what is left).
    """

    def __init__(self, storage: Storage, header: DatasetHeader, num_shards: int) -> None:
        if num_shards < 1:
            raise ValueError(f"a dataset needs at least one shard, got {num_shards}")
        self.storage, self.header, self.num_shards = storage, header, num_shards

    def has_empty_prompt(self) -> bool:
        return self.storage.exists(EMPTY_PROMPT_NAME)

    def write_empty_prompt(self, text: np.ndarray) -> None:
        """Store the empty prompt's embedding (float32 [L, D_text], L ≤ text_len real tokens) with the dataset."""
        self._write_prompt_embedding(EMPTY_PROMPT_NAME, text)

    def write_negative_prompt(self, text: np.ndarray) -> None:
        """Store the negative prompt's embedding (as ``write_empty_prompt``)."""
        self._write_prompt_embedding(NEGATIVE_PROMPT_NAME, text)

    def _write_prompt_embedding(self, name: str, text: np.ndarray) -> None:
        text = np.asarray(text, np.float32)
        if text.ndim != 2 or text.shape[1] != self.header.text_dim or not 1 <= text.shape[0] <= self.header.text_len:
            raise ValueError(
                f"{name}: embedding of shape {text.shape}; expected [1..{self.header.text_len}, {self.header.text_dim}]"
            )
        buffer = io.BytesIO()
        np.save(buffer, text, allow_pickle=False)
        self.storage.write(name, buffer.getvalue())

    def write_prompts(self, prompts: list[str], texts: list[np.ndarray]) -> None:
        """Store validation prompts and their embeddings (each float32 [L_i, D_text]) with the dataset."""
        h = self.header
        padded = np.zeros((len(texts), h.text_len, h.text_dim), np.float32)
        for i, text in enumerate(texts):
            padded[i, : len(text)] = text
        buffer = io.BytesIO()
        np.savez(buffer, text=padded, lengths=np.asarray([len(t) for t in texts]), prompts=np.asarray(prompts))
        self.storage.write(PROMPTS_NAME, buffer.getvalue())

    def start(self) -> list[int]:
        """Record the build settings (or check them against an earlier, interrupted build); return shards to do."""
        build = {"header": self.header.to_dict(), "num_shards": self.num_shards}
        if self.storage.exists(BUILD_NAME):
            before = json.loads(self.storage.read(BUILD_NAME))
            if before != json.loads(json.dumps(build)):
                diff = _diff(before, build)
                raise ValueError(
                    f"{self.storage.join(BUILD_NAME)} records a different build ({diff}); "
                    "write to an empty location or delete the old dataset"
                )
        else:
            self.storage.write(BUILD_NAME, json.dumps(build, indent=1, sort_keys=True).encode())
        return [k for k in range(self.num_shards) if not self.storage.exists(shard_manifest_name(k))]

    def write_shard(self, number: int, samples: Iterable[EncodedSample], skipped: Iterable[dict[str, str]] = ()) -> int:
        """Write shard ``number`` from ``samples`` (in order), then its manifest (module docstring: concurrent
        writers). Returns the samples written."""
        rows: list[dict[str, Any]] = []
        with tempfile.TemporaryDirectory(prefix="wanloom-shard-") as tmp:
            path = Path(tmp) / "shard.tar"
            with ShardWriter(path) as tar:
                for sample in samples:
                    self._check(sample)
                    loc = tar.add(sample.key, encode_sample(sample, self.header.dtype))
                    rows.append(_row(sample, tar.count - 1, loc))
            name = shard_name(number)
            if not self.storage.upload_if_absent(name, path):
                digest = _md5(path)
                if self.storage.md5(name) != digest:
                    name = shard_name(number, digest[:12])
                    self.storage.upload(name, path)
        manifest = {"shard": name, "samples": rows, "skipped": list(skipped)}
        won = self.storage.write_if_absent(shard_manifest_name(number), json.dumps(manifest).encode())
        if not won and json.loads(self.storage.read(shard_manifest_name(number)))["shard"] != name:
            self.storage.delete(name)  # another writer's shard stands
        return len(rows)

    def _check(self, s: EncodedSample) -> None:
        h = self.header
        if s.latents.shape[0] != h.latent_channels:
            raise ValueError(f"sample {s.key}: {s.latents.shape[0]} latent channels, dataset has {h.latent_channels}")
        if s.text.shape[1] != h.text_dim or s.text.shape[0] > h.text_len:
            raise ValueError(f"sample {s.key}: text {s.text.shape} does not fit [<= {h.text_len}, {h.text_dim}]")
        cond = 0 if s.condition is None else s.condition.shape[0]
        if cond != h.condition_channels:
            raise ValueError(f"sample {s.key}: {cond} condition channels, dataset has {h.condition_channels}")

    def finalize(self, max_skipped: int | None = None) -> ShapeIndex:
        """Join every shard manifest into the index and write ``skipped.json``, then ``index.json`` (not when more
        than ``max_skipped`` inputs were skipped: :class:`TooManySkipped`)."""
        self.require_complete()
        manifests = [json.loads(self.storage.read(shard_manifest_name(k))) for k in range(self.num_shards)]
        index = build_index(self.header, manifests)
        skipped = [s for m in manifests for s in m["skipped"]]
        self.storage.write(SKIPPED_NAME, json.dumps(skipped, indent=1).encode())
        if max_skipped is not None and len(skipped) > max_skipped:
            raise TooManySkipped(skipped, max_skipped, self.storage.join(SKIPPED_NAME))
        self.storage.write(INDEX_NAME, index.to_json().encode())
        return index

    def require_complete(self) -> None:
        """Raise ValueError naming the work units not written yet, if any."""
        missing = [k for k in range(self.num_shards) if not self.storage.exists(shard_manifest_name(k))]
        if missing:
            shown = ", ".join(str(k) for k in missing[:10]) + (" ..." if len(missing) > 10 else "")
            raise ValueError(
                f"{self.storage.uri}: {len(missing)} of {self.num_shards} work units are not written yet ({shown}); "
                "run them first (wanloom data prepare --work-unit K)"
            )

    @classmethod
    def resume(cls, storage: Storage) -> DatasetWriter:
        """The writer of the build recorded under ``storage`` (``build.json``): to finalize it elsewhere."""
        try:
            build = json.loads(storage.read(BUILD_NAME))
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{storage.join(BUILD_NAME)}: no dataset build has started there") from exc
        return cls(storage, DatasetHeader(**build["header"]), int(build["num_shards"]))

    def skipped(self) -> list[dict[str, str]]:
        """Inputs the build skipped, over every shard written so far."""
        out: list[dict[str, str]] = []
        for k in range(self.num_shards):
            if self.storage.exists(shard_manifest_name(k)):
                out += json.loads(self.storage.read(shard_manifest_name(k)))["skipped"]
        return out


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _row(sample: EncodedSample, position: int, loc: Any) -> dict[str, Any]:
    return {
        "key": sample.key,
        "source": sample.source,
        "position": position,
        "latent_shape": list(sample.latents.shape[1:]),
        "text_tokens": int(sample.text.shape[0]),
        "pixels": [int(sample.frames), int(sample.height), int(sample.width)],
        "fps": float(sample.fps),
        "span": list(loc.span),
        "member_ranges": [list(m) for m in loc.members],
        "crc32": loc.crc32,
    }


def build_index(header: DatasetHeader, manifests: list[dict[str, Any]]) -> ShapeIndex:
    """The index of shards in manifest order; sample ids follow that order."""
    rows = [(k, r) for k, m in enumerate(manifests) for r in m["samples"]]
    if not rows:
        raise ValueError("the dataset holds no samples (every input was skipped)")
    keys = [r["key"] for _, r in rows]
    if len(set(keys)) != len(keys):
        raise ValueError("sample keys repeat across shards; keys must be unique within a dataset")

    def col(name: str, dtype: Any = np.int64) -> np.ndarray:
        return np.asarray([r[name] for _, r in rows], dtype=dtype)

    return ShapeIndex(
        header=header,
        shards=tuple(m["shard"] for m in manifests),
        keys=tuple(keys),
        shard=np.asarray([k for k, _ in rows], dtype=np.int64),
        position=col("position"),
        latent_shapes=col("latent_shape").reshape(-1, 3),
        text_tokens=col("text_tokens"),
        pixels=col("pixels").reshape(-1, 3),
        fps=col("fps", np.float64),
        sources=tuple(r["source"] for _, r in rows),
        span=col("span").reshape(-1, 2),
        member_ranges=col("member_ranges").reshape(-1, len(MEMBERS), 2),
        crc32=col("crc32"),
    )


def _diff(before: dict[str, Any], now: dict[str, Any]) -> str:
    flat_a, flat_b = _flatten(before), _flatten(now)
    keys = sorted(k for k in set(flat_a) | set(flat_b) if flat_a.get(k) != flat_b.get(k))
    return "; ".join(f"{k}: {flat_a.get(k)!r} there, {flat_b.get(k)!r} now" for k in keys[:5])


def _flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(doc, dict):
        return {prefix: doc}
    out: dict[str, Any] = {}
    for k, v in doc.items():
        out |= _flatten(v, f"{prefix}.{k}" if prefix else k)
    return out
