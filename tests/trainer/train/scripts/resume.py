"""Kill-and-resume on CPU: the resumed run reproduces the uninterrupted run's losses exactly.

Run A trains 8 steps uninterrupted. Run B crashes inside step 5 (after the checkpoint for step 4 and before the
one for step 6); run C, started fresh on B's directories, resumes from step 4. Prints the three loss sequences,
C's start step, the retained checkpoints and B's step log after C (the full history); also, for a short run with
per-batch routing, which experts got samples and which were updated in each step; and the same kill and resume
for a LoRA job with EMA (adapters, their moments and their average restored; the base reloaded).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import jax
from tiny_job import tiny_config

from wanloom_trainer.backends.jax.backend import JaxBackend
from wanloom_trainer.distributed_jax import prepare_platform
from wanloom_trainer.train.loss_log import read_log
from wanloom_trainer.train.run import run

SPEC = {
    "training": {"steps": 8, "checkpoint": {"interval": 2, "keep": 2}},
    "optimizer": {"warmupSteps": 2},
    "data": {"synthetic": {"samples": 16}},
}


class Crash(RuntimeError):
    pass


def crash_at(step: int, committed: Path):
    """A kill in ``step``'s hook once checkpoint ``committed`` is on disk: the save is asynchronous, and on a busy
    machine it can still be in flight two steps later (a kill then rightly resumes from the one before)."""

    def hook(record) -> None:
        if record.step == step:
            deadline = time.monotonic() + 300
            while not (committed / "commit_success.txt").exists():
                if time.monotonic() > deadline:
                    raise AssertionError(f"checkpoint {committed} not committed within 300 s")
                time.sleep(0.05)
            raise Crash(f"simulated kill in step {step}")

    return hook


def train(workdir: Path, spec: dict | None = None, **kwargs) -> object:
    config = tiny_config(workdir, **(spec or SPEC))
    prepare_platform(config)  # a no-op for the already-imported jax, but checks its device count
    return run(config, backend=JaxBackend(config.backend_config, devices=jax.devices()[:1]), progress=False, **kwargs)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        a_dir, b_dir = Path(tmp, "a"), Path(tmp, "b")
        a = train(a_dir)
        try:
            train(b_dir, on_step=crash_at(5, b_dir / "checkpoints" / "4"))
            raise AssertionError("run B did not crash")
        except Crash:
            pass
        b_log = [r.loss for r in read_log(b_dir / "run" / "steps.jsonl")]
        c = train(b_dir)
        pb = train(Path(tmp, "pb"), {**SPEC, "routing": {"mode": "per-batch"}, "training": {"steps": 6}})
        lora_spec = {**SPEC, "lora": {"rank": 4, "alpha": 8.0}, "optimizer": {"warmupSteps": 2, "ema": {"decay": 0.9}}}
        lora_a = train(Path(tmp, "la"), lora_spec)
        try:
            train(Path(tmp, "lb"), lora_spec, on_step=crash_at(5, Path(tmp, "lb", "checkpoints", "4")))
            raise AssertionError("LoRA run B did not crash")
        except Crash:
            pass
        lora_c = train(Path(tmp, "lb"), lora_spec)
        print(
            json.dumps(
                {
                    "a": [r.loss for r in a.records],
                    "b_before_resume": b_log,
                    "c": [r.loss for r in c.records],
                    "c_start": c.start_step,
                    "checkpoints": sorted(int(p.name) for p in (b_dir / "checkpoints").iterdir() if p.name.isdigit()),
                    "b_history": [r.loss for r in read_log(b_dir / "run" / "steps.jsonl")],
                    "plot": str(c.plot) if c.plot else None,
                    "per_batch_experts": [sorted(e for e, n in r.expert_samples.items() if n) for r in pb.records],
                    "per_batch_updated": [sorted(r.grad_norm) for r in pb.records],
                    "lora_a": [r.loss for r in lora_a.records],
                    "lora_c": [r.loss for r in lora_c.records],
                    "lora_c_start": lora_c.start_step,
                }
            )
        )


if __name__ == "__main__":
    sys.exit(main())
