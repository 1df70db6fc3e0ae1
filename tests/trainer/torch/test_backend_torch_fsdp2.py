"""Two processes (FSDP2 over gloo, per-rank shapes, dummy micro-batches) take the same steps as one process
running all the rows itself; and a two-process kill-and-resume is exact."""

from __future__ import annotations

import numpy as np
import pytest

STEPS = 3  # step 1 routes to the high-noise expert only
ADAM_NOISE = 1e-2 * 3e-3 * STEPS  # 1% of AdamW's largest move of an element (test_context_parallel.py says why)


def _assert_same_run(a: list[dict], b: list[dict], rtol: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        np.testing.assert_allclose(ra["loss"], rb["loss"], rtol=rtol)
        assert [n is None for n in ra["norm"]] == [n is None for n in rb["norm"]]
        np.testing.assert_allclose([n or 0.0 for n in ra["norm"]], [n or 0.0 for n in rb["norm"]], rtol=rtol)


def test_two_process_fsdp2_steps_equal_the_single_process_steps(write_job, run_workers, losses_of, tmp_path) -> None:
    one = write_job("one.yaml", resources={"cpu": {"nodes": 1}})
    two = write_job("two.yaml", resources={"cpu": {"nodes": 2}})
    run_workers(one, tmp_path / "one", 1, "--steps", str(STEPS))
    run_workers(two, tmp_path / "two", 2, "--steps", str(STEPS))
    single = losses_of(tmp_path / "one")
    assert len(single) == STEPS and single[1]["norm"][1] is None
    _assert_same_run(losses_of(tmp_path / "two", 0), single, rtol=1e-5)
    _assert_same_run(losses_of(tmp_path / "two", 1), single, rtol=1e-5)  # every rank reports the global numbers
    want, got = np.load(tmp_path / "one" / "params.npz"), np.load(tmp_path / "two" / "params.npz")
    assert sorted(want) == sorted(got)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=ADAM_NOISE, err_msg=key)


@pytest.mark.slow
def test_two_process_kill_and_resume_is_exact(write_job, run_workers, losses_of, tmp_path) -> None:
    job = write_job(resources={"cpu": {"nodes": 2}}, training={"checkpoint": {"uri": str(tmp_path / "ckpt")}})
    run_workers(job, tmp_path / "full", 2, "--steps", "5")
    assert run_workers(job, tmp_path / "killed", 2, "--steps", "5", "--save-at", "2", "--crash-at", "3") == [-9, -9]
    run_workers(job, tmp_path / "resumed", 2, "--steps", "5", "--resume")
    for rank in (0, 1):
        assert losses_of(tmp_path / "resumed", rank) == losses_of(tmp_path / "full", rank)[2:]
    want, got = np.load(tmp_path / "full" / "params.npz"), np.load(tmp_path / "resumed" / "params.npz")
    assert all(np.array_equal(want[k], got[k]) for k in want)
