"""The checkpoint in flight: when it commits, and what happens when storage fails while it is written.

A save is reported (metric, status, log) only once it has committed. A save that storage failed (the bucket or the
network down past the clients' own retries) never committed: orbax and DCP list only complete checkpoints, so the
previous one stays the latest. The run does not crash for it: the save is dropped and the next step boundary saves
the state it has then (``resave``), waiting with ``outage.StorageBreaker`` between tries; storage unreachable for
``spec.data.storageOutageSeconds`` fails the run with ``StorageOutage``, naming the field.

All processes of a run take the same branch: with several, each step a save is in flight they agree on its
outcome (one small gather), so no process saves again alone (a save is collective) or reports a commit another
process saw fail.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from wanloom_trainer.backends.interface import Backend
from wanloom_trainer.data.outage import StorageBreaker
from wanloom_trainer.data.storage import TRANSIENT_HTTP, is_transient

log = logging.getLogger(__name__)

# One process's view of the save in flight, ordered so that the max over processes is what all of them must do.
COMMITTED, FAILED, PENDING = 0, 1, 2
_NETWORK_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EHOSTUNREACH,
                   errno.ENETUNREACH, errno.EPIPE}  # fmt: skip
# tensorstore and XLA put the gRPC status first in the message.
_OUTAGE_STATUS = ("UNAVAILABLE:", "DEADLINE_EXCEEDED:")


def is_storage_outage(exc: BaseException) -> bool:
    """Whether a checkpoint write failed because storage did not answer (anywhere in the exception's chain), as
    opposed to a bug or a bad path: the google client's, gcsfs's (orbax's directories) and tensorstore's (orbax's
    arrays) ways of saying so."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if is_transient(current) or str(current).lstrip().startswith(_OUTAGE_STATUS):
            return True
        if isinstance(current, OSError) and current.errno in _NETWORK_ERRNOS:
            return True
        if type(current).__module__.startswith("aiohttp"):  # gcsfs's transport: a refused or dropped connection
            return True
        if type(current).__name__ == "HttpError" and getattr(current, "code", None) in TRANSIENT_HTTP:
            return True  # gcsfs.retry.HttpError: its retries ran out on a server error
        current = current.__cause__ or current.__context__
    return False


@dataclass
class PendingSave:
    next_step: int
    started: float  # perf_counter


class Saves:
    """The save in flight (at most one) and whether the state must be saved again at the next step boundary."""

    def __init__(
        self,
        backend: Backend,
        where: str,
        outage_limit_s: float,
        on_commit: Callable[[int, float], None],
        on_outage: Callable[[float], object] | None = None,
        probe: Callable[[], object] | None = None,
    ) -> None:
        self.backend, self.where, self.on_commit, self.probe = backend, where, on_commit, probe
        self.breaker = StorageBreaker(outage_limit_s, on_outage=on_outage)
        self.pending: PendingSave | None = None
        self.resave = False  # a save was lost to a storage outage: save the current state at the next boundary
        self._failures = 0  # consecutive lost saves (the breaker's backoff)
        self._error: BaseException | None = None  # this process's failed save, until all processes agreed

    def start(self, state: object, next_step: int, meta: dict[str, object]) -> None:
        """Start saving ``state`` as checkpoint ``next_step`` (the previous save must have been settled)."""
        assert self.pending is None, "one save in flight at a time"
        if not self._storage_answers():
            self.resave = True
            log.warning("checkpoint for step %d not started, storage did not answer; the next step tries again",
                        next_step)  # fmt: skip
            self._failures += 1
            self.breaker.failed(f"checkpoints ({self.where})", "the storage probe failed", self._failures)
            return
        self.resave = False
        self.pending = PendingSave(next_step, time.perf_counter())
        try:
            self.backend.save(state, next_step, meta)
        except Exception as exc:  # a synchronous save (DCP) fails here rather than in wait_checkpoint()
            if not is_storage_outage(exc):
                raise
            self._error = exc
        self.settle(wait=False)  # synchronous backends have committed (or failed) already

    def settle(self, *, wait: bool, agree: bool = True) -> None:
        """Report the save in flight once it has committed; with ``wait``, block until it has. A save storage
        failed is dropped, ``resave`` is set, and this waits the breaker's backoff (or raises ``StorageOutage``).
        ``agree=False``: this process alone (its peers may be inside a collective)."""
        if self.pending is None:
            return
        outcome = self._local_outcome(wait)
        if agree and self.backend.process_count > 1:
            outcome = int(max(self.backend.gather_floats(float(outcome))))
        if outcome == PENDING:
            return
        if outcome == FAILED and self._error is None:
            self._wait_quietly()  # a peer's save failed: this one's may still be writing the same checkpoint
        pending, error, self.pending, self._error = self.pending, self._error, None, None
        if outcome == COMMITTED:
            self._failures = 0
            self.breaker.succeeded()
            self.on_commit(pending.next_step, time.perf_counter() - pending.started)
            log.info("checkpoint for step %d committed (%.1f s after the save started)", pending.next_step,
                     time.perf_counter() - pending.started)  # fmt: skip
            return
        self.resave = True
        detail = f"{type(error).__name__}: {error}" if error is not None else "a peer process's save failed"
        log.warning("checkpoint for step %d not committed, storage did not answer (%s); the previous checkpoint "
                    "stays the latest and the next step saves again", pending.next_step, detail[:300])  # fmt: skip
        self._failures += 1
        self.breaker.failed(f"checkpoints ({self.where})", detail[:300], self._failures)

    def _storage_answers(self) -> bool:
        """Whether every process reached storage just now. A save's first part runs collectives (orbax's barriers)
        around process 0's directory creation: a failure there, on one process, would leave the others waiting in
        a barrier. So processes that cannot reach storage all skip the save together instead of starting it."""
        if self.probe is None or self.backend.process_count == 1:
            return True
        try:
            self.probe()
            ok = 1.0
        except Exception as exc:
            if not is_storage_outage(exc):
                raise
            ok = 0.0
        return min(self.backend.gather_floats(ok)) > 0

    def _local_outcome(self, wait: bool) -> int:
        if self._error is not None:
            return FAILED
        if not wait and self.backend.checkpoint_pending():
            return PENDING
        try:
            self.backend.wait_checkpoint()  # returns at once when done; raises what the background save raised
        except Exception as exc:
            if not is_storage_outage(exc):
                raise
            self._error = exc
            return FAILED
        return COMMITTED

    def _wait_quietly(self) -> None:
        try:
            self.backend.wait_checkpoint()
        except Exception as exc:
            if not is_storage_outage(exc):
                raise
