"""The bad-sample budget: every skipped sample is logged, reported to a metric hook and counted against a limit.

A sample is bad when its shard is missing or its bytes are broken (storage outages are not: outage.py waits them
out). Skips are counted twice: per draw (how many planned rows lost their data) and per distinct sample (how much of
the dataset is broken). ``spec.data.maxBadSamples`` bounds the distinct samples one loader process may skip: the
next new one fails the run with a message naming the limit and the sample, while a broken sample drawn again in a
later epoch is skipped again without spending more of the budget. Both counts are part of the loader's checkpointed
state, so a resumed run keeps its budget.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# Reasons, as the ``reason`` label of wanloom_skipped_samples_total.
MISSING = "missing"  # the shard (or the index's byte range) is gone
CORRUPT = "corrupt"  # checksum, npy header, shape or non-finite values
REASONS = (MISSING, CORRUPT)

SkipHook = Callable[..., Any]  # the exporter's record_skipped(reason, n=1, *, distinct=0)


class TooManyBadSamples(RuntimeError):
    """More samples were skipped than ``spec.data.maxBadSamples`` allows."""


class SkipBudget:
    """Thread-safe skip counter with a limit on distinct samples; ``record`` raises TooManyBadSamples past it."""

    def __init__(self, limit: int, on_skip: SkipHook | None = None) -> None:
        if limit < 0:
            raise ValueError(f"data.maxBadSamples must be >= 0, got {limit}")
        self.limit, self.on_skip = limit, on_skip
        self._lock = threading.Lock()
        self.by_reason: Counter[str] = Counter()  # per draw
        self.distinct: dict[int, str] = {}  # sample id -> reason, each bad sample once

    @property
    def skipped(self) -> int:
        """Skipped draws (a sample drawn twice counts twice)."""
        return sum(self.by_reason.values())

    def record(self, sample_id: int, reason: str, detail: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"skip reason {reason!r} is not one of {', '.join(REASONS)}")
        with self._lock:
            self.by_reason[reason] += 1
            first = sample_id not in self.distinct
            self.distinct.setdefault(sample_id, reason)
            count = len(self.distinct)
        if first and count <= self.limit:  # past the limit the run fails with the message below instead
            log.warning("skipping sample %d (%s, %d of %d allowed): %s", sample_id, reason, count, self.limit, detail)
        if self.on_skip is not None:
            try:
                self.on_skip(reason, 1, distinct=int(first))
            except Exception:  # a broken metrics hook must not take the data pipeline down with it
                log.exception("the skip hook failed")
        if count > self.limit:
            raise TooManyBadSamples(
                f"{count} distinct samples skipped, more than data.maxBadSamples={self.limit} "
                f"({dict(Counter(self.distinct.values()))}); last: {detail}. Repair or rebuild "
                "the dataset (wanloom data prepare), or raise spec.data.maxBadSamples"
            )

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "skipped_by_reason": dict(self.by_reason),
                "bad_samples": {str(k): v for k, v in self.distinct.items()},
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        counts = state.get("skipped_by_reason", {})
        distinct = {int(k): v for k, v in state.get("bad_samples", {}).items()}
        bad = (set(counts) | set(distinct.values())) - set(REASONS)
        if bad:
            raise ValueError(f"loader state has unknown skip reasons {sorted(bad)}; valid: {', '.join(REASONS)}")
        with self._lock:
            self.by_reason = Counter({k: int(v) for k, v in counts.items()})
            self.distinct = distinct
