"""One TrainingJob, either backend: the driver (``train.run``) trains the same steps with identical starting
weights on JAX (spmd plans) and PyTorch (per-rank plans): same losses, per-expert losses and gradient norms."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

from wanloom_trainer.model.wan_torch import build_expert
from wanloom_trainer.train.run import run

STEPS = 4


@pytest.mark.slow
def test_jax_and_torch_runs_of_one_job_agree(make_config, tmp_path) -> None:
    for i, folder in enumerate(("transformer", "transformer_2")):
        build_expert(make_config().model.wan, seed=10 + i).save_pretrained(tmp_path / "weights" / folder)
    spec = {
        "model": {"weights": str(tmp_path / "weights")},
        # Each step planned alone: both backends train the same samples in every step. (Planned in windows, the
        # layouts — lockstep slots for torch, packed rows for jax — deal a window's samples to its steps apart.)
        "adaptiveLoad": {"windowSamplesPerRank": 0},
        "optimizer": {"warmupSteps": 1},
        "training": {"steps": STEPS, "checkpoint": {"uri": None}},
    }
    results = {}
    for backend in ("jax", "torch"):
        config = make_config(
            env={"WANLOOM_RUN_DIR": str(tmp_path / backend), "WANLOOM_METRICS_PORT": "0"},
            resources={"backend": backend},
            **spec,
        )
        results[backend] = run(config, progress=False).records
    jax_records, torch_records = results["jax"], results["torch"]
    assert [r.step for r in torch_records] == [r.step for r in jax_records] == list(range(STEPS))
    for j, t in zip(jax_records, torch_records, strict=True):
        assert t.expert_samples == j.expert_samples
        np.testing.assert_allclose(t.loss, j.loss, rtol=1e-4)
        for e in j.expert_loss:
            np.testing.assert_allclose(t.expert_loss[e], j.expert_loss[e], rtol=1e-4)
            np.testing.assert_allclose(t.grad_norm[e], j.grad_norm[e], rtol=1e-3)
