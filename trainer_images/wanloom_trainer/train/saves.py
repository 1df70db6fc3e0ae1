"""The checkpoint in flight: when it commits, and what happens when storage fails while it is written.

A save is reported (metric, status, log) only once it has committed. A save that storage failed (the bucket or the
network down past the clients' own retries) never committed: orbax and DCP list only complete checkpoints, so the
previous one stays the latest. The run does not crash for it: the save is dropped and the next step boundary saves
the state it has then (``resave``), waiting with ``outage.StorageBreaker`` between tries; storage unreachable for
``spec.data.storageOutageSeconds`` fails the run with ``StorageOutage``, naming the field.

All processes of a run take the same branch: with several, each step a save is in flight they agree on its
outcome (one small gather), so no process saves again alone (a save is collective) or reports a commit another
process saw fail; and they give up on storage together (one gather per lost save). A save one process lost is lost
for all at once: the others do not wait for their part of it, which may hang in the backend's commit barrier for
the peer that failed (orbax waits up to 20 minutes); no new save starts until every process is done with it.
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

# One process's view of the save in flight, ordered so that the max over processes is what all of them must do:
# one failure fails the save everywhere, and only once every process has committed has it committed.
COMMITTED, PENDING, FAILED = 0, 1, 2
POLL_S = 0.5  # how often a process looks at the save it waits for (and processes compare notes)
PROBE_EVERY_S = 5.0  # how often a process waiting for a save checks that storage still answers
BUSY_WAIT_S = 1.0  # between tries to start a save while a lost one is still being written
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
        answers, busy = self._ready()
        if not answers:
            self.resave = True
            log.warning("checkpoint for step %d not started, storage did not answer; the next step tries again",
                        next_step)  # fmt: skip
            self._failures += 1
            self.breaker.failed(f"checkpoints ({self.where})", "the storage probe failed", self._failures,
                                self._give_up_together)  # fmt: skip
            return
        if busy:  # the backend would block in save() until it is done: train on and try at the next step
            self.resave = True
            log.warning("checkpoint for step %d not started: a process is still writing the checkpoint storage "
                        "lost; the next step tries again", next_step)  # fmt: skip
            time.sleep(BUSY_WAIT_S)
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
        outcome = self._outcome(wait, together=agree and self.backend.process_count > 1)
        if outcome == PENDING:
            return
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
        self.breaker.failed(f"checkpoints ({self.where})", detail[:300], self._failures, self._give_up_together)

    def _give_up_together(self, mine: bool) -> bool:
        """Whether any process is past the outage limit: each measures the outage on its own clock, and one that
        stopped alone would leave the others in the next collective."""
        if self.backend.process_count == 1:
            return mine
        return max(self.backend.gather_floats(1.0 if mine else 0.0)) > 0

    def _ready(self) -> tuple[bool, bool]:
        """(every process reached storage just now, some process is still writing a lost save), agreed.

        A save's first part runs collectives (orbax's barriers) around process 0's directory creation: a failure
        there, on one process, would leave the others waiting in a barrier. So processes that cannot reach storage
        all skip the save together instead of starting it; and so do they while one is still busy with a lost
        save. (One process alone has no peer to strand: its save fails where it stands, without a probe.)"""
        busy = self.backend.checkpoint_pending()
        if self.backend.process_count == 1:
            return True, busy
        unreachable = self._probe_error() is not None
        codes = [int(c) for c in self.backend.gather_floats((1.0 if unreachable else 0.0) + (2.0 if busy else 0.0))]
        return not any(c & 1 for c in codes), any(c & 2 for c in codes)

    def _outcome(self, wait: bool, *, together: bool) -> int:
        """The save's outcome, as every process takes it where ``together``; with ``wait``, polled until it is
        not pending. Nobody blocks inside the backend's wait: a part a peer's failure left waiting for that peer,
        or orbax's finalize retrying a write, would hold it for as long as storage stays away. A save still
        pending while storage does not answer the probe is lost (its backend may go on with it, unreported)."""
        next_probe = time.monotonic() + PROBE_EVERY_S
        while True:
            local = self._local_outcome()
            if local == PENDING and wait and time.monotonic() >= next_probe:
                self._error = self._probe_error()
                local = FAILED if self._error is not None else PENDING
                next_probe = time.monotonic() + PROBE_EVERY_S
            outcome = int(max(self.backend.gather_floats(float(local)))) if together else local
            if outcome != PENDING or not wait:
                return outcome
            time.sleep(POLL_S)

    def _probe_error(self) -> BaseException | None:
        """What storage said when asked just now, if it did not answer (None: it answered, or nothing to ask)."""
        if self.probe is None:
            return None
        try:
            self.probe()
        except Exception as exc:
            if not is_storage_outage(exc):
                raise
            return exc
        return None

    def _local_outcome(self) -> int:
        """This process's part of the save, without waiting for it."""
        if self._error is not None:
            return FAILED
        if self.backend.checkpoint_pending():
            return PENDING
        try:
            self.backend.wait_checkpoint()  # returns at once when done; raises what the background save raised
        except Exception as exc:
            if not is_storage_outage(exc):
                raise
            self._error = exc
            return FAILED
        return COMMITTED
