"""Held-out validation loss (spec.validation): the held-out samples never reach training, the fixed timesteps
cover each expert's band, and a real `wanloom run` validates on schedule, deterministically: a run resumed from a
checkpoint reproduces the uninterrupted run's validation losses and training losses bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest

from wanloom_api.trainingjob import ValidationSpec
from wanloom_trainer.evaluation.validation import band_timesteps
from wanloom_trainer.feed.holdout import held_out_ids

ROOT = Path(__file__).resolve().parents[3]
VALIDATION = {"everySteps": 2, "samples": 5, "timestepsPerExpert": 3, "videos": 2, "inferenceSteps": 4}


def test_band_timesteps_are_the_midpoints_of_each_experts_band() -> None:
    assert band_timesteps(0.875, 2) == [(0, 906.25), (0, 968.75), (1, 218.75), (1, 656.25)]
    assert band_timesteps(None, 2) == [(0, 250.0), (0, 750.0)]


def test_hold_out_is_a_seeded_choice_and_leaves_samples_to_train_on() -> None:
    spec = ValidationSpec.model_validate({"everySteps": 1, "samples": 4})
    ids = np.arange(20)
    held = held_out_ids(ids, spec, seed=3)
    assert len(held) == 4 and np.array_equal(held, np.sort(held))
    np.testing.assert_array_equal(held, held_out_ids(ids, spec, seed=3))
    assert not np.array_equal(held, held_out_ids(ids, spec, seed=4))
    with pytest.raises(ValueError, match=r"spec.validation.samples=4 would hold out every sample of the dataset \(4\)"):
        held_out_ids(np.arange(4), spec, seed=0)


def test_the_planner_never_plans_a_held_out_sample(tiny: Any, tmp_path: Path) -> None:
    from wanloom_trainer.data import ensure_synthetic, open_dataset
    from wanloom_trainer.feed.inputs import make_planner

    config = tiny.tiny_config(tmp_path, validation=VALIDATION)
    ensure_synthetic(config.data, config.model.wan)
    with open_dataset(config.data.uri, max_bad_samples=0) as dataset:
        held = set(held_out_ids(dataset.sample_shapes().ids, config.validation, config.seed).tolist())
        planner = make_planner(config, dataset.sample_shapes(), layout="spmd")
        planned = {
            int(i)
            for step in range(40)
            for rank in planner.plan(step).ranks
            for mb in rank.micro_batches
            for i in mb.sample_ids
        }
    assert len(held) == VALIDATION["samples"]
    assert not planned & held
    assert len(planned) == dataset.num_samples - len(held)  # everything else is trained on


def _run(job: Path, workdir: Path, without_torch: bool = False) -> subprocess.CompletedProcess:
    """`wanloom run` of ``job`` in a fresh process, on the CPU, with its run directory in ``workdir/run``
    (``without_torch``: PyTorch, diffusers and transformers unimportable, as in the TPU image)."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer_images")]),
    }
    args = ["run", str(job), "--no-progress", "--metrics-port", "0", "--run-dir", str(workdir / "run")]
    block = "import sys; sys.modules.update(torch=None, diffusers=None, transformers=None); " if without_torch else ""
    return subprocess.run(
        [sys.executable, "-c", f"{block}from wanloom_cli import main; main()", *args],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_wanloom_run_validates_on_schedule_and_a_resume_reproduces_it(backend: str, tiny: Any, tmp_path: Path) -> None:
    spec = {
        "resources": {"backend": backend},
        "validation": VALIDATION,
        "optimizer": {"warmupSteps": 1},
        "training": {"steps": 4, "checkpoint": {"interval": 2, "keep": 3}},
    }
    job = tiny.write_job(tmp_path / "job.yaml", tiny.tiny_job(tmp_path, **spec))
    first = _run(job, tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "validation loss after step 4: high_noise " in first.stdout
    whole_steps = _lines(tmp_path / "run" / "steps.jsonl")
    whole = _lines(tmp_path / "run" / "validation.jsonl")
    assert [v["step"] for v in whole] == [2, 4]
    for record in whole:
        assert set(record["losses"]) == {"high_noise", "low_noise"}
        assert all(0.0 < loss < 100.0 for loss in record["losses"].values())
        assert record["seconds"] > 0.0
    assert whole[0]["losses"] != whole[1]["losses"]  # the weights moved between the two
    samples = tmp_path / "run" / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["step-000002", "step-000004"]
    for folder in samples.iterdir():
        names = sorted(p.name for p in folder.iterdir())
        ids = sorted({n.split(".")[0] for n in names if n.startswith("sample-")})
        assert len(ids) == VALIDATION["videos"]
        assert names == ["contact-sheet.png", "decode.json", *sorted(f"{i}.{e}" for i in ids for e in ("mp4", "npy"))]
        for video in (f"{i}.mp4" for i in ids):
            with av.open(str(folder / video)) as container:
                frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
            assert frames and frames[0].shape[2] == 3 and frames[0].shape[0] % 8 == frames[0].shape[1] % 8 == 0
    sheets = [(samples / f"step-00000{s}" / "contact-sheet.png").read_bytes() for s in (2, 4)]
    assert sheets[0] != sheets[1]  # same noise and prompts, other weights

    last = "4" if backend == "jax" else "step_00000004"
    shutil.rmtree(tmp_path / "checkpoints" / last)  # as if killed before the last checkpoint
    again = _run(job, tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resuming from the checkpoint of step 2" in again.stderr
    resumed = _lines(tmp_path / "run" / "validation.jsonl")
    # step 2's record stays from the first run; step 4's is recomputed after the resume, to the bit
    assert [(v["step"], v["losses"]) for v in resumed] == [(v["step"], v["losses"]) for v in whole]
    # the videos after step 4 are made again from the same weights, noise and prompts: the same pixels
    assert (samples / "step-000004" / "contact-sheet.png").read_bytes() == sheets[1]
    resumed_steps = _lines(tmp_path / "run" / "steps.jsonl")
    assert [r["loss"] for r in resumed_steps] == [r["loss"] for r in whole_steps]


@pytest.mark.slow
def test_spec_export_writes_the_final_model_when_the_run_completes(tiny: Any, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    from wanloom_api.validation import validate_trainingjob

    export = {"uri": str(tmp_path / "model"), "format": "wan", "dtype": "float32"}
    spec = {"export": export, "optimizer": {"warmupSteps": 1}, "training": {"steps": 2}}
    job = tiny.write_job(tmp_path / "job.yaml", tiny.tiny_job(tmp_path, **spec))
    proc = _run(job, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"model exported to {tmp_path / 'model'} (spec.export)" in proc.stdout
    files = sorted(p.name for p in (tmp_path / "model").iterdir())
    assert files == ["tiny-local_high_noise.safetensors", "tiny-local_low_noise.safetensors"]
    assert "head.modulation" in load_file(tmp_path / "model" / files[0])

    doc = tiny.tiny_job(tmp_path).model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["spec"]["export"] = {**export, "ema": True}
    errors = {e.path: e.message for e in validate_trainingjob(doc).errors}
    assert errors == {"spec.export.ema": "export.ema needs optimizer.ema: without it no EMA weights are kept"}


def test_a_jax_run_without_pytorch_writes_its_validation_videos(tiny: Any, tmp_path: Path) -> None:
    """The TPU image's case: no PyTorch VAE, so the JAX VAE decodes the samples to mp4 and the contact sheet."""
    validation = {"everySteps": 2, "samples": 2, "videos": 1, "inferenceSteps": 2}
    job = tiny.tiny_job(tmp_path, validation=validation, optimizer={"warmupSteps": 1}, training={"steps": 2})
    proc = _run(tiny.write_job(tmp_path / "job.yaml", job), tmp_path, without_torch=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    folder = tmp_path / "run" / "samples" / "step-000002"
    [video] = sorted(folder.glob("sample-*.mp4"))
    with av.open(str(video)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    latents = np.load(video.with_suffix(".npy"))
    assert len(frames) == 4 * (latents.shape[2] - 1) + 1 and frames[0].shape[:2] == tuple(
        8 * s for s in latents.shape[3:]
    )
    assert (folder / "contact-sheet.png").is_file() and "no VAE can run here" not in proc.stderr


@pytest.mark.slow
def test_prompts_of_the_dataset_become_videos_too(tiny: Any, tmp_path: Path) -> None:
    from wanloom_trainer.data import ensure_synthetic, open_dataset
    from wanloom_trainer.data.prepare.writer import DatasetWriter
    from wanloom_trainer.data.storage import open_storage

    validation = {"everySteps": 2, "samples": 2, "videos": 0, "inferenceSteps": 2,
                  "promptSize": {"frames": 5, "height": 32, "width": 48}}  # fmt: skip
    job = tiny.tiny_job(tmp_path, validation=validation, optimizer={"warmupSteps": 1}, training={"steps": 2})
    config = tiny.tiny_config(tmp_path)
    ensure_synthetic(config.data, config.model.wan)
    with open_dataset(config.data.uri, max_bad_samples=0) as dataset:
        header = dataset.index.header
    rng = np.random.default_rng(0)
    texts = [rng.standard_normal((n, header.text_dim)).astype(np.float32) for n in (3, 5)]
    DatasetWriter(open_storage(config.data.uri), header, 1).write_prompts(["a fox", "the sea"], texts)
    proc = _run(tiny.write_job(tmp_path / "job.yaml", job), tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    folder = tmp_path / "run" / "samples" / "step-000002"
    assert (folder / "prompts.txt").read_text() == "prompt-000: a fox\nprompt-001: the sea\n"
    for i in range(2):
        assert np.load(folder / f"prompt-{i:03d}.npy").shape == (1, 4, 2, 4, 6)  # 5x32x48 pixels as latents
        with av.open(str(folder / f"prompt-{i:03d}.mp4")) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == 5 and frames[0].shape == (32, 48, 3)
