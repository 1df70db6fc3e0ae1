"""The online cost refit in the trainer's own loop: how well each cost model predicts the measured slot times.

Runs the tiny two-expert job (`jobs/tiny-local.yaml`, buckets derived from its synthetic data so slots span more
than two sequence lengths) on this machine with each backend, refitting every ``--every`` steps, and reports every
refit: the model in use (its error after one best scale factor), the fitted family's and the analytic FLOP model's
5-fold held-out relative RMS errors, and the verdict; and the median step time.

On a CPU host the timings are those of a tiny model on a shared core, noisy and dominated by per-call overhead; the
numbers that matter for a cluster come from running this on its devices.

Usage (writes benchmarks/results/cost_refit.json):

    PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/cost_refit.py
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tiny_job import tiny_config

from wanloom_trainer.train.run import run

OUT = Path(__file__).parent / "results" / "cost_refit.json"
PATTERN = re.compile(
    r"step (?P<step>\d+): cost refit (?P<verdict>accepted|rejected|kept the model in use).*?: (?P<kind>[\w-]+) fit of "
    r"(?P<n>\d+) slot timings: held-out error (?P<fit>[\d.]+)% vs (?P<analytic>[\d.]+)% for the analytic FLOP "
    r"model \(model in use: (?P<in_use>[\d.]+)%\)"
)


class _Refits(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if match := PATTERN.search(record.getMessage()):
            row = match.groupdict()
            self.rows.append(
                {
                    "step": int(row["step"]),
                    "verdict": row["verdict"].split()[0],
                    "family": row["kind"],
                    "timings": int(row["n"]),
                    "heldout_error": float(row["fit"]) / 100,
                    "analytic_heldout_error": float(row["analytic"]) / 100,
                    "in_use_error": float(row["in_use"]) / 100,
                    "analytic_adopted": row["verdict"] == "accepted" and "refitted" in record.getMessage(),
                }
            )


def one_run(backend: str, steps: int, every: int) -> dict[str, Any]:
    handler = _Refits()
    logger = logging.getLogger("wanloom_trainer.train.run")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            config = tiny_config(
                workdir,
                adaptiveLoad={"buckets": None, "refitEverySteps": every},
                training={"steps": steps, "checkpoint": {"uri": None}},
                resources={"backend": backend},
            )
            result = run(config, progress=False)
    finally:
        logger.removeHandler(handler)
    times = [r.step_time_s for r in result.records[every:]]  # after the first programs compiled
    return {"refits": handler.rows, "median_step_time_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()
    results = {backend: one_run(backend, args.steps, args.every) for backend in ("torch", "jax")}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    for backend, res in results.items():
        print(f"{backend}: median step {res['median_step_time_s'] * 1e3:.1f} ms")
        for r in res["refits"]:
            print(
                f"  step {r['step']:4d} {r['verdict']:9s} {r['family']:8s} n={r['timings']:4d} "
                f"fit {r['heldout_error']:.1%}  analytic {r['analytic_heldout_error']:.1%}  "
                f"in use {r['in_use_error']:.1%}{'  -> analytic refitted' if r['analytic_adopted'] else ''}"
            )


if __name__ == "__main__":
    main()
