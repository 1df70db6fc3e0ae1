"""One work unit written on a thread while the main thread encodes the next batches.

Samples pass through a short queue, so at most a few encoded samples wait in memory. A unit is published (tar,
then manifest) only when the encoder finished it: if encoding raises, the writer is told to abort and publishes
nothing, so a retried unit never finds a partial shard. An error in the writer reaches the encoding thread at its
next ``put``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from types import TracebackType

from wanloom_trainer.data.format import EncodedSample
from wanloom_trainer.data.prepare.stages import StageClock
from wanloom_trainer.data.prepare.writer import DatasetWriter

_QUEUE_SAMPLES = 8
_POLL_S = 0.5


class _Abort(Exception):
    """Raised inside the writer's sample stream: the unit is not to be published."""


class BackgroundWrite:
    """``with BackgroundWrite(...) as sink: sink.put(sample) ...``: ``writer.write_shard(number, ...)`` on a thread;
    its busy time (not its waits for samples) is the unit's "write" stage."""

    _END = object()

    def __init__(self, writer: DatasetWriter, number: int, skipped: list[dict[str, str]], clock: StageClock) -> None:
        self._writer, self._number, self._skipped, self._clock = writer, number, skipped, clock
        self._queue: queue.Queue[object] = queue.Queue(maxsize=_QUEUE_SAMPLES)
        self._error: BaseException | None = None
        self._waited = 0.0
        self._thread = threading.Thread(target=self._run, name=f"write-unit-{number}", daemon=True)

    def __enter__(self) -> BackgroundWrite:
        self._thread.start()
        return self

    def put(self, sample: EncodedSample) -> None:
        if not self._offer(sample) and self._error is not None:
            raise self._error

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._offer(self._END if exc is None else _Abort())
        self._thread.join()
        if exc is None and self._error is not None:
            raise self._error

    def _offer(self, item: object) -> bool:
        """Queue ``item`` unless the writer thread has stopped; False when it had."""
        while self._thread.is_alive():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _samples(self) -> Iterator[EncodedSample]:
        while True:
            started = time.perf_counter()
            item = self._queue.get()
            self._waited += time.perf_counter() - started
            if item is self._END:
                return
            if isinstance(item, _Abort):
                raise item
            yield item  # type: ignore[misc]

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self._writer.write_shard(self._number, self._samples(), self._skipped)
        except _Abort:
            pass
        except BaseException as exc:  # handed to the encoding thread, which raises it
            self._error = exc
        finally:
            self._clock.time("write", time.perf_counter() - started - self._waited)
