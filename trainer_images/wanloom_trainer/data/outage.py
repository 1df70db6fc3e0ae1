"""Storage outages: a circuit breaker between the loader and its storage.

A storage error that outlasted the per-request retries (``storage.RetryPolicy``) says nothing about the sample: the
bucket, the network or the credentials are down. Counting it as a bad sample would spend the bad-sample budget on
an outage and fail a run that only had to wait (or, with a large budget, train on stand-in rows). So the loader
asks the breaker instead: while storage keeps failing, every reader thread waits with capped exponential backoff
and tries again; the breaker reports how long the outage has lasted (``wanloom_storage_outage_seconds``) and, after
``spec.data.storageOutageSeconds`` without one successful read, fails the run with ``StorageOutage``. Any
successful read closes it. Nothing is skipped and no step runs on data it did not get.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

OutageHook = Callable[[float], Any]  # the exporter's record_storage_outage(seconds); 0 when storage is healthy


class StorageOutage(RuntimeError):
    """Storage stayed unreachable for longer than ``spec.data.storageOutageSeconds``."""


class StorageBreaker:
    """Shared by the reader threads of one dataset; thread-safe."""

    def __init__(
        self,
        limit_s: float,
        *,
        on_outage: OutageHook | None = None,
        max_delay_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if limit_s < 0:
            raise ValueError(f"data.storageOutageSeconds must be >= 0, got {limit_s}")
        self.limit_s, self.on_outage, self.max_delay_s = limit_s, on_outage, max_delay_s
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._since: float | None = None  # start of the current outage

    @property
    def open(self) -> bool:
        return self._since is not None

    def failed(self, where: str, detail: str, attempt: int, give_up: Callable[[bool], bool] | None = None) -> None:
        """A read failed after its retries: wait before the caller tries again, or raise ``StorageOutage``.
        ``give_up`` turns this process's verdict (past the limit or not) into the one every process of the run
        takes (a collective), so all stop together and none is left waiting for a peer that left."""
        now = self._clock()
        with self._lock:
            if self._since is None:
                self._since = now
                log.warning("storage unreachable (%s): waiting up to %.0f s for it to come back", detail, self.limit_s)
            lasted = now - self._since
        self._report(lasted)
        over = lasted >= self.limit_s
        if give_up is not None:
            over = give_up(over)
        if over:
            raise StorageOutage(
                f"storage for {where} unreachable for {lasted:.0f} s (spec.data.storageOutageSeconds="
                f"{self.limit_s:g}); last error: {detail}. Check the bucket, the credentials and the network, "
                "then resume the run (it restarts from its last checkpoint)"
            )
        self._sleep(random.uniform(0.5, 1.0) * min(self.max_delay_s, 0.5 * 2**attempt, max(0.0, self.limit_s - lasted)))

    def succeeded(self) -> None:
        with self._lock:
            if self._since is None:
                return
            lasted, self._since = self._clock() - self._since, None
        log.warning("storage is back after %.1f s", lasted)
        self._report(0.0)

    def _report(self, seconds: float) -> None:
        if self.on_outage is not None:
            try:
                self.on_outage(seconds)
            except Exception:  # a broken metrics hook must not take the data pipeline down with it
                log.exception("the storage-outage hook failed")
