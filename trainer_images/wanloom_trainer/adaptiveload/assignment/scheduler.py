"""Which samples make up global step ``step``: deterministic in (seed, step) only, so a resumed run replays them.

Two orders, both covering every sample exactly once per epoch and computing the data cursor from ``step`` (no
mutable state survives between steps):

- ``SampleStream`` (policy "balanced"): each epoch is a seeded permutation of the whole dataset; step s takes
  positions [s·G, (s+1)·G) of the concatenated epochs, G = ``training.globalBatch``. The planner then decides which
  rank runs which sample.
- ``BucketChunks`` (policies "paper" and "equal-tokens"): each epoch shuffles every bucket's samples, cuts them into
  chunks of that bucket's batch size B_b (the last chunk of a bucket may be short), and shuffles the chunk order.
  Chunk j of the concatenated epochs is a rank's work for one step: with the per-rank layout rank r of step s takes
  chunk s·R + r (ranks draw buckets independently, as in Open-Sora 2.0); with the SPMD layout chunks are R·B_b
  samples and step s takes chunk s whole (every rank runs the same bucket, as an SPMD program must). The global
  sample count per step therefore varies with the buckets drawn.
"""

from __future__ import annotations

import numpy as np

_STREAM_TAG = 0x5A11  # separates data-order draws from other consumers of the same seed
_CHUNK_TAG = 0xC4C4
_CACHE_EPOCHS = 4


class SampleStream:
    """Epoch-shuffled stream over ``n`` samples; positions index the shape index (0..n-1)."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError("the dataset holds no samples")
        self.n, self.seed = n, seed
        self._perms: dict[int, np.ndarray] = {}

    def epoch(self, e: int) -> np.ndarray:
        if e not in self._perms:
            if len(self._perms) >= _CACHE_EPOCHS:
                self._perms.pop(min(self._perms))
            self._perms[e] = np.random.default_rng([self.seed, e, _STREAM_TAG]).permutation(self.n)
        return self._perms[e]

    def take(self, start: int, count: int) -> np.ndarray:
        """Sample positions int64 [count] at stream positions [start, start + count)."""
        parts, pos, end = [], start, start + count
        while pos < end:
            e, off = divmod(pos, self.n)
            k = min(end - pos, self.n - off)
            parts.append(self.epoch(e)[off : off + k])
            pos += k
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def step(self, step: int, global_batch: int) -> np.ndarray:
        return self.take(step * global_batch, global_batch)


class BucketChunks:
    """Per-epoch shuffled chunks of single-bucket samples (see the module docstring).

    Args:
        bucket_of: int [n] bucket index of each sample.
        chunk_sizes: int [k] samples per chunk for each bucket (B_b, or R·B_b for the SPMD layout).
        seed: data-order seed.
    """

    def __init__(self, bucket_of: np.ndarray, chunk_sizes: np.ndarray, seed: int) -> None:
        self.bucket_of = np.asarray(bucket_of, dtype=np.int64)
        self.chunk_sizes = np.asarray(chunk_sizes, dtype=np.int64)
        if (self.chunk_sizes < 1).any():
            raise ValueError(f"chunk sizes must be >= 1, got {self.chunk_sizes.tolist()}")
        self.seed = seed
        self.members = [np.flatnonzero(self.bucket_of == b) for b in range(len(self.chunk_sizes))]
        self.per_epoch = int(sum(-(-len(m) // c) for m, c in zip(self.members, self.chunk_sizes, strict=True)))
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _build(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(samples in chunk order, chunk start offsets [C + 1], chunk bucket [C]) of epoch ``e``."""
        chunks: list[np.ndarray] = []
        buckets: list[int] = []
        for b, (m, size) in enumerate(zip(self.members, self.chunk_sizes, strict=True)):
            perm = np.random.default_rng([self.seed, e, _CHUNK_TAG, b]).permutation(m)
            chunks.extend(perm[i : i + size] for i in range(0, len(perm), size))
            buckets.extend([b] * (-(-len(m) // size)))
        order = np.random.default_rng([self.seed, e, _CHUNK_TAG]).permutation(len(chunks))
        ordered = [chunks[i] for i in order]
        offsets = np.concatenate([[0], np.cumsum([len(c) for c in ordered])])
        return np.concatenate(ordered), offsets, np.asarray(buckets, dtype=np.int64)[order]

    def chunk(self, j: int) -> tuple[int, np.ndarray]:
        """(bucket, sample positions) of chunk ``j`` of the concatenated epochs."""
        e, c = divmod(j, self.per_epoch)
        if e not in self._epochs:
            if len(self._epochs) >= _CACHE_EPOCHS:
                self._epochs.pop(min(self._epochs))
            self._epochs[e] = self._build(e)
        samples, offsets, buckets = self._epochs[e]
        return int(buckets[c]), samples[offsets[c] : offsets[c + 1]]
