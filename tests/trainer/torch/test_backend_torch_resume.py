"""Kill-and-resume: a run killed mid-step after a checkpoint and resumed from it reproduces the uninterrupted
run's losses, gradient norms and final parameters exactly (CPU, gloo, one process)."""

from __future__ import annotations

import numpy as np

STEPS, SAVE_AT, CRASH_AT = 6, 3, 4


def test_killed_and_resumed_run_reproduces_the_uninterrupted_losses_exactly(
    write_job, run_workers, losses_of, tmp_path
) -> None:
    job = write_job(training={"checkpoint": {"uri": str(tmp_path / "ckpt"), "keep": 1}})
    run_workers(job, tmp_path / "full", 1, "--steps", str(STEPS))
    codes = run_workers(
        job, tmp_path / "killed", 1, "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--crash-at", str(CRASH_AT)
    )
    assert codes == [-9]  # SIGKILL, half-way through step CRASH_AT
    run_workers(job, tmp_path / "resumed", 1, "--steps", str(STEPS), "--resume")

    full, killed, resumed = (losses_of(tmp_path / d) for d in ("full", "killed", "resumed"))
    assert [r["step"] for r in killed] == list(range(CRASH_AT))
    assert [r["step"] for r in resumed] == list(range(SAVE_AT, STEPS))
    assert killed == full[:CRASH_AT]
    assert resumed == full[SAVE_AT:]  # bit-for-bit: losses and gradient norms of both experts
    assert full[1]["norm"][1] is None  # step 1 routes to the high-noise expert only
    want, got = np.load(tmp_path / "full" / "params.npz"), np.load(tmp_path / "resumed" / "params.npz")
    assert sorted(want) == sorted(got)
    assert all(np.array_equal(want[k], got[k]) for k in want)
