"""Random access to a prepared dataset: ``open_dataset(uri)`` → ``LatentDataset.load(sample_ids)`` → numpy batch.

Framework-free (numpy only), shared by the JAX and the PyTorch trainer. Each sample is one byte-range read of its
shard (offsets from the index), checked against the index's CRC-32 and shapes, widened to float32, and fitted to
the micro-batch's bucket shape (fit.py). The unique samples of a call are fetched in parallel threads from remote
storage, in the calling thread from local storage.

Storage errors that outlast the per-request retries are not bad samples: the reader waits for storage to come back
(``outage.StorageBreaker``) and fails the run only after ``storage_outage_s``. Bad samples (missing shard, corrupt
bytes) never raise out of ``load`` on their own: each is logged, reported through ``on_skip`` and counted
(skips.py) until more than ``max_bad_samples`` distinct samples are bad. What happens to its row is ``bad_policy``:

- ``"pad"`` (default): the row stays, filled with a copy of another row of the same call (zeros if none is
  good) and marked ``valid=False``: the batch keeps the planned size, so SPMD shapes and cross-rank lockstep
  hold, and the trainer gives the row weight 0 exactly as it does the planner's padding rows;
- ``"drop"``: the row is removed; ``positions`` say which planned rows remain.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from wanloom_trainer.data import skips
from wanloom_trainer.data.fit import fit_latents
from wanloom_trainer.data.format import MEMBERS, TENSOR_MEMBERS, CorruptSample, decode_tensor
from wanloom_trainer.data.index import (
    EMPTY_PROMPT_NAME,
    INDEX_NAME,
    NEGATIVE_PROMPT_NAME,
    PROMPTS_NAME,
    ShapeIndex,
)
from wanloom_trainer.data.outage import OutageHook, StorageBreaker
from wanloom_trainer.data.shards import payload_crc
from wanloom_trainer.data.storage import MissingObject, RetryPolicy, Storage, open_storage, split_uri

log = logging.getLogger(__name__)
BadPolicy = Literal["pad", "drop"]
DEFAULT_OUTAGE_S = 600.0  # spec.data.storageOutageSeconds' default
_STORAGE = "storage"  # a read failed in storage, not in the sample: the breaker's business, never a skip


@dataclass(frozen=True)
class LatentBatch:
    """Rows of one micro-batch, float32, all of one latent shape.

    Attributes:
        latents: [b, C, T', H', W'] normalised VAE latents.
        text_embeds: [b, L, D_text], L = the dataset's text_len, zero after each row's text_lens tokens.
        text_lens: int64 [b] real tokens per row.
        condition: [b, Cc, T', H', W'] (I2V: 4 mask channels + first-frame latents) or None.
        sample_ids: int64 [b] the sample whose data fills each row; -1 for a zero row.
        positions: int64 [b] the planned row (index into the requested ids, and so into the micro-batch's
            timesteps and weights) each row stands for; -1 for a placeholder row with no planned sample.
        valid: bool [b] False where the row only pads (a bad sample's stand-in, a placeholder).
    """

    latents: np.ndarray
    text_embeds: np.ndarray
    text_lens: np.ndarray
    condition: np.ndarray | None
    sample_ids: np.ndarray
    positions: np.ndarray
    valid: np.ndarray

    @property
    def size(self) -> int:
        return len(self.sample_ids)

    @property
    def nbytes(self) -> int:
        arrays = (self.latents, self.text_embeds, self.condition)
        return sum(a.nbytes for a in arrays if a is not None)


@dataclass(frozen=True)
class _Sample:
    latents: np.ndarray  # [C, T', H', W']
    text: np.ndarray  # [L_i, D]
    condition: np.ndarray | None


class _BadSample(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class LatentDataset:
    """A prepared dataset opened for random access (see the module docstring for the bad-sample policy)."""

    def __init__(
        self,
        index: ShapeIndex,
        storage: Storage,
        *,
        max_bad_samples: int,
        on_skip: skips.SkipHook | None = None,
        bad_policy: BadPolicy = "pad",
        workers: int = 8,
        verify_checksums: bool = True,
        breaker: StorageBreaker | None = None,
    ) -> None:
        if bad_policy not in ("pad", "drop"):
            raise ValueError(f"bad_policy {bad_policy!r} is not one of 'pad', 'drop'")
        self.index, self.storage, self.bad_policy = index, storage, bad_policy
        self.verify_checksums = verify_checksums
        self.budget = skips.SkipBudget(max_bad_samples, on_skip)
        self.breaker = breaker or StorageBreaker(DEFAULT_OUTAGE_S)
        self._known_bad: dict[int, _BadSample] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="wanloom-read")

    # --- what the planner and the trainers read -------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return self.index.num_samples

    @property
    def latent_shapes(self) -> np.ndarray:
        """int64 [n, 3]: (T', H', W') per sample id."""
        return self.index.latent_shapes

    def sample_shapes(self) -> Any:
        """``adaptiveload.SampleShapes`` for the planner (ids 0..n-1)."""
        return self.index.sample_shapes()

    @property
    def latent_channels(self) -> int:
        return self.index.header.latent_channels

    @property
    def condition_channels(self) -> int:
        return self.index.header.condition_channels

    @property
    def text_len(self) -> int:
        return self.index.header.text_len

    @property
    def text_dim(self) -> int:
        return self.index.header.text_dim

    def empty_prompt(self, needed_by: str = "spec.data.captionDropout") -> np.ndarray:
        """float32 [text_len, text_dim]: the empty prompt's embedding, zero-padded like every sample's text;
        ``needed_by`` names the setting that asked for it in the error when the dataset has none."""
        if not self.storage.exists(EMPTY_PROMPT_NAME):
            raise ValueError(
                f"{needed_by}: the dataset at {self.storage.uri} has no {EMPTY_PROMPT_NAME} (datasets prepared "
                "before it existed); re-run `wanloom data prepare` on it, or turn the setting off"
            )
        return self._prompt_embedding(EMPTY_PROMPT_NAME)

    def negative_prompt(self, needed_by: str = "spec.validation.negativePrompt") -> np.ndarray:
        """float32 [text_len, text_dim]: the negative prompt ``wanloom data prepare --negative-prompt`` encoded."""
        if not self.storage.exists(NEGATIVE_PROMPT_NAME):
            raise ValueError(
                f"{needed_by}: the dataset at {self.storage.uri} has no {NEGATIVE_PROMPT_NAME}; encode one with "
                "`wanloom data prepare ... --negative-prompt TEXT`, or set negativePrompt: false"
            )
        return self._prompt_embedding(NEGATIVE_PROMPT_NAME)

    def _prompt_embedding(self, name: str) -> np.ndarray:
        text = np.load(io.BytesIO(self.storage.read(name)), allow_pickle=False)
        padded = np.zeros((self.text_len, self.text_dim), np.float32)
        padded[: text.shape[0]] = text
        return padded

    def validation_prompts(self) -> tuple[np.ndarray, list[str]]:
        """(float32 [N, text_len, text_dim] embeddings, the N prompts) that ``wanloom data prepare --prompts``
        stored with the dataset."""
        if not self.storage.exists(PROMPTS_NAME):
            raise ValueError(
                f"spec.validation.promptSize: the dataset at {self.storage.uri} has no {PROMPTS_NAME}; encode a "
                "prompts file with `wanloom data prepare ... --prompts FILE`, or unset promptSize"
            )
        with np.load(io.BytesIO(self.storage.read(PROMPTS_NAME)), allow_pickle=False) as doc:
            text, prompts = doc["text"], [str(p) for p in doc["prompts"]]
        if text.shape[1:] != (self.text_len, self.text_dim):
            raise ValueError(f"{self.storage.join(PROMPTS_NAME)}: embeddings {text.shape[1:]} do not fit the dataset")
        return text.astype(np.float32), prompts

    # --- loading ---------------------------------------------------------------------------------------------
    def load(self, sample_ids: Any, latent_shape: tuple[int, int, int] | None = None) -> LatentBatch:
        """Rows for ``sample_ids`` (repeats allowed), fitted to ``latent_shape`` (default: their common shape).

        Raises:
            ValueError: ids out of range, or mixed shapes without ``latent_shape``.
            skips.TooManyBadSamples: the bad-sample budget is spent.
        """
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        target = self._target_shape(ids, latent_shape)
        unique = list(dict.fromkeys(ids.tolist()))
        fetched = self._fetch_all(unique)
        rows: list[_Sample | None] = []
        for i in ids.tolist():
            got = fetched[i]
            if isinstance(got, _BadSample):
                self.budget.record(i, got.reason, got.detail)
                rows.append(None)
            else:
                rows.append(_Sample(fit_latents(got.latents, target), got.text, _fit_opt(got.condition, target)))
        return self._assemble(ids, rows, target)

    def load_each(self, sample_ids: Any, latent_shapes: Any) -> list[LatentBatch]:
        """One single-row batch per sample, each fitted to its own shape (a packed micro-batch's segments). The
        samples are fetched together; a bad one comes back as an invalid zero row of its shape (never dropped: its
        place in the packed row is planned)."""
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        shapes = [tuple(int(v) for v in s) for s in latent_shapes]
        if len(shapes) != len(ids):
            raise ValueError(f"{len(ids)} sample ids but {len(shapes)} latent shapes")
        self._target_shape(ids, shapes[0] if shapes else None)  # range check
        unique = list(dict.fromkeys(ids.tolist()))
        fetched = self._fetch_all(unique)
        out = []
        for j, (i, shape) in enumerate(zip(ids.tolist(), shapes, strict=True)):
            got = fetched[i]
            if isinstance(got, _BadSample):
                self.budget.record(i, got.reason, got.detail)
                row = None
            else:
                row = _Sample(fit_latents(got.latents, shape), got.text, _fit_opt(got.condition, shape))
            out.append(self._stack([row], np.array([i if row else -1]), np.array([j]), shape))
        return out

    def placeholder(self, latent_shape: tuple[int, int, int], rows: int = 1) -> LatentBatch:
        """Zero rows of ``latent_shape`` marked invalid: the planner's dummy micro-batches (no sample ids)."""
        empty = np.full(rows, -1, dtype=np.int64)
        return self._stack([None] * rows, empty, empty, tuple(int(v) for v in latent_shape))  # type: ignore[arg-type]

    def _target_shape(self, ids: np.ndarray, latent_shape: tuple[int, int, int] | None) -> tuple[int, int, int]:
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_samples):
            bad = ids[(ids < 0) | (ids >= self.num_samples)][0]
            raise ValueError(f"sample id {bad} is out of range; the dataset has ids 0..{self.num_samples - 1}")
        if latent_shape is not None:
            return tuple(int(v) for v in latent_shape)  # type: ignore[return-value]
        shapes = np.unique(self.latent_shapes[ids], axis=0)
        if len(shapes) != 1:
            raise ValueError(
                f"samples {ids.tolist()} have {len(shapes)} latent shapes {shapes.tolist()}; pass latent_shape"
            )
        return tuple(int(v) for v in shapes[0])  # type: ignore[return-value]

    def _assemble(self, ids: np.ndarray, rows: list[_Sample | None], target: tuple[int, int, int]) -> LatentBatch:
        positions = np.arange(len(ids), dtype=np.int64)
        good = [j for j, r in enumerate(rows) if r is not None]
        if self.bad_policy == "drop":
            return self._stack([rows[j] for j in good], ids[good], positions[good], target)
        source = ids.copy()
        filled = list(rows)
        for j, r in enumerate(rows):
            if r is None:
                donor = good[j % len(good)] if good else None
                filled[j] = rows[donor] if donor is not None else None
                source[j] = ids[donor] if donor is not None else -1
        batch = self._stack(filled, source, positions, target)
        return dataclasses.replace(batch, valid=np.array([r is not None for r in rows], dtype=bool))

    def _stack(
        self, rows: list[_Sample | None], ids: np.ndarray, positions: np.ndarray, target: tuple[int, int, int]
    ) -> LatentBatch:
        b, h = len(rows), self.index.header
        latents = np.zeros((b, h.latent_channels, *target), dtype=np.float32)
        text = np.zeros((b, h.text_len, h.text_dim), dtype=np.float32)
        lens = np.zeros(b, dtype=np.int64)
        cond = np.zeros((b, h.condition_channels, *target), dtype=np.float32) if h.condition_channels else None
        for j, r in enumerate(rows):
            if r is None:
                continue
            latents[j], lens[j] = r.latents, len(r.text)
            text[j, : len(r.text)] = r.text
            if cond is not None and r.condition is not None:
                cond[j] = r.condition
        valid = np.array([r is not None for r in rows], dtype=bool)
        return LatentBatch(latents, text, lens, cond, ids.astype(np.int64), positions.astype(np.int64), valid)

    def _fetch_all(self, unique: list[int]) -> dict[int, _Sample | _BadSample]:
        """The samples of one call: in parallel threads from remote storage (their reads overlap), in this thread
        from local storage (a thread hand-off cost more than reading a small sample)."""
        if self.storage.remote and len(unique) > 1:
            return dict(zip(unique, self._pool.map(self._fetch, unique), strict=True))
        return {i: self._fetch(i) for i in unique}

    def _fetch(self, sample_id: int) -> _Sample | _BadSample:
        """One sample's tensors at its stored shape, or why it cannot be used. Storage errors are no verdict on
        the sample: they wait on the breaker (outage.py) until storage answers or the outage limit passes."""
        if sample_id in self._known_bad:
            return self._known_bad[sample_id]
        for attempt in itertools.count():
            try:
                span = self._read_span(sample_id)
            except _BadSample as bad:
                if bad.reason == _STORAGE:
                    self.breaker.failed(self.storage.uri, bad.detail, attempt)
                    continue
                self._known_bad[sample_id] = bad
                return bad
            self.breaker.succeeded()
            break
        try:
            return self._decode(sample_id, span)
        except _BadSample as bad:
            self._known_bad[sample_id] = bad
            return bad

    def _read_span(self, sample_id: int) -> bytes:
        shard = self.index.shards[self.index.shard[sample_id]]
        offset, length = (int(v) for v in self.index.span[sample_id])
        where = f"sample {sample_id} ({self.index.keys[sample_id]} in {self.storage.join(shard)})"
        try:
            return self.storage.read_range(shard, offset, length)
        except MissingObject as exc:
            raise _BadSample(skips.MISSING, f"{where}: {exc}") from exc
        except EOFError as exc:
            raise _BadSample(skips.CORRUPT, f"{where}: truncated shard: {exc}") from exc
        except OSError as exc:
            raise _BadSample(_STORAGE, f"{where}: {exc}") from exc

    def _decode(self, sample_id: int, span: bytes) -> _Sample:
        idx, where = self.index, f"sample {sample_id} ({self.index.keys[sample_id]})"
        view = memoryview(span)
        parts = {
            name: view[off : off + size]
            for name, (off, size) in zip(MEMBERS, idx.member_ranges[sample_id].tolist(), strict=True)
            if off >= 0
        }
        if self.verify_checksums and payload_crc(list(parts.values())) != int(idx.crc32[sample_id]):
            raise _BadSample(skips.CORRUPT, f"{where}: CRC-32 mismatch")
        try:
            tensors = {k: decode_tensor(parts[m], idx.header.dtype) for k, m in TENSOR_MEMBERS.items() if m in parts}
            return self._checked(sample_id, tensors)
        except (CorruptSample, KeyError) as exc:
            raise _BadSample(skips.CORRUPT, f"{where}: {exc}") from exc

    def _checked(self, sample_id: int, t: dict[str, np.ndarray]) -> _Sample:
        h, shape = self.index.header, tuple(int(v) for v in self.latent_shapes[sample_id])
        expect = {"latents": (h.latent_channels, *shape), "text": (int(self.index.text_tokens[sample_id]), h.text_dim)}
        if h.condition_channels:
            expect["condition"] = (h.condition_channels, *shape)
        for name, want in expect.items():
            if name not in t or t[name].shape != want:
                got = t[name].shape if name in t else "nothing"
                raise CorruptSample(f"{name} has shape {got}, the index promises {want}")
            if not np.isfinite(t[name]).all():
                raise CorruptSample(f"{name} holds non-finite values")
        return _Sample(t["latents"], t["text"], t.get("condition"))

    # --- checkpointed state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.budget.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.budget.load_state_dict(state)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> LatentDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fit_opt(x: np.ndarray | None, target: tuple[int, int, int]) -> np.ndarray | None:
    return None if x is None else fit_latents(x, target)


def read_index(uri: str, index: str | None = None, retry: RetryPolicy | None = None) -> ShapeIndex:
    """The index of the dataset at ``uri`` (``index`` overrides its location, default ``<uri>/index.json``)."""
    where = index or f"{str(uri).rstrip('/')}/{INDEX_NAME}"
    root, name = split_uri(where)
    try:
        text = open_storage(root, retry).read(name)
    except MissingObject as exc:
        raise FileNotFoundError(
            f"no shape index at {where}: prepare the dataset first (wanloom data prepare / synth), "
            "or set spec.data.index"
        ) from exc
    return ShapeIndex.from_json(text, where=where)


def open_dataset(
    uri: str,
    index: str | None = None,
    *,
    max_bad_samples: int,
    on_skip: skips.SkipHook | None = None,
    bad_policy: BadPolicy = "pad",
    workers: int = 8,
    verify_checksums: bool = True,
    retry: RetryPolicy | None = None,
    storage_outage_s: float = DEFAULT_OUTAGE_S,
    on_outage: OutageHook | None = None,
) -> LatentDataset:
    """Open the dataset at ``uri`` (path or gs://) for random access; shards are read lazily, by byte range.
    Storage that stays unreachable for ``storage_outage_s`` fails the run (``outage.StorageOutage``)."""
    return LatentDataset(
        read_index(uri, index, retry),
        open_storage(uri, retry),
        max_bad_samples=max_bad_samples,
        on_skip=on_skip,
        bad_policy=bad_policy,
        workers=workers,
        verify_checksums=verify_checksums,
        breaker=StorageBreaker(storage_outage_s, on_outage=on_outage),
    )
