"""Per-bucket batch sizes: the AdaptiveLoad dual-constraint rule and the equal-token baseline.

- paper (arXiv 2605.17923, eq. for B_shape): ``B = max(1, min(⌊M_mem/S⌋, ⌊M_comp/S^p⌋))`` — memory is linear in
  tokens, compute grows as S^p.
- equal-tokens: ``B = ⌊M_mem/S⌋`` (B·S ≈ const), clamped to 1 like the paper so no bucket is dropped.

Both raise if a bucket holds more tokens than M_mem: one sample would not fit a micro-batch.
"""

from __future__ import annotations

import numpy as np


def _check_memory(tokens: np.ndarray, memory_budget_tokens: int) -> np.ndarray:
    s = np.asarray(tokens, dtype=np.int64)
    if memory_budget_tokens < 1:
        raise ValueError(f"memoryBudgetTokens must be >= 1, got {memory_budget_tokens}")
    if (s > memory_budget_tokens).any():
        raise ValueError(
            f"memoryBudgetTokens={memory_budget_tokens} is smaller than the longest sample ({int(s.max())} tokens); "
            "raise it or drop that bucket"
        )
    return s


def equal_token_batch_sizes(tokens: np.ndarray, memory_budget_tokens: int) -> np.ndarray:
    """B = ⌊M_mem/S⌋ per bucket, int64 [k]."""
    s = _check_memory(tokens, memory_budget_tokens)
    return np.maximum(1, memory_budget_tokens // s)


def paper_batch_sizes(
    tokens: np.ndarray, memory_budget_tokens: int, compute_budget: float, exponent: float
) -> np.ndarray:
    """B = max(1, min(⌊M_mem/S⌋, ⌊M_comp/S^p⌋)) per bucket, int64 [k]."""
    s = _check_memory(tokens, memory_budget_tokens)
    if compute_budget <= 0 or exponent <= 0:
        raise ValueError(f"computeBudget and exponent must be positive, got {compute_budget}, {exponent}")
    # A relative epsilon keeps ⌊·⌋ from losing a whole sample to rounding when M_comp is an exact multiple.
    by_memory = memory_budget_tokens // s
    by_compute = np.floor(compute_budget / s.astype(np.float64) ** exponent * (1 + 1e-12))
    return np.maximum(1, np.minimum(by_memory, np.minimum(by_compute, by_memory).astype(np.int64)))


def default_compute_budget(
    tokens: np.ndarray, exponent: float, memory_budget_tokens: int, samples: np.ndarray | None = None
) -> float:
    """M_comp = max(S_max^p, the sample-weighted median over buckets of the memory-full batch compute ⌊M_mem/S⌋·S^p).

    Buckets whose memory-full batch would compute more than the typical one are cut down to it (the long-clip
    stragglers the rule exists for); lighter buckets stay memory-bound. Never below one longest sample: the
    B = 1 clamp keeps that bucket at S_max^p anyway, so a smaller budget would only lighten the other ranks and
    widen the imbalance. ``samples`` [k] weights the median (default one per bucket).
    """
    s = _check_memory(tokens, memory_budget_tokens).astype(np.float64)
    full = np.floor(memory_budget_tokens / s) * s**exponent
    w = np.ones_like(full) if samples is None else np.asarray(samples, dtype=np.float64)
    order = np.argsort(full, kind="stable")
    cum = np.cumsum(w[order])
    median = float(full[order][np.searchsorted(cum, 0.5 * cum[-1])])
    return max(median, float(s.max() ** exponent))
