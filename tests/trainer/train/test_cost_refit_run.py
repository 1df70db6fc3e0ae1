"""The online cost refit in a real run (torch backend, tiny model, CPU): slot timings reach the refit, a refit that
beats the model in use plans the steps after it, the checkpoint carries the decision, and a run resumed from that
checkpoint plans (and so trains) those steps exactly as the uninterrupted run did.

A tiny model's slot times on a CPU are mostly per-call overhead, so whether a refit carries enough shape signal to
pass its checks (``adaptiveload.cost.refit.degenerate``) depends on the machine's timing noise: the tests hold whatever
process 0 decided to the log it wrote (the acceptance rules themselves are tested on exact timings in
tests/trainer/adaptiveload/test_refit.py)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from wanloom_trainer.feed.process import PLAN_DEPTH, STEPS_AHEAD
from wanloom_trainer.train.run import run

STEPS, EVERY = 30, 10
# A deliberately wrong model in use (cost ∝ S³): any fit to real timings beats it, so a refit is always adopted.
WRONG_MODEL = {"costModel": "power", "exponent": 3.0, "computeBudget": 1.0e9, "buckets": None}


def _config(tiny: Any, workdir: Path, **training: Any) -> Any:
    return tiny.tiny_config(
        workdir,
        adaptiveLoad={**WRONG_MODEL, "refitEverySteps": EVERY},
        training={"steps": STEPS, "checkpoint": {"interval": 20, "keep": 5}, **training},
        resources={"backend": "torch"},
    )


def test_an_adopted_refit_plans_the_later_steps_and_survives_a_resume(
    tiny: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="wanloom_trainer.train.run")
    config = _config(tiny, tmp_path / "a")
    first = run(config, progress=False)
    refits = [r.getMessage() for r in caplog.records if "cost refit" in r.getMessage()]
    assert [m.split(":")[0] for m in refits] == [f"step {s}" for s in range(EVERY - 1, STEPS, EVERY)], refits
    assert all(" accepted" in m or " rejected" in m or " kept" in m for m in refits), refits
    adopted = [int(m.split()[1].rstrip(":")) for m in refits if "cost refit accepted" in m]

    meta = json.loads((tmp_path / "a" / "checkpoints" / "step_00000020" / "meta.json").read_text())
    changes = meta["meta"]["cost_models"] if "meta" in meta else meta["cost_models"]
    lag = PLAN_DEPTH + config.data.prefetch + 2 + STEPS_AHEAD
    # Every adoption decided before the checkpoint, in effect a lag after its step; nothing else.
    assert [first_step for first_step, _ in changes] == [s + lag for s in adopted if s < 20], (changes, refits)

    # Resume from step 20 in a fresh directory: the refit decided before the checkpoint plans steps 20..29.
    resumed_dir = tmp_path / "b"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_00000020", resumed_dir / "checkpoints" / "step_00000020")
    shutil.copytree(tmp_path / "a" / "data", resumed_dir / "data")
    second = run(_config(tiny, resumed_dir), progress=False)
    assert second.start_step == 20
    assert [r.loss for r in second.records] == [r.loss for r in first.records[20:]]


@pytest.mark.slow
def test_two_processes_adopt_process_0s_refit_together(tmp_path: Path) -> None:
    """`wanloom run --processes 2` (torch, FSDP2 over gloo): process 0 refits and broadcasts; both processes plan
    the later steps with its model. Had they planned differently, their FSDP collectives would not pair up."""
    import subprocess
    import sys

    import yaml

    root = Path(__file__).resolve().parents[3]
    doc = yaml.safe_load((root / "jobs" / "tiny-local-torch.yaml").read_text())
    doc["spec"]["adaptiveLoad"] = {**doc["spec"].get("adaptiveLoad", {}), **WRONG_MODEL, "refitEverySteps": 4}
    doc["spec"]["adaptiveLoad"].pop("buckets")
    doc["spec"]["data"]["uri"] = str(tmp_path / "data")
    doc["spec"]["training"]["checkpoint"]["uri"] = str(tmp_path / "checkpoints")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    code = "import sys; from wanloom_cli import main; sys.argv[0] = 'wanloom'; main()"
    args = ["run", str(job), "--processes", "2", "--steps", "20", "--metrics-port", "0", "--no-progress",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    refits = [line for line in out.splitlines() if "cost refit" in line]
    assert len(refits) == 5, out[-4000:]  # process 0 decided after steps 3, 7, …, 19; both planned alike or hung


def test_step_time_is_the_wall_time_between_steps(tiny: Any, tmp_path: Path) -> None:
    """Work between two steps (here a slow step hook; in a run the reporting and checkpoint bookkeeping) belongs
    to the step time, so tokens/s and MFU are not optimistic."""
    import time

    config = tiny.tiny_config(
        tmp_path, training={"steps": 12, "checkpoint": {"uri": None}}, resources={"backend": "torch"}
    )
    result = run(config, progress=False, on_step=lambda _: time.sleep(0.2))
    assert all(r.step_time_s >= 0.2 for r in result.records[1:]), [r.step_time_s for r in result.records]
