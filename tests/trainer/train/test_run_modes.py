"""The image-to-video modes end to end from the CLI on CPU, on both backends: `wanloom run` of
jobs/tiny-ti2v-local.yaml (one model, per-token timesteps, first frame clean on half the clips) and
jobs/tiny-i2v-local.yaml (two experts, image condition channels), as a user runs them."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from wanloom_trainer.train.loss_log import read_log

ROOT = Path(__file__).resolve().parents[3]
STEPS = 30


def _job(tmp_path: Path, name: str, backend: str, fraction: float | None = None) -> Path:
    text = (ROOT / "jobs" / f"{name}.yaml").read_text()
    text = text.replace(f"runs/{name}/", f"{tmp_path}/")
    if backend == "torch":
        text = text.replace("\n  resources:\n", "\n  resources:\n    backend: torch\n")
    if fraction is not None:  # step 0 holds the stream's first samples, clips among them
        text = text.replace("imageToVideoFraction: 0.5", f"imageToVideoFraction: {fraction}")
        text = text.replace("\n  adaptiveLoad:\n", "\n  adaptiveLoad:\n    windowSamplesPerRank: 0\n")
    path = tmp_path / f"{name}-{backend}.yaml"
    path.write_text(text)
    return path


def _run(job: Path, tmp_path: Path, steps: int, run_dir: str) -> list:
    code = "import sys; from wanloom_cli import main; sys.argv[0] = 'wanloom'; main()"
    args = ["run", str(job), "--steps", str(steps), "--metrics-port", "0", "--no-progress", "--run-dir",
            str(tmp_path / run_dir)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_log(tmp_path / run_dir / "steps.jsonl")


@pytest.mark.parametrize("backend", ["jax", "torch"])
@pytest.mark.parametrize("name", ["tiny-ti2v-local", "tiny-i2v-local"])
def test_image_to_video_job_trains_from_the_cli(name: str, backend: str, tmp_path: Path) -> None:
    records = _run(_job(tmp_path, name, backend), tmp_path, STEPS, "run")
    assert [r.step for r in records] == list(range(STEPS))
    assert all(math.isfinite(r.loss) for r in records)
    first, last = statistics.mean(r.loss for r in records[:3]), statistics.mean(r.loss for r in records[-5:])
    assert last < 0.9 * first, (first, last)
    experts = {e for r in records for e, n in r.expert_samples.items() if n}
    assert experts == ({0} if name == "tiny-ti2v-local" else {0, 1})  # TI2V: one model; I2V: both experts
    saved = [int("".join(c for c in p.name if c.isdigit())) for p in (tmp_path / "checkpoints").iterdir()]
    assert STEPS in saved, saved  # the backends name their checkpoint folders differently


@pytest.mark.slow
def test_image_to_video_fraction_reaches_the_step(tmp_path: Path) -> None:
    """Same job, seed and data: all clips image-to-video vs none gives a different step-0 loss (the clean first
    frame and its t = 0 tokens change what the model sees and what the loss counts); images alone would not."""
    losses = {}
    for fraction in (0.0, 1.0):
        (tmp_path / str(fraction)).mkdir()
        job = _job(tmp_path / str(fraction), "tiny-ti2v-local", "jax", fraction)
        losses[fraction] = _run(job, tmp_path / str(fraction), 1, "run")[0].loss
    assert abs(losses[0.0] - losses[1.0]) > 1e-3 * losses[0.0], losses
