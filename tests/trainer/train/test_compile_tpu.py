"""`wanloom compile`: a TPU job's real step compiled ahead of time on this CPU host (libtpu), with its memory.

Each call runs in a fresh process, as a user runs it: libtpu is loaded once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

DATA = Path(__file__).parent / "data"
JOBS = Path(__file__).resolve().parents[3] / "jobs"


def wanloom(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"} | {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    code = "import sys; from wanloom_cli import main; sys.argv[0] = 'wanloom'; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_compile_reports_memory_and_fails_when_the_step_does_not_fit() -> None:
    pytest.importorskip("libtpu", reason="libtpu (jax[tpu]) is part of the dev install")
    run = wanloom("compile", str(DATA / "tiny-tpu.yaml"), "--json", "--shape", "9x64x64", "--hbm-gib", "0.001")
    assert run.returncode == 1, run.stderr[-3000:]  # 1 MiB per device: the step cannot fit
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["compiled"] is True and report["fits"] is False
    assert report["devices"] == 8 and report["mesh"] == {"data": 2, "fsdp": 2, "context": 2, "tensor": 1}
    assert report["capacity_bytes_per_device"] == int(0.001 * 2**30)
    programs = {p["program"]: p for p in report["programs"]}
    assert set(programs) == {"accumulate", "accumulate-packed", "accumulate-packed-short", "update"}  # the packer's
    packed, short = programs["accumulate-packed"], programs["accumulate-packed-short"]
    assert packed["rows_per_rank"] == 1 and packed["tokens_per_row"] == 64  # memoryBudgetTokens, context 2 divides it
    # --shape 9x64x64: one 48-token bucket, so a row holds one sample plus its padding slot
    assert short["tokens_per_row"] == 16 and packed["segments_per_row"] == short["segments_per_row"] == 2
    step = programs["accumulate"]
    assert step["latent_shape"] == [3, 8, 8] and step["tokens_per_row"] == 48 and step["rows_per_rank"] == 1
    # peak = resident state of both experts + the slot's arguments beyond the expert's parameters + temporaries
    assert report["peak_bytes_per_device"] >= report["resident_bytes"] + step["temp_bytes"] > 0
    assert report["peak_bytes_per_device"] < 96 * 2**30  # fits the real tpu7x device by orders of magnitude


@pytest.mark.slow
def test_a_lora_job_compiles_with_its_frozen_base_resident_and_a_smaller_update(tmp_path: Path) -> None:
    """spec.lora: the step differentiates the adapters only; the base stays resident beside them (counted) and the
    update program holds the adapters' moments alone."""
    pytest.importorskip("libtpu", reason="libtpu (jax[tpu]) is part of the dev install")
    reports = {}
    for name, lora in (("full", None), ("lora", {"rank": 4})):
        job = yaml.safe_load((DATA / "tiny-tpu.yaml").read_text())
        if lora is not None:
            job["spec"]["lora"] = lora
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(job))
        run = wanloom("compile", str(path), "--json", "--shape", "9x64x64")
        assert run.returncode == 0, run.stderr[-3000:]
        reports[name] = json.loads(run.stdout.strip().splitlines()[-1])
    full, lora = reports["full"], reports["lora"]
    assert lora["compiled"] and lora["fits"]
    update = {r: next(p for p in reports[r]["programs"] if p["program"] == "update") for r in reports}
    # The update's arguments: the trained parameters, their moments and gradients (fsdp 2): the adapters are a
    # fraction of the tiny model; the base (~0.1 MB per device) stays resident in both.
    assert update["lora"]["argument_bytes"] < 0.6 * update["full"]["argument_bytes"]
    assert lora["resident_bytes"] < full["resident_bytes"]  # no moments of the base


@pytest.mark.slow
def test_compile_uses_the_compiler_options_the_pods_get(tmp_path: Path) -> None:
    """LIBTPU_INIT_ARGS in spec.resources.env reaches the compiler: an unknown flag there fails the compile."""
    pytest.importorskip("libtpu", reason="libtpu (jax[tpu]) is part of the dev install")
    job = yaml.safe_load((DATA / "tiny-tpu.yaml").read_text())
    job["spec"]["resources"]["env"] = [{"name": "LIBTPU_INIT_ARGS", "value": "--xla_wanloom_test_unknown_flag=true"}]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    run = wanloom("compile", str(path), "--shape", "9x64x64")
    assert run.returncode != 0
    assert "xla_wanloom_test_unknown_flag" in run.stderr, run.stderr[-3000:]


