"""`wanloom compile`: a TPU job's real step compiled ahead of time on this CPU host (libtpu), with its memory.

Each call runs in a fresh process, as a user runs it: libtpu is loaded once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    assert set(programs) == {"accumulate", "accumulate-packed", "update"}  # balanced: the trainer packs
    packed = programs["accumulate-packed"]
    assert packed["rows_per_rank"] == 1 and packed["tokens_per_row"] == 64  # memoryBudgetTokens, context 2 divides it
    step = programs["accumulate"]
    assert step["latent_shape"] == [3, 8, 8] and step["tokens_per_row"] == 48 and step["rows_per_rank"] == 1
    # peak = resident state of both experts + the slot's arguments beyond the expert's parameters + temporaries
    assert report["peak_bytes_per_device"] >= report["resident_bytes"] + step["temp_bytes"] > 0
    assert report["peak_bytes_per_device"] < 96 * 2**30  # fits the real tpu7x device by orders of magnitude


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


def test_compile_refuses_a_job_without_tpu_resources() -> None:
    run = wanloom("compile", str(JOBS / "ti2v-5b-h200-2x8.yaml"))
    assert run.returncode == 1
    assert "spec.resources.tpu is unset" in run.stderr and "Traceback" not in run.stderr


def test_compile_rejects_a_malformed_shape() -> None:
    run = wanloom("compile", str(DATA / "tiny-tpu.yaml"), "--shape", "81x720")
    assert run.returncode != 0 and "expected FRAMESxHEIGHTxWIDTH" in run.stderr
