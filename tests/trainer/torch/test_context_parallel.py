"""Context parallelism (diffusers' Ulysses attention over gloo) takes the same steps as the unsharded run.

Each case runs ``_backend_worker.py`` in one process and again over a mesh with ``context`` 2: the same plan, so
the same losses, gradient norms and final weights within float32 reduction-order noise. The cases cover the three
model layouts (T2V, I2V with condition channels, TI2V with per-token timesteps), both AdaLN implementations, FSDP
sharding across the context peers, and rematerialisation.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

STEPS = 3  # step 1 routes to the high-noise expert only
# AdamW moves an element by about the learning rate (tiny-local's 3e-3) per step whatever its gradient's size, so an
# element whose gradient is near zero moves by an amount reduction-order noise decides; measured: 8.4e-6 once in CI.
# The weights agree to 1% of the most any element can move; the losses and gradient norms carry the tight check.
ADAM_NOISE = 1e-2 * 3e-3 * STEPS

CASES = {
    "t2v-reference-context2": dict(variant="tiny", adaln="reference", remat="none", fsdp=1, processes=2),
    "i2v-fused-remat-context2": dict(variant="tiny-i2v", adaln="fused", remat="full", fsdp=1, processes=2),
    "ti2v-fused-fsdp2-context2": dict(variant="tiny-ti2v", adaln="fused", remat="save-attention", fsdp=2, processes=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_steps_equal_the_unsharded_steps(case, write_job, run_workers, losses_of, tmp_path) -> None:
    c = CASES[case]
    spec = {"model": {"variant": c["variant"]}, "kernels": {"adaln": c["adaln"]}}
    one = write_job("one.yaml", **spec, parallelism={"fsdp": 1, "remat": c["remat"]}, resources={"cpu": {"nodes": 1}})
    sharded = write_job(
        "cp.yaml",
        **spec,
        parallelism={"fsdp": c["fsdp"], "context": 2, "remat": c["remat"]},
        resources={"cpu": {"nodes": c["processes"]}},
    )
    run_workers(one, tmp_path / "one", 1, "--steps", str(STEPS))
    run_workers(sharded, tmp_path / "cp", c["processes"], "--steps", str(STEPS))
    for rank in range(c["processes"]):  # diffusers split the sequence; FSDP shards over fsdp x context ranks
        got = json.loads((tmp_path / "cp" / f"layout-rank{rank}.json").read_text())
        assert got["context"] == 2
        assert got["parameter_share"] == pytest.approx(1 / c["processes"], rel=0.05)
    want = losses_of(tmp_path / "one")
    assert len(want) == STEPS
    for rank in range(c["processes"]):  # every rank, context peers included, reports the global numbers
        got = losses_of(tmp_path / "cp", rank)
        assert [r["step"] for r in got] == [r["step"] for r in want]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
            assert [n is None for n in a["norm"]] == [n is None for n in b["norm"]]
            np.testing.assert_allclose([n or 0.0 for n in a["norm"]], [n or 0.0 for n in b["norm"]], rtol=1e-5)
    params_one, params_cp = np.load(tmp_path / "one" / "params.npz"), np.load(tmp_path / "cp" / "params.npz")
    assert sorted(params_one) == sorted(params_cp)
    for key in params_one:
        np.testing.assert_allclose(params_cp[key], params_one[key], rtol=1e-4, atol=ADAM_NOISE, err_msg=key)
