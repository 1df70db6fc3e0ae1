"""What a data-preparation pod reports: seconds per stage, samples encoded, inputs skipped by kind.

The stages, in a source's order through the pipeline: ``read`` (bytes from GCS or disk), ``decode`` (PyAV or
Pillow), ``resize`` (into the bucket), ``vae`` (the pixels, and the I2V condition), ``text`` (umT5) and ``write``
(tar, upload, manifest). read/decode/resize run on the CPU pool, vae/text in the main process, write on a
background thread, so their sums may exceed the wall time; the slowest of (CPU stages / workers, vae + text,
write) bounds it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from wanloom_api.metrics import PREPARE_STAGES as STAGES


@dataclass
class PrepareProgress:
    """Counts since the last report (a unit's worth), or totals when summed with ``add``."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    samples: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    units: int = 0

    def add(self, other: PrepareProgress) -> None:
        for stage, s in other.seconds.items():
            self.seconds[stage] = self.seconds.get(stage, 0.0) + s
        self.samples += other.samples
        self.skipped.update(other.skipped)
        self.units += other.units

    def summary(self) -> str:
        """One log line: samples, skips and where the time went."""
        times = ", ".join(f"{stage} {self.seconds.get(stage, 0.0):.2f} s" for stage in STAGES)
        skipped = sum(self.skipped.values())
        return f"{self.samples} samples, {skipped} skipped; {times}"


class StageClock:
    """Thread-safe accumulator of one unit's :class:`PrepareProgress` (the writer thread adds its seconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._progress = PrepareProgress()

    def time(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._progress.seconds[stage] += seconds

    def sample(self) -> None:
        with self._lock:
            self._progress.samples += 1

    def skip(self, kind: str) -> None:
        with self._lock:
            self._progress.skipped[kind] += 1

    def take(self, units: int) -> PrepareProgress:
        """What was counted since the last ``take``, as ``units`` finished units; the clock starts again."""
        with self._lock:
            taken, self._progress = self._progress, PrepareProgress()
        taken.units = units
        return taken


ProgressCallback = Callable[[PrepareProgress], None]