def test_compile_refuses_a_job_without_accelerators() -> None:
    run = wanloom("compile", str(JOBS / "tiny-local.yaml"))
    assert run.returncode == 1
    assert "set spec.resources.tpu or spec.resources.gpu" in run.stderr and "Traceback" not in run.stderr


def test_compile_rejects_a_malformed_shape() -> None:
    run = wanloom("compile", str(DATA / "tiny-tpu.yaml"), "--shape", "81x720")
    assert run.returncode != 0 and "expected FRAMESxHEIGHTxWIDTH" in run.stderr


@pytest.mark.slow
def test_the_tiny_tpu_job_compiles_at_the_default_token_budget(tmp_path: Path) -> None:
    """At the default memoryBudgetTokens (32,768) a packed row could hold 2,048 16-token samples: the packer caps
    segment slots at what the Pallas AdaLN backward can keep in VMEM, and the step compiles (uncapped, 4,096 slots
    needed 73.8 MiB of the 64 MiB)."""
    pytest.importorskip("libtpu", reason="libtpu (jax[tpu]) is part of the dev install")
    job = yaml.safe_load((DATA / "tiny-tpu.yaml").read_text())
    del job["spec"]["adaptiveLoad"]["memoryBudgetTokens"]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    run = wanloom("compile", str(path), "--json", "--shape", "1x64x64")
    assert run.returncode == 0, run.stderr[-3000:]
    programs = {p["program"]: p for p in json.loads(run.stdout.strip().splitlines()[-1])["programs"]}
    assert programs["accumulate-packed"]["tokens_per_row"] == 32_768
    assert programs["accumulate-packed"]["segments_per_row"] == 2048


@pytest.mark.slow
def test_packed_adaln_fits_vmem_at_the_most_segments_the_packer_makes_for_every_shipped_tpu_job() -> None:
    """The packed AdaLN forward and backward, Mosaic-compiled for a tpu7x TensorCore at each shipped TPU job's
    packed rows (its model width, the local share of a row under context × tensor, and the most segment slots the
    packer gives any row of that width), and — the check that the test can fail — the tiny width at twice that."""
    pytest.importorskip("libtpu", reason="libtpu (jax[tpu]) is part of the dev install")
    script = textwrap.dedent(
        """
        import sys
        import jax, jax.numpy as jnp, numpy as np
        from jax.experimental import topologies
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from wanloom_api.validation import load_trainingjob_file
        from wanloom_trainer.config.train_config import from_trainingjob
        from wanloom_trainer.kernels.adaln_pallas import adaln_pallas
        from wanloom_trainer.kernels.adaln_shapes import max_packed_segments

        device = topologies.get_topology_desc(topology_name="tpu7x:2x2x1", platform="tpu").devices[0]
        one = NamedSharding(Mesh(np.array([device]), ("x",)), P())
        spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)

        def adaln(x, scale, shift, ids):
            return jnp.sum(adaln_pallas(x, scale, shift, 1e-6, False, segment_ids=ids).astype(jnp.float32))

        cases = []
        for path in sys.argv[1:]:
            config = from_trainingjob(load_trainingjob_file(path), {})
            shards = config.parallel.context * config.parallel.tensor
            row = -(-config.adaptive_load.memory_budget_tokens // shards)
            cases.append((path, config.model.wan.dim, max_packed_segments(config.model.wan.dim), row))
        cases.append(("tiny x2", 32, 2 * max_packed_segments(32), 32_768))
        for name, dim, segments, tokens in cases:
            args = [spec((1, tokens, dim), jnp.bfloat16), *[spec((1, segments, dim), jnp.float32)] * 2,
                    spec((1, tokens), jnp.int32)]
            try:
                jax.jit(jax.value_and_grad(adaln, (0, 1, 2))).lower(*args).compile()
                print(name, segments, "compiled")
            except Exception as exc:
                print(name, segments, "vmem" if "vmem" in str(exc) else repr(exc)[:300])
        """
    )
    jobs = sorted(str(p) for p in JOBS.glob("*tpu7x*.yaml"))
    assert len(jobs) >= 2
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    run = subprocess.run([sys.executable, "-c", script, *jobs], capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    verdicts = {line.rsplit(" ", 2)[0]: line.rsplit(" ", 1)[1] for line in run.stdout.splitlines()}
    assert verdicts == {**{job: "compiled" for job in jobs}, "tiny x2": "vmem"}, run.stdout
